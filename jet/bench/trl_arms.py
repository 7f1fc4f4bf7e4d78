"""The arms of `jet bench trl` and the settings they share: one training run each, on a wall-clock budget.

What it is: `Shared`, every setting both frameworks take (task, group size, groups per step, AdamW,
clip, loss aggregation, sampling, per-turn token limit, seed), in ONE place: `jet_config` and the TRL
side's `grpo_config` (`jet.bench.trl_side`) both read it and nothing else, and `MAPPING` says which key
of each it becomes (tests/bench/test_trl_side.py checks the GRPOConfig against the Jet config). Both
read the same training rows from one JSONL file (`write_rows`), which carries the sampling temperature
and per-turn token limit the task's agent uses on the Jet side.

The arms (`ARMS`):
- `jet`: `jet up` as a user gets it: timelines merged exactly (`merge: exact`), group prefix trees in
  the trainer and prefix reuse in the inference engine (the defaults);
- `jet-flat`: the same run with one training sample per LLM call (`merge: none`, `prefix_trees: false`),
  how Agent Lightning and SkyRL train by default;
- `jet-lora`: the `jet` run training a LoRA adapter (`models[0].adapter`, every linear layer) at its own
  learning rate (`Lora`: Jet-only settings, so not in `Shared`); its published versions are adapter folders;
- `trl`: TRL's GRPOTrainer (`jet.bench.trl_side`) in a subprocess of the TRL interpreter.

`run_arm` runs one, stopped at the budget, and reports its steps, trajectories, tokens (completion,
forwarded in training, prefilled in generation), reward curve, peak RSS of its process tree, the load
average while it ran, and its final weights.

What it is not: the statistics or the report (`jet.bench.trl`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click

from jet.adapters import is_adapter
from jet.workers.feeder.feeder import FINAL
from jet.runs import RunDir, read_metrics
from jet.wire import WEIGHTS_FILE

RUN, MODEL = "bench-trl", "policy"
ARMS = ("jet", "jet-flat", "trl", "jet-lora")
LORA_LR_FACTOR = 10.0  # the jet-lora arm's default lr: this times the shared (full-training) lr


@dataclass(frozen=True)
class Shared:
    """Every setting both sides share (the bench's flags); `jet_config` and `trl_side.grpo_config` read
    only these."""

    task: str = "add"
    group_size: int = 8
    batch_groups: int = 4
    lr: float = 2e-5
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_eps: float = 0.2
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 24  # per model turn
    max_turns: int = 1  # model turns per episode (the task's)
    loss: str = "token_mean"  # TRL's "dapo" (trl_side.LOSS_TYPE)
    seed: int = 0
    device: str = "cpu"

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Lora:
    """The jet-lora arm's adapter (`jet.config.AdapterConfig`) and learning rate: Jet-only, TRL has no such arm."""

    r: int = 16
    alpha: float = 32.0
    lr: float | None = None  # None: LORA_LR_FACTOR x the shared lr (an adapter needs a higher lr than full training)

    def lr_for(self, s: Shared) -> float:
        return self.lr if self.lr is not None else LORA_LR_FACTOR * s.lr

    def as_dict(self) -> dict:
        return asdict(self)


# (Shared field, the Jet config key it sets, the GRPOConfig attribute it sets); "rows[].x": a field of every
# training row (the agent reads it), "-": no such setting on that side (its meaning is said in UNMATCHED).
MAPPING = [
    ("group_size", "tasks[0].group_size", "num_generations"),
    ("batch_groups", "trainer.batch_groups", "per_device_train_batch_size * steps_per_generation / num_generations"),
    ("lr", "trainer.lr", "learning_rate"),
    ("adam_betas", "trainer.adam_betas", "(adam_beta1, adam_beta2)"),
    ("adam_eps", "trainer.adam_eps", "adam_epsilon"),
    ("weight_decay", "trainer.weight_decay", "weight_decay"),
    ("grad_clip", "trainer.grad_clip", "max_grad_norm"),
    ("clip_eps", "trainer.clip_eps", "epsilon"),
    ("temperature", "rows[].temperature", "temperature"),
    ("top_p", "rows[].top_p", "top_p"),
    ("max_tokens", "rows[].max_tokens", "-"),  # TRL: max_new_tokens of each turn (trl_side.MultiTurn) or
    ("seed", "trainer.seed", "seed"),          # max_completion_length (single turn)
    ("loss", "trainer.loss_agg", "loss_type"),
]


def write_rows(s: Shared, path: Path, n: int = 20_000) -> Path:
    """The training rows both sides read: the task's own rows with the shared sampling settings."""
    from jet.tasks import dataset

    extra = {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p}
    path.write_text("".join(json.dumps({**row, **extra}) + "\n" for row in dataset(s.task, n, seed=s.seed)))
    return path


def jet_config(s: Shared, arm: str, model: str, rows: Path, out: Path, max_staleness: int | None,
               lora: Lora = Lora(), jet_set: tuple[str, ...] = ()) -> dict:
    """The `jet up` config of a Jet arm (jet/config.py keys), from the shared settings only; jet-lora's model
    also trains an adapter at its own lr (`lora`, the model's `trainer` override: the shared section stays).
    `jet_set`: Jet-only overrides (`trainer.skip_no_signal=true`), checked by `check_jet_set`."""
    G, B = s.group_size, s.batch_groups
    flat = arm == "jet-flat"
    policy = {"name": MODEL, "path": model, "device": s.device, "max_inflight": G * B}
    if arm == "jet-lora":
        policy.update(adapter={"r": lora.r, "alpha": lora.alpha, "target_modules": "all-linear"},
                      trainer={"lr": lora.lr_for(s)})
    cfg = {
        "run": RUN, "runs_dir": str(out / "runs"),
        "models": [policy],
        "tasks": [{"name": s.task, "workflow": f"jet.tasks.{s.task}:workflow", "dataset": str(rows),
                   "group_size": G, "concurrency": G * B, "episode_timeout_s": 1200, "model": MODEL,
                   "merge": "none" if flat else "exact"}],
        "trainer": {"lr": s.lr, "batch_groups": B, "clip_eps": s.clip_eps, "kl_coef": 0.0, "loss_agg": s.loss,
                    "advantage": "grpo", "weight_decay": s.weight_decay, "grad_clip": s.grad_clip,
                    "adam_betas": list(s.adam_betas), "adam_eps": s.adam_eps, "prefix_trees": not flat,
                    "lr_schedule": "constant", "warmup_steps": 0,
                    **({} if max_staleness is None else {"max_staleness": max_staleness}),
                    "steps": 1_000_000, "seed": s.seed, "device": s.device, "checkpoint_every": 0,
                    "keep_weights": 2, "micro_batch_tokens": 4096, "loggers": ["jsonl"],
                    "group_timeout_s": 1200, "min_group_size": G},
    }
    from jet.config import JetConfig
    from jet.configlib import apply_overrides

    return apply_overrides(JetConfig, cfg, check_jet_set(jet_set))


def check_jet_set(jet_set: tuple[str, ...]) -> tuple[str, ...]:
    """`jet_set`, refused where a key is one both sides share (`MAPPING`: for Jet alone, the sides would no
    longer train with the same settings) or `trainer.max_staleness` (its own option, which the report records)."""
    from jet.configlib import invalid, parse_override

    shared = {tuple(parse_override(f"{key}=0")[0]): field for field, key, _ in MAPPING if not key.startswith("rows")}
    for text in jet_set:
        path = tuple(parse_override(text)[0])
        if path in shared:
            raise invalid(f"--jet-set {text}", f"both sides share this setting ({shared[path]}); set for Jet "
                          "alone, the sides would no longer train with the same settings")
        if path == ("trainer", "max_staleness"):
            raise invalid(f"--jet-set {text}", "use --max-staleness, which the report records")
    return jet_set


# ---- processes


def tree_rss(root: int) -> int:
    """Resident bytes of process `root` and all its descendants (from /proc; 0 when it is gone)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo, page = 0, [root], os.sysconf("SC_PAGE_SIZE")
    while todo:
        pid = todo.pop()
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
        todo += children.get(pid, [])
    return total


class Sampler:
    """Every `every` s on a thread: the peak RSS of a process tree (bytes) and the machine's 1-minute load
    average (/proc/loadavg), whose mean and max say how busy the machine was during the run."""

    def __init__(self, pid: int, every: float = 1.0):
        self.peak, self.loads, self._stop = 0, [], threading.Event()
        self._thread = threading.Thread(target=self._run, args=(pid, every), daemon=True)
        self._thread.start()

    def _run(self, pid: int, every: float) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(pid))
            try:
                self.loads.append(float(Path("/proc/loadavg").read_text().split()[0]))
            except (OSError, ValueError):
                pass
            self._stop.wait(every)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        loads = self.loads or [float("nan")]
        return {"peak_rss_mib": self.peak / 2 ** 20, "load_mean": sum(loads) / len(loads), "load_max": max(loads)}


class Marks:
    """On a thread: at each wall-clock mark (seconds since the launch `t0`), the weights a Jet run had
    published by then are kept: the newest complete `v<N>` folder hard-linked (the trainer's retention
    cannot take it away, and nothing is copied while the run is timed) into `<out>/<mark>/`, laid out as
    a run folder (`weights/<model>/v<N>` and the run's resolved config), so `jet eval` loads it as it loads
    any published version, adapters included; before the first version, the base model itself. Each kept
    mark records the version, its step and the time it was published (`weights_time_s`)."""

    def __init__(self, run: RunDir, model: str, base: str, out: Path, t0: float, marks_s: list[float]):
        self.run, self.model, self.base, self.out, self.t0 = run, model, base, out, t0
        self.kept: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(sorted(marks_s),), daemon=True)
        self._thread.start()

    def _run(self, marks_s: list[float]) -> None:
        for mark in marks_s:
            if self._stop.wait(max(0.0, self.t0 + mark - time.time())):
                return
            self.kept.append(self.keep(mark))

    def keep(self, mark: float) -> dict:
        for v in reversed(self.run.versions(self.model)):
            folder = self.run.weight_version(self.model, v)
            try:
                published = folder.stat().st_mtime
                if not ((folder / WEIGHTS_FILE).is_file() or is_adapter(folder)):
                    continue
                mini = RunDir(self.out, f"{mark:g}")
                dest = mini.weight_version(self.model, v)
                dest.mkdir(parents=True, exist_ok=True)
                for f in folder.iterdir():
                    os.link(f, dest / f.name)
                shutil.copy2(self.run.resolved_config, mini.resolved_config)
            except OSError:  # pruned between the listing and the links: the next older one
                shutil.rmtree(RunDir(self.out, f"{mark:g}").root, ignore_errors=True)
                continue
            step = next((int(r["step"]) for r in read_metrics(self.run.metrics(self.model))
                         if r.get("policy/version") == v), None)
            return {"mark_s": mark, "path": str(dest), "version": v, "step": step,
                    "weights_time_s": round(published - self.t0, 3)}
        return {"mark_s": mark, "path": self.base, "version": 0, "step": 0, "weights_time_s": 0.0}

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return self.kept


class SwarmCounters:
    """On a thread, every `every` s: what a Jet run's swarm reports in Redis (never its logs): the inference
    workers' prompt counters from their heartbeats (`prompt_tokens` admitted, `prefill_tokens` computed, the
    rest taken from the prefix cache: `jet.workers.inference.worker.prefill_counts`) and the trajectories
    produced (`entries-added` of `traj:<model>`). Every counter is cumulative, so each worker's last
    heartbeat is kept after its hash is gone: a worker that stopped, or whose hash expired while the run
    drained (a heartbeat's TTL is a few beats), still counts with what it last reported."""

    def __init__(self, server_dir: Path, run: str, model: str, every: float = 2.0):
        from jet.keys import Keys

        self.server_dir, self.keys, self.model = server_dir, Keys(run), model
        self.last: dict = {}
        self.seen: dict[str, tuple[int, int]] = {}  # inference worker -> (prompt, prefill) at its last heartbeat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        import redis

        client = None
        while not self._stop.wait(every):
            try:
                if client is None:
                    info = json.loads((self.server_dir / "server.json").read_text())
                    client = redis.Redis.from_url(info["url"], socket_timeout=5)
                self.last = self.read(client) or self.last
            except (OSError, ValueError, KeyError, redis.RedisError):
                client = None  # not up yet, or gone: try again at the next look
        if client is not None:
            client.close()

    def read(self, client) -> dict:
        for name in client.zrange(self.keys.workers, 0, -1):
            w = {k.decode(): v.decode() for k, v in client.hgetall(self.keys.worker(name.decode())).items()}
            if w.get("role") == "infer" and w.get("model") == self.model:
                self.seen[name.decode()] = (int(w.get("prompt_tokens", 0)), int(w.get("prefill_tokens", 0)))
        stream = self.keys.traj(self.model)
        added = int(client.xinfo_stream(stream).get("entries-added", 0)) if client.exists(stream) else 0
        prompt, computed = (sum(c) for c in zip(*self.seen.values())) if self.seen else (0, 0)
        return {"prompt_tokens": prompt, "prefill_tokens": computed, "trajectories": added} if added else {}

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return self.last


def supervise(argv: list[str], env: dict, log: Path, budget_s: float, t0: float, stop_at_budget: bool,
              grace_s: float = 900.0) -> tuple[int, dict]:
    """Run `argv` (output to `log`); SIGTERM it at t0 + budget_s when `stop_at_budget`. (exit code, samples)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        sampler = Sampler(proc.pid)
        try:
            while proc.poll() is None and time.time() < t0 + budget_s:
                time.sleep(0.5)
            if proc.poll() is None and stop_at_budget:
                proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=grace_s + (0 if stop_at_budget else budget_s))
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            samples = sampler.stop()
    return code, samples


def tail(log: Path, n: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:]) if log.is_file() else ""


# ---- the arms


def run_arm(arm: str, s: Shared, model: str, rows: Path, out: Path, budget_s: float, *, threads: dict,
            max_staleness: int | None, trl_python: str | None, generation: str, say, lora: Lora = Lora(),
            marks_s: list[float] = (), micro_batches: int | None = None, jet_set: tuple[str, ...] = ()) -> dict:
    """One run of `arm`; its weights kept at each of `marks_s` (seconds since its launch) for evaluation later;
    `jet_set` (Jet-only overrides) applies to the Jet arms."""
    if arm == "trl":
        return run_trl(s, model, rows, out, budget_s, threads["trl"], trl_python, generation, say, list(marks_s),
                       micro_batches)
    return run_jet(arm, s, model, rows, out, budget_s, threads["jet_per_process"], max_staleness, say, lora,
                   list(marks_s), jet_set)


def run_jet(arm: str, s: Shared, model: str, rows: Path, out: Path, budget_s: float, threads: int,
            max_staleness: int | None, say, lora: Lora = Lora(), marks_s: list[float] = (),
            jet_set: tuple[str, ...] = ()) -> dict:
    import yaml

    folder = out
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cfg = folder / "config.yaml"
    cfg.write_text(yaml.safe_dump(jet_config(s, arm, model, rows, folder, max_staleness, lora, jet_set),
                                  sort_keys=False))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "JET_LOG_LEVEL": "INFO"}
    env.pop("JET_REDIS_URL", None)
    argv = [sys.executable, "-m", "jet.cli.main", "up", "--config", str(cfg), "--no-live", "--no-dash",
            "--run-dir", str(folder / "server")]
    say(f"{arm}: jet up for {budget_s:.0f} s (log {folder / 'up.log'})")
    t0 = time.time()
    run = RunDir(folder / "runs", RUN)
    marks = Marks(run, MODEL, model, folder / "marks", t0, marks_s)
    counters = SwarmCounters(folder / "server", RUN, MODEL)
    try:
        code, samples = supervise(argv, env, folder / "up.log", budget_s, t0, stop_at_budget=True)
    finally:
        kept, swarm = marks.stop(), counters.stop()
    lines = read_metrics(run.metrics(MODEL))
    rows_ = [r for r in lines if "rollout/reward_mean" in r]
    versions = [w for w in (run.weight_version(MODEL, v) for v in run.versions(MODEL))
                if (w / WEIGHTS_FILE).is_file() or is_adapter(w)]  # full weights, or jet-lora's adapter folders
    if code != 0:
        raise click.ClickException(f"{arm}: jet up failed (exit {code}); {folder / 'up.log'}:\n"
                                   f"{tail(folder / 'up.log')}")
    if not rows_ or not versions:  # no step within the budget: a rate of 0, and the base model's weights
        say(f"{arm}: no optimiser step within {budget_s:.0f} s")
        rows_, versions = [], [model]
    steps = [{"step": int(r["step"]), "t": r["time"] - t0, "reward": r["rollout/reward_mean"],
              "trajectories": int(r["rollout/trajectories"]), "tokens": float(r["train/tokens"]),
              "forward_tokens": float(r.get("train/forward_tokens", 0.0))} for r in rows_]
    last = lines[-1] if lines else {}  # the trainer's outcome counts, cumulative (0s left out; none before a step)
    outcomes = {k.split("/", 1)[1]: int(v) for k, v in last.items() if k.count("/") == 1 and k.startswith("counts/")}
    decided = sum(v for k, v in outcomes.items() if k in FINAL)
    generated = swarm.get("trajectories", 0)  # every episode the swarm finished, by the last reading
    report = side_report(steps, budget_s, samples, code, weights=str(versions[-1]))
    report.update(outcomes=outcomes, stale_fraction=outcomes.get("stale", 0) / decided if decided else None,
                  marks=kept, swarm=swarm,
                  prefill_tokens_per_trajectory=swarm["prefill_tokens"] / generated if generated else None,
                  prompt_tokens_per_trajectory=swarm["prompt_tokens"] / generated if generated else None)
    return report


def run_trl(s: Shared, model: str, rows: Path, out: Path, budget_s: float, threads: int, trl_python: str,
            generation: str, say, marks_s: list[float] = (), micro_batches: int | None = None) -> dict:
    folder = out
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    t0 = time.time()
    args = {"shared": s.as_dict(), "rows": str(rows), "model": model, "out": str(folder), "t0": t0,
            "budget_s": budget_s, "threads": threads, "generation": generation, "marks_s": list(marks_s),
            "micro_batches": micro_batches}
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           "TRL_EXPERIMENTAL_SILENCE": "1"}
    argv = [trl_python, "-P", "-m", "jet.bench.trl_side", "--args-json", json.dumps(args)]
    say(f"trl: GRPOTrainer for {budget_s:.0f} s (log {folder / 'train.log'})")
    code, samples = supervise(argv, env, folder / "train.log", budget_s, t0, stop_at_budget=False)
    history = folder / "history.json"
    if code != 0 or not history.is_file():
        raise click.ClickException(f"trl side failed (exit {code}); {folder / 'train.log'}:\n"
                                   f"{tail(folder / 'train.log')}")
    info = json.loads(history.read_text())
    report = side_report(info["steps"], budget_s, samples, code, weights=info["model"])
    traj = report["trajectories"]
    prefilled = sum(st.get("prefill_tokens", 0) for st in info["steps"])
    report.update(versions=info["versions"], loss_type=info["loss_type"], generation=info["generation"],
                  rollout=info["rollout"], prefill_tokens_per_trajectory=prefilled / traj if prefilled else None,
                  marks=info.get("marks", []), micro_batches=info.get("micro_batches"),
                  micro_batches_why=info.get("micro_batches_why"), excluded_s=info.get("excluded_s"))
    return report


def side_report(steps: list[dict], budget_s: float, samples: dict, code: int, weights: str) -> dict:
    """Throughput of one run from its per-step rows {step, t (s since launch), reward, trajectories, tokens,
    forward_tokens}; a run without a step trained nothing in `budget_s`."""
    if not steps:
        return {"steps": 0, "trajectories": 0, "completion_tokens": 0, "wall_s": budget_s, "first_step_s": None,
                "steady_trajectories_per_min": None, "steps_after_budget": 0, "trajectories_per_min": 0.0,
                "tokens_per_s": 0.0, "completion_tokens_per_trajectory": None,
                "forward_tokens_per_trajectory": None, **samples, "exit_code": code, "weights": weights,
                "reward_curve": []}
    wall = max(st["t"] for st in steps)  # launch to the end of the last step (it may pass the budget a little)
    traj, tokens = sum(st["trajectories"] for st in steps), sum(st["tokens"] for st in steps)
    forward = sum(st.get("forward_tokens", 0.0) for st in steps)
    first, last = steps[0], steps[-1]  # after the first step: the rate without startup (imports, model loads)
    span = last["t"] - first["t"]
    steady = (traj - first["trajectories"]) / span * 60 if span > 0 else None
    return {"steps": len(steps), "trajectories": traj, "completion_tokens": tokens, "wall_s": wall,
            "first_step_s": first["t"], "steady_trajectories_per_min": steady,
            "steps_after_budget": sum(1 for st in steps if st["t"] > budget_s),
            "trajectories_per_min": traj / wall * 60, "tokens_per_s": tokens / wall,
            "completion_tokens_per_trajectory": tokens / traj if traj else None,
            "forward_tokens_per_trajectory": forward / traj if traj and forward else None,
            **samples, "exit_code": code, "weights": weights,
            "reward_curve": [[round(st["t"], 2), st["reward"]] for st in steps]}
