"""`jet bench async`: the asynchronous trainer against the synchronous barrier, on one workload.

The workload is the same in both runs: a fleet of `slots` synthetic rollout
workers in this process, each looping over GRPO group members: wait a
heavy-tailed time (log-normal, the environment), sample a completion from a
real tiny model (`jet.workers.inference.hf`, following `weights:<model>` like an
inference worker, so every trajectory carries the version that generated
it), wait again, score it and publish the Trajectory to `traj:<model>`. The
reward is the share of completion tokens in a target set (ids divisible by
8: 1/8 at random), which a policy can learn in a few dozen steps. The
episode times are drawn per (group, member) from one seed, so both runs see
the same durations.

The trainer is the real `jet train` (torch backend, a subprocess), once with
`max_staleness: 0` (the synchronous baseline: after each publish it waits for
trajectories generated entirely by the new version, dropping the rest) and
once with the default bound. Rollouts start when the trainer has joined its
consumer group, so no backlog piles up during its start-up.

Reported per run, over the window from step 1 to the last step (from the
trainer's metrics): optimiser steps per minute, trainer busy fraction
(forward/backward/optimiser/publish time over wall time), trajectories
dropped as stale, the mean training reward of the last steps, and the
reward of the final weights on held-out prompts (256 samples). The ratio is
async over sync. The goal: >= 1.5x the steps per minute with a final reward
no worse than sync's (within two standard errors), at equal steps.

Timing decides which trajectories each step trains on, so two runs of one
seed differ, and at this learning rate they differ a lot. `--repeats N` runs
N seeded pairs and judges the reward on the paired differences (async - sync,
same seed): their mean must be above -2 standard errors of that mean.
`jet bench staleness` measures the objective's side of it without timing.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import subprocess
import tempfile
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import anyio
import click
import yaml

from jet.bench import emit, progress, redis_url_option, server_url
from jet.keys import GROUP_TRAINER, Keys
from jet.runs import RunDir, read_metrics
from jet.stats import standard_error
from jet.supervisor import python_module

MODEL = "tiny"
GOAL = 1.5
LR = 1e-2  # large for a real model; a random tiny one needs it to learn visibly in 30 steps
PROMPT_LEN, COMPLETION = 8, 8
DEFAULTS = {"steps": 30, "slots": 16, "group_size": 4, "batch_groups": 4, "median_s": 0.4, "sigma": 1.0}
QUICK = {"steps": 4, "slots": 8, "group_size": 2, "batch_groups": 2, "median_s": 0.1, "sigma": 0.8}


@dataclass
class Result:
    mode: str
    run: str  # run name (folder under runs/)
    max_staleness: int
    steps: int
    window_s: float
    steps_per_min: float
    busy_fraction: float
    produced: int  # trajectories published by the rollout fleet
    stale: int  # dropped by the trainer as too old
    groups_dropped: int
    staleness_mean: float
    train_reward_last: float  # mean training reward of the last 5 steps
    eval_reward: float  # the final weights on held-out prompts
    eval_se: float


def reward_of(tokens: list[int]) -> float:
    return sum(1 for t in tokens if t % 8 == 0) / COMPLETION


def prompt_of(seed: int, group: int, vocab: int) -> list[int]:
    rng = random.Random(f"{seed}-prompt-{group}")
    return [rng.randrange(vocab) for _ in range(PROMPT_LEN)]


def durations(seed: int, group: int, index: int, median_s: float, sigma: float) -> tuple[float, float]:
    """Environment time before and after the model call: log-normal, heavy-tailed."""
    rng = random.Random(f"{seed}-time-{group}-{index}")
    total = median_s * math.exp(rng.gauss(0.0, sigma))
    split = rng.random()
    return total * split, total * (1 - split)


def trajectory(prompt: list[int], out, group: int, index: int, n: int, group_size: int):
    """Member `index` of group `group` (episode `n`): one model call (a GenOutput), scored by `reward_of`."""
    from jet.timeline import Call, merge_calls
    from jet.wire import Trajectory

    reward = reward_of(out.token_ids)
    call = Call(prompt, out.token_ids, out.logprobs, out.version, MODEL, "main", out.finish_reason)
    samples = merge_calls([call], "exact", episode_id=f"e{n}", reward=reward)
    return Trajectory(task="bench", group_id=f"g{group}", index=index, episode_id=f"e{n}", model=MODEL,
                      reward=reward, samples=tuple(samples), group_size=group_size)


async def rollouts(url: str, keys: Keys, model_dir: Path, p: dict, seed: int, stop: anyio.Event,
                   produced: list[int], weights_root: Path) -> None:
    """The synthetic rollout fleet: `slots` concurrent episodes until `stop`, following the trainer's
    weights (announced under `weights_root`) as an inference worker does."""
    from jet.queues.connect import connect
    from jet.queues.producer import Producer
    from jet.workers.inference.backend import SamplingParams
    from jet.workers.inference.hf import HFBackend
    from jet.workers.inference.weights import WeightFollower

    backend = await anyio.to_thread.run_sync(HFBackend, model_dir)
    r, rb = await connect(url), await connect(url, block_ms=500)
    follower = WeightFollower(r, rb, url, keys, MODEL, "bench-rollouts", [weights_root], block_ms=500)
    producer = Producer(r, url, keys, keys.traj(MODEL), maxlen=100_000)
    lock, counter, G = anyio.Lock(), iter(range(1 << 62)), p["group_size"]

    async def slot() -> None:
        while not stop.is_set():
            n = next(counter)
            group, index = divmod(n, G)
            before, after = durations(seed, group, index, p["median_s"], p["sigma"])
            await anyio.sleep(before)
            prompt = prompt_of(seed, group, backend.vocab_size)
            async with lock:  # one generation at a time; new weights load between them (the engine's gate)
                params = SamplingParams(temperature=1.0, max_tokens=COMPLETION, seed=seed * 1_000_003 + n)
                out = await backend.agenerate_one(prompt, params)
            await anyio.sleep(after)
            if out.finish_reason == "error" or not out.token_ids:
                continue
            await producer.send([trajectory(prompt, out, group, index, n, G).to_fields()])
            produced[0] += 1

    try:
        await follower.catch_up(backend)
        async with anyio.create_task_group() as tg:
            tg.start_soon(follower.run, backend)
            for _ in range(p["slots"]):
                tg.start_soon(slot)
            await stop.wait()
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await r.aclose()
            await rb.aclose()


def write_config(path: Path, run: str, runs_dir: Path, model_dir: Path, p: dict) -> Path:
    trainer = {"lr": LR, "batch_groups": p["batch_groups"], "micro_batch_tokens": 1024, "publish_every": 1,
               "checkpoint_every": 10, "steps": p["steps"], "min_group_size": 2, "group_timeout_s": 120,
               "advantage": "grpo", "seed": 0}
    data = {"run": run, "runs_dir": str(runs_dir), "queues": {"block_ms": 200},
            "models": [{"name": MODEL, "path": str(model_dir)}], "trainer": trainer}
    path.write_text(yaml.safe_dump(data))
    return path


async def trainer_joined(url: str, keys: Keys) -> bool:
    from jet.errors import QueueError
    from jet.queues.connect import connect, translated

    r = await connect(url)
    try:
        with translated(url):
            groups = await r.xinfo_groups(keys.traj(MODEL))
    except QueueError:  # "no such key": the trainer has not created the stream yet
        return False
    finally:
        await r.aclose()
    return any((g.get("name") or g.get(b"name")) in (GROUP_TRAINER, GROUP_TRAINER.encode()) for g in groups)


async def run_mode(name: str, max_staleness: int | None, url: str, tmp: Path, model_dir: Path, p: dict,
                   seed: int, say) -> Result:
    run = f"bench{name}{uuid.uuid4().hex[:6]}"
    keys = Keys(run)
    config = write_config(tmp / f"{run}.yaml", run, tmp / "runs", model_dir, p)
    log = open(tmp / f"{run}.log", "wb")
    env = {**os.environ, "JET_LOG_LEVEL": "WARNING"}
    sets = [x for o in p.get("overrides", ()) for x in ("--set", o)]  # the mode's bound goes last: it wins
    sets += ["--set", f"trainer.max_staleness={max_staleness}"] if max_staleness is not None else []
    proc = subprocess.Popen([*python_module("jet.trainer.cli"), "--config", str(config), "--redis-url", url,
                             *sets], stdout=log, stderr=subprocess.STDOUT, env=env)
    stop, produced = anyio.Event(), [0]
    try:
        while not await trainer_joined(url, keys):
            if proc.poll() is not None:
                raise click.ClickException(f"the trainer exited {proc.returncode}; see {log.name}")
            await anyio.sleep(0.2)
        say(f"{name}: trainer ready, rollouts start")
        async with anyio.create_task_group() as tg:
            tg.start_soon(rollouts, url, keys, model_dir, p, seed, stop, produced,
                          RunDir(tmp / "runs", run).weights(MODEL))
            while proc.poll() is None:
                await anyio.sleep(0.2)
            stop.set()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    if proc.returncode != 0:
        raise click.ClickException(f"the trainer exited {proc.returncode}; see {tmp / (run + '.log')}")
    resolved = yaml.safe_load(RunDir(tmp / "runs", run).resolved_config.read_text())
    return summarise(name, resolved["trainer"]["max_staleness"], RunDir(tmp / "runs", run).root, produced[0], model_dir,
                     seed)


def summarise(name: str, bound: int, run_dir: Path, produced: int, model_dir: Path, seed: int) -> Result:
    from jet.trainer.weights import weights_dir

    rows = read_metrics(RunDir.at(run_dir).metrics(MODEL))
    first, last = rows[0], rows[-1]
    window = max(1e-9, last["time"] - first["time"])
    busy = last["perf/busy_s"] - first["perf/busy_s"]
    final = weights_dir(run_dir, MODEL, int(last["policy/version"]))
    mean, se = evaluate(model_dir, final, seed)
    return Result(
        mode=name, run=run_dir.name, max_staleness=bound, steps=int(last["step"]), window_s=round(window, 2),
        steps_per_min=(last["step"] - first["step"]) / window * 60, busy_fraction=busy / window, produced=produced,
        stale=int(last.get("counts/stale", 0)), groups_dropped=int(last.get("counts/groups_dropped", 0)),
        staleness_mean=statistics.fmean(r["policy/staleness"] for r in rows),
        train_reward_last=statistics.fmean(r["rollout/reward_mean"] for r in rows[-5:]),
        eval_reward=mean, eval_se=se)


def evaluate(model_dir: Path, weights: Path | None, seed: int) -> tuple[float, float]:
    """Mean reward (and its standard error) of the weights (None: the initial model) on held-out prompts."""
    from jet.workers.inference.hf import HFBackend

    backend = HFBackend(model_dir)
    if weights is not None:
        backend.load_weights(weights)
    return evaluate_backend(backend, seed)


def evaluate_backend(backend, seed: int, prompts: int = 32, samples: int = 8) -> tuple[float, float]:
    """Mean reward and standard error of 256 sampled completions (32 held-out prompts x 8) of a loaded backend."""
    from jet.workers.inference.backend import SamplingParams

    batch = [prompt_of(seed + 1, 10_000 + g, backend.vocab_size) for g in range(prompts) for _ in range(samples)]
    params = [SamplingParams(temperature=1.0, max_tokens=COMPLETION, seed=i) for i in range(len(batch))]
    rewards = [reward_of(o.token_ids) for o in backend.generate(batch, params)]
    return statistics.fmean(rewards), standard_error(rewards)


def tiny_model(folder: Path, seed: int) -> Path:
    """The benchmark's random tiny Llama (vocab 512, 2 layers, hidden 32), one per seed."""
    from jet.models import init_model

    return init_model(folder, vocab_size=512, hidden_size=32, layers=2, heads=4, kv_heads=2, max_position=256,
                      seed=seed)


async def measure(url: str, tmp: Path, p: dict, seed: int, say, max_staleness: int | None = None) -> dict:
    """One seeded pair: the same model, prompts and episode times, sync then async."""
    model_dir = await anyio.to_thread.run_sync(tiny_model, tmp / f"{MODEL}{seed}", seed)
    initial, _ = evaluate(model_dir, None, seed)
    sync = await run_mode("sync", 0, url, tmp, model_dir, p, seed, say)
    say(f"seed {seed} sync: {sync.steps} steps, {sync.steps_per_min:.1f} steps/min, busy {sync.busy_fraction:.2f}, "
        f"eval reward {sync.eval_reward:.3f}")
    asyn = await run_mode("async", max_staleness, url, tmp, model_dir, p, seed, say)
    say(f"seed {seed} async: {asyn.steps} steps, {asyn.steps_per_min:.1f} steps/min, busy {asyn.busy_fraction:.2f}, "
        f"eval reward {asyn.eval_reward:.3f}")
    return {"seed": seed, "initial_eval_reward": initial, "runs": [asdict(sync), asdict(asyn)],
            "ratio_steps_per_min": asyn.steps_per_min / max(1e-9, sync.steps_per_min),
            "ratio_busy_fraction": asyn.busy_fraction / max(1e-9, sync.busy_fraction)}


def summarise_pairs(pairs: list[dict]) -> dict:
    """Means over the seeded pairs, and the paired reward difference async - sync with its standard error.

    With one pair the error is the two evaluations' sampling error; with several
    it is the spread of the per-seed differences (stdev / sqrt(n)), which also
    holds the run-to-run noise of training. "No worse" = the mean difference is
    above -2 standard errors.
    """
    n = len(pairs)
    diffs = [x["runs"][1]["eval_reward"] - x["runs"][0]["eval_reward"] for x in pairs]
    if n == 1:
        se = math.hypot(pairs[0]["runs"][0]["eval_se"], pairs[0]["runs"][1]["eval_se"])
    else:
        se = standard_error(diffs)
    modes = {}
    for i, mode in enumerate(("sync", "async")):
        rows = [x["runs"][i] for x in pairs]
        modes[mode] = {k: statistics.fmean(r[k] for r in rows) for k in
                       ("steps_per_min", "busy_fraction", "staleness_mean", "train_reward_last", "eval_reward")}
        modes[mode]["stale_share"] = sum(r["stale"] for r in rows) / max(1, sum(r["produced"] for r in rows))
    ratios = [x["ratio_steps_per_min"] for x in pairs]
    return {"pairs": n, "modes": modes, "ratio_steps_per_min": statistics.fmean(ratios),
            "ratio_min": min(ratios), "reward_diff": statistics.fmean(diffs), "reward_diff_se": se,
            "initial_eval_reward": statistics.fmean(x["initial_eval_reward"] for x in pairs)}


async def measure_all(url: str, tmp: Path, p: dict, seeds: list[int], say, max_staleness: int | None) -> dict:
    pairs = [await measure(url, tmp, p, s, say, max_staleness) for s in seeds]
    summary = summarise_pairs(pairs)
    goal = {"ratio": GOAL, "ratio_met": summary["ratio_min"] >= GOAL,
            "reward_no_worse": summary["reward_diff"] >= -2 * summary["reward_diff_se"]}
    return {"workload": p, "seeds": seeds, "pairs": pairs, "summary": summary, "goal": goal}


def render(report: dict):
    from rich.table import Table

    summary, g = report["summary"], report["goal"]
    table = Table(title=f"jet bench async ({report['workload']['steps']} steps each, seeds {report['seeds']}; "
                        f"initial eval reward {summary['initial_eval_reward']:.3f})")
    cols = ("seed", "mode", "max_staleness", "steps/min", "busy", "stale dropped", "staleness", "reward (last 5)",
            "eval reward")
    for c in cols:
        table.add_column(c, justify="right")
    for pair in report["pairs"]:
        for x in pair["runs"]:
            table.add_row(str(pair["seed"]), x["mode"], str(x["max_staleness"]), f"{x['steps_per_min']:.1f}",
                          f"{x['busy_fraction']:.2f}", f"{x['stale']}/{x['produced']}", f"{x['staleness_mean']:.2f}",
                          f"{x['train_reward_last']:.3f}", f"{x['eval_reward']:.3f} ± {x['eval_se']:.3f}")
    if summary["pairs"] > 1:
        for mode, m in summary["modes"].items():
            table.add_row("mean", mode, "", f"{m['steps_per_min']:.1f}", f"{m['busy_fraction']:.2f}",
                          f"{m['stale_share']:.0%}", f"{m['staleness_mean']:.2f}", f"{m['train_reward_last']:.3f}",
                          f"{m['eval_reward']:.3f}")
    table.caption = (f"async / sync: {summary['ratio_steps_per_min']:.2f}x steps/min (lowest {summary['ratio_min']:.2f}x; "
                     f"goal >= {g['ratio']}: {'met' if g['ratio_met'] else 'NOT met'}); eval reward async - sync "
                     f"{summary['reward_diff']:+.3f} ± {summary['reward_diff_se']:.3f} (SE over {summary['pairs']} "
                     f"pair{'s' if summary['pairs'] > 1 else ''}); no worse: {'yes' if g['reward_no_worse'] else 'NO'}")
    return table


@click.command("async")
@redis_url_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--quick", is_flag=True, help="A few steps of a small workload (for tests); its numbers mean little.")
@click.option("--steps", type=click.IntRange(min=2), default=None, help=f"Steps per run (default {DEFAULTS['steps']}).")
@click.option("--slots", type=click.IntRange(min=1), default=None, help="Concurrent synthetic episodes.")
@click.option("--seed", default=0, show_default=True, help="Seed of prompts, episode times and the model.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Seeded pairs to run (seeds SEED..SEED+N-1); the reward verdict uses their spread.")
@click.option("--max-staleness", type=click.IntRange(min=1), default=None,
              help="The async run's bound (default: trainer.max_staleness's default).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Config override for both runs' trainers, e.g. trainer.lr=3e-3.")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Keep both runs' folders (metrics, PNG plots, trainer logs) here.")
def cli(redis_url, as_json, quick, steps, slots, seed, repeats, max_staleness, overrides, out_dir) -> None:
    """Trainer steps/min and busy fraction: synchronous barrier (max_staleness 0) vs the async default."""
    from jet.options import run_jet

    p = dict(QUICK if quick else DEFAULTS, overrides=list(overrides))
    p.update({k: v for k, v in {"steps": steps, "slots": slots}.items() if v is not None})
    say = progress(as_json)
    with tempfile.TemporaryDirectory(prefix="jet-bench-async-") as tmp:
        work = Path(out_dir) if out_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        with server_url(redis_url, Path(tmp) / "server") as url:
            report = run_jet(measure_all, url, work, p, list(range(seed, seed + repeats)), say, max_staleness)
        if out_dir:
            from jet.runs import metrics_files as find
            from jet.trainer.metrics import plot

            for pair in report["pairs"]:
                for r in pair["runs"]:
                    for f in find(work / "runs" / r["run"]):
                        say(f"plots of {r['mode']} (seed {pair['seed']}): {', '.join(str(x) for x in plot(f))}")
    report["cpus"] = os.cpu_count()
    emit(report, as_json, render)
