"""`jet bench trl`: Jet against TRL's GRPOTrainer on the same model, task and wall-clock budget.

What it is: two trainings run one after the other on this machine, each stopped at `--budget-s`
seconds after its launch (startup counts for both): Jet (`jet up` with a generated config, the
embedded Redis, one inference worker, one env worker and one trainer process; SIGTERM at the
budget, then its newest published weights) and TRL (`jet.bench.trl_side`: `GRPOTrainer` in a
subprocess of `--trl-python`, stopped by a callback at the budget, then its saved model). Both
train the built-in task `add` (jet/tasks/add.py) with the same prompts (`messages(row)` through
the model's chat template), reward (`score`), group size, groups per optimiser step, AdamW
settings (trainer/optim.py), clip epsilon, token-mean loss, temperature, completion length and
no KL. Then the base model and both results are evaluated greedily on the same held-out rows
(`jet.eval.evaluate`), with Wilson intervals and exact paired sign (McNemar) tests.

Reported per side: optimiser steps, trajectories trained per minute, trained completion tokens
per second, reward per step against wall time, accuracy after, peak RSS of its process tree
(sampled every second from /proc), and the Jet/TRL ratios. Settings the two cannot share are
listed with their difference (`unmatched`). `--out DIR` keeps the runs, logs, JSON and a PNG.

What it is not: a study. One seed per side; the paired test says whether an accuracy difference
on these eval rows is more than chance, not how the two compare over seeds.

TRL is the optional extra `compare`; it pins its own torch/transformers, so it usually lives in
its own venv: `python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 -e '.[compare]'`,
then `--trl-python .venv-trl/bin/python`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import click

from jet.bench import emit, progress
from jet.cli.feed import FINAL
from jet.convert import SMOLLM2_WHEEL
from jet.runs import RunDir, read_metrics
from jet.wire import WEIGHTS_FILE

RUN, MODEL = "bench-trl", "policy"


# ---- statistics


def sign_test(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value: the binomial(b + c, 1/2) sign test on the discordant pairs."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired(x: list[int], y: list[int]) -> dict:
    """McNemar on per-row 0/1 results of the same rows: b = x right y wrong, c = x wrong y right."""
    if len(x) != len(y):
        raise ValueError(f"paired results differ in length ({len(x)} vs {len(y)})")
    b = sum(1 for i, j in zip(x, y) if i and not j)
    c = sum(1 for i, j in zip(x, y) if j and not i)
    return {"x_only": b, "y_only": c, "p": sign_test(b, c)}


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


class PeakRSS:
    """Samples `tree_rss(pid)` every `every` s on a thread; `.peak` is the largest sum seen (bytes)."""

    def __init__(self, pid: int, every: float = 1.0):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, args=(pid, every), daemon=True)
        self._thread.start()

    def _run(self, pid: int, every: float) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(pid))
            self._stop.wait(every)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def supervise(argv: list[str], env: dict, log: Path, budget_s: float, t0: float, stop_at_budget: bool,
              grace_s: float = 600.0) -> tuple[int, int]:
    """Run `argv` (output to `log`); SIGTERM it at t0 + budget_s when `stop_at_budget`. (exit code, peak RSS)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        rss = PeakRSS(proc.pid)
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
            peak = rss.stop()
    return code, peak


def tail(log: Path, n: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:]) if log.is_file() else ""


# ---- the two sides


def jet_config(model: str, p: dict, out: Path) -> dict:
    """The `jet up` config of the Jet side (jet/config.py keys)."""
    G, B = p["group_size"], p["batch_groups"]
    return {
        "run": RUN, "runs_dir": str(out / "runs"),
        "models": [{"name": MODEL, "path": model, "device": p["device"], "max_inflight": G * B}],
        "tasks": [{"name": "add", "workflow": "jet.tasks.add:workflow", "dataset": "add", "group_size": G,
                   "concurrency": G * B, "episode_timeout_s": 600, "model": MODEL}],
        "trainer": {"lr": p["lr"], "batch_groups": B, "clip_eps": p["clip_eps"], "kl_coef": 0.0,
                    "loss_agg": "token_mean", "advantage": "grpo", "weight_decay": 0.0, "grad_clip": 1.0,
                    "lr_schedule": "constant", "warmup_steps": 0, "max_staleness": p["max_staleness"],
                    "steps": 1_000_000, "seed": p["seed"], "device": p["device"], "checkpoint_every": 0,
                    "keep_weights": 2, "micro_batch_tokens": 4096, "loggers": ["jsonl"],
                    "group_timeout_s": 600, "min_group_size": G},
    }


def run_jet(model: str, p: dict, out: Path, say) -> dict:
    import yaml

    folder = out / "jet"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cfg = folder / "config.yaml"
    cfg.write_text(yaml.safe_dump(jet_config(model, p, folder), sort_keys=False))
    env = {**os.environ, "OMP_NUM_THREADS": str(p["threads"]["jet_per_process"]), "JET_LOG_LEVEL": "INFO"}
    env.pop("JET_REDIS_URL", None)
    argv = [sys.executable, "-m", "jet.cli.main", "up", "--config", str(cfg), "--no-live", "--no-dash",
            "--run-dir", str(folder / "server")]
    say(f"jet: jet up for {p['budget_s']:.0f} s (log {folder / 'up.log'})")
    t0 = time.time()
    code, peak = supervise(argv, env, folder / "up.log", p["budget_s"], t0, stop_at_budget=True)
    run = RunDir(folder / "runs", RUN)
    lines = read_metrics(run.metrics(MODEL))
    rows = [r for r in lines if "rollout/reward_mean" in r]
    versions = [run.weight_version(MODEL, v) for v in run.versions(MODEL)
                if (run.weight_version(MODEL, v) / WEIGHTS_FILE).is_file()]
    if not rows or not versions:
        raise click.ClickException(f"jet side trained no step (exit {code}); {folder / 'up.log'}:\n"
                                   f"{tail(folder / 'up.log')}")
    steps = [{"step": int(r["step"]), "t": r["time"] - t0, "reward": r["rollout/reward_mean"],
              "trajectories": int(r["rollout/trajectories"]), "tokens": float(r["train/tokens"])} for r in rows]
    last = lines[-1]  # the trainer's outcome counts, cumulative (0s left out)
    outcomes = {k.split("/", 1)[1]: int(v) for k, v in last.items() if k.count("/") == 1 and k.startswith("counts/")}
    decided = sum(v for k, v in outcomes.items() if k in FINAL)
    return {**side_report(steps, p["budget_s"], peak, code, weights=str(versions[-1])), "outcomes": outcomes,
            "stale_fraction": outcomes.get("stale", 0) / decided if decided else None}


def run_trl(model: str, p: dict, out: Path, trl_python: str, say) -> dict:
    folder = out / "trl"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    t0 = time.time()
    args = {**p, "model": model, "out": str(folder), "t0": t0}
    env = {**os.environ, "OMP_NUM_THREADS": str(p["threads"]["trl"]), "TOKENIZERS_PARALLELISM": "false"}
    argv = [trl_python, "-P", "-m", "jet.bench.trl_side", "--args-json", json.dumps(args)]
    say(f"trl: GRPOTrainer for {p['budget_s']:.0f} s (log {folder / 'train.log'})")
    code, peak = supervise(argv, env, folder / "train.log", p["budget_s"], t0, stop_at_budget=False)
    history = folder / "history.json"
    if code != 0 or not history.is_file():
        raise click.ClickException(f"trl side failed (exit {code}); {folder / 'train.log'}:\n"
                                   f"{tail(folder / 'train.log')}")
    info = json.loads(history.read_text())
    return {**side_report(info["steps"], p["budget_s"], peak, code, weights=info["model"]),
            "trl_version": info["trl_version"], "loss_type": info["loss_type"]}


def side_report(steps: list[dict], budget_s: float, peak: int, code: int, weights: str) -> dict:
    """Throughput of one side from its per-step rows {step, t (s since launch), reward, trajectories, tokens}."""
    wall = max(s["t"] for s in steps)  # launch to the end of the last step (it may pass the budget a little)
    traj, tokens = sum(s["trajectories"] for s in steps), sum(s["tokens"] for s in steps)
    first, last = steps[0], steps[-1]  # after the first step: the rate without startup (imports, model loads)
    span = last["t"] - first["t"]
    steady = (traj - first["trajectories"]) / span * 60 if span > 0 else None
    return {"steps": len(steps), "trajectories": traj, "completion_tokens": tokens, "wall_s": wall,
            "first_step_s": first["t"], "steady_trajectories_per_min": steady,
            "steps_after_budget": sum(1 for s in steps if s["t"] > budget_s),
            "trajectories_per_min": traj / wall * 60, "tokens_per_s": tokens / wall,
            "peak_rss_mib": peak / 2 ** 20, "exit_code": code, "weights": weights,
            "reward_curve": [[round(s["t"], 2), s["reward"]] for s in steps]}


def trl_interpreter(given: str | None) -> tuple[str | None, str | None]:
    """(python that has trl, None) or (None, why the TRL side is skipped)."""
    if given:
        probe = subprocess.run([given, "-P", "-c", "import trl, transformers, jet.bench.trl_side"],
                               capture_output=True, text=True)
        if probe.returncode:
            raise click.ClickException(f"--trl-python {given}: cannot import trl, transformers and jet "
                                       f"({(probe.stderr.strip().splitlines() or ['?'])[-1]})")
        return given, None
    if importlib.util.find_spec("trl") is None:
        return None, ("trl is not importable here and --trl-python was not given (python3 -m venv .venv-trl && "
                      ".venv-trl/bin/pip install torch==2.13.0 -e '.[compare]')")
    return sys.executable, None


def default_model(cache: Path) -> str:
    """SmolLM2-135M-Instruct as a float32 folder: the package-index wheel's GGUF, converted once (jet/convert.py)."""
    from jet.convert import smollm2

    return str(smollm2(cache)[1])


# ---- evaluation, report


UNMATCHED = {  # setting: (Jet, TRL), printed as the difference between the sides
    "staleness": ("asynchronous: a trajectory may be up to max_staleness versions old, decoupled objective "
                  "(trainer.objective) with a capped importance weight", "on-policy: each step trains on "
                  "completions of the current weights (num_iterations=1), the PPO ratio is 1"),
    "advantage eps": ("(r - mean) / (std + 1e-6) (trainer/advantages.py)", "(r - mean) / (std + 1e-4)"),
    "training rows": ("jet.tasks.add:rows in the feeder's order", "jet.tasks.add:rows shuffled by the sampler"),
    "generation": ("inference worker, continuous batching (workers/inference/hf.py)",
                   "transformers generate, one padded batch per step"),
}


def evaluate_all(model: str, sides: dict, p: dict, say) -> dict:
    """Greedy accuracy of the base model and each side's result on the same `eval_n` rows, paired tests."""
    from jet.eval import evaluate

    evals = {}
    for name, spec in [("base", model)] + [(k, v["weights"]) for k, v in sides.items()]:
        say(f"eval: {name} on {p['eval_n']} held-out rows")
        r = evaluate(spec, "add", p["eval_n"], device=p["device"], max_tokens=p["max_tokens"])
        evals[name] = {k: r[k] for k in ("n", "correct", "accuracy", "ci95", "results", "seconds")}
    tests = {}
    for x, y in [("base", "jet"), ("base", "trl"), ("trl", "jet")]:
        if x in evals and y in evals:
            t = paired(evals[x]["results"], evals[y]["results"])
            tests[f"{y}_vs_{x}"] = {f"{x}_only": t["x_only"], f"{y}_only": t["y_only"], "p": t["p"]}
    return {"evals": evals, "paired": tests}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    base = report["evals"]["base"]["accuracy"]
    for name, side in report["sides"].items():
        t, r = zip(*side["reward_curve"])
        ax1.plot(t, r, ".-", label=f"{name} ({side['steps']} steps)")
        acc, (lo, hi) = report["evals"][name]["accuracy"], report["evals"][name]["ci95"]
        line, = ax2.plot([0, side["wall_s"]], [base, acc], "o-", label=name)
        ax2.errorbar([side["wall_s"]], [acc], yerr=[[acc - lo], [hi - acc]], color=line.get_color(), capsize=4)
    ax1.set(xlabel="wall time since launch (s)", ylabel="mean reward per step", title="training reward")
    ax2.set(xlabel="wall time since launch (s)", ylabel="greedy eval accuracy", title="held-out accuracy (95% CI)")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(report: dict):
    from rich.console import Group
    from rich.table import Table

    t = Table(title=f"jet bench trl: {report['model']}, budget {report['params']['budget_s']:.0f} s per side")
    t.add_column("")
    for name in report["sides"]:
        t.add_column(name, justify="right")
    if "jet" in report["sides"] and "trl" in report["sides"]:
        t.add_column("jet/trl", justify="right")
    rows = [("optimiser steps", "steps", "{:.0f}"), ("trajectories/min", "trajectories_per_min", "{:.1f}"),
            ("after the first step", "steady_trajectories_per_min", "{:.1f}"), ("first step ends (s)", "first_step_s",
                                                                                  "{:.0f}"),
            ("completion tokens/s", "tokens_per_s", "{:.1f}"), ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}")]
    for label, key, fmt in rows:
        cells = [fmt.format(s[key]) if s[key] is not None else "-" for s in report["sides"].values()]
        ratio = report["ratios"].get(key)
        t.add_row(label, *cells, *([f"{ratio:.2f}x"] if ratio is not None else []))
    lines = [f"greedy accuracy on {e['n']} held-out rows, {name}: {e['correct']}/{e['n']} = {e['accuracy']:.3f} "
             f"(95% CI {e['ci95'][0]:.3f}-{e['ci95'][1]:.3f})" for name, e in report["evals"].items()]
    lines += [f"paired sign test {k}: discordant {v}" for k, v in report["paired"].items()]
    lines += [f"unmatched {k}: jet {j}; trl {r}" for k, (j, r) in report["unmatched"].items()]
    jet = report["sides"].get("jet", {})
    if jet.get("outcomes"):
        share = jet["stale_fraction"]
        lines.append(f"jet trajectories decided: {jet['outcomes']} (stale: "
                     f"{'-' if share is None else f'{share:.1%}'})")
    lines += [f"threads: {report['params']['threads']}", *report.get("skipped", [])]
    return Group(t, "\n".join(lines))


def ratios(sides: dict) -> dict:
    if not {"jet", "trl"} <= sides.keys():
        return {}
    return {k: sides["jet"][k] / sides["trl"][k] if sides["trl"][k] else None
            for k in ("trajectories_per_min", "steady_trajectories_per_min", "tokens_per_s", "steps")}


@click.command("trl")
@click.option("--model", "model_spec", default=None,
              help=f"Model folder or Hub id. Default: {SMOLLM2_WHEEL}'s SmolLM2-135M-Instruct, converted once "
                   "into --cache.")
@click.option("--cache", default="~/.cache/jet-bench/smollm2", show_default=True, help="Where the default model goes.")
@click.option("--budget-s", type=click.FloatRange(min=1), default=600, show_default=True,
              help="Wall-clock seconds per side, from its launch to its stop.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, ... (both sides and the evals).")
@click.option("--seed", type=int, default=0, show_default=True, help="Training seed of both sides.")
@click.option("--eval-n", type=click.IntRange(1), default=100, show_default=True, help="Held-out rows evaluated.")
@click.option("--group-size", type=click.IntRange(2), default=8, show_default=True,
              help="Completions per prompt (TRL's num_generations).")
@click.option("--batch-groups", type=click.IntRange(1), default=4, show_default=True, help="Groups per optimiser step.")
@click.option("--lr", type=float, default=2e-5, show_default=True, help="AdamW learning rate (constant).")
@click.option("--max-staleness", type=click.IntRange(0), default=1, show_default=True,
              help="Jet's trainer.max_staleness (TRL is on-policy).")
@click.option("--jet-threads", type=click.IntRange(1), default=None,
              help="OMP_NUM_THREADS of each of jet up's two torch processes (default: half the cores each; TRL's one "
                   "process gets all of them).")
@click.option("--trl-python", default=None, help="A python with trl, torch and jet (default: this one if it has trl).")
@click.option("--out", "out_dir", default=None, help="Keep runs, logs, report.json and reward.png here.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def cli(model_spec, cache, budget_s, device, seed, eval_n, group_size, batch_groups, lr, max_staleness, jet_threads,
        trl_python, out_dir, as_json) -> None:
    """Jet against TRL's GRPOTrainer: same model, task, settings and wall-clock budget."""
    import tempfile

    say = progress(as_json)
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="jet-bench-trl-"))
    out.mkdir(parents=True, exist_ok=True)
    model = model_spec or default_model(Path(cache).expanduser())
    model = str(Path(model).expanduser().resolve()) if Path(model).expanduser().is_dir() else model
    from jet.cli.up import cpu_count

    cores = cpu_count()  # the cores this process may use, as jet up counts them for its thread shares
    p = {"budget_s": budget_s, "device": device, "seed": seed, "eval_n": eval_n, "group_size": group_size,
         "batch_groups": batch_groups, "lr": lr, "clip_eps": 0.2, "max_tokens": 24, "temperature": 1.0,
         "max_staleness": max_staleness, "adam": {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
         "grad_clip": 1.0}
    p["threads"] = {"cores": cores, "jet_per_process": jet_threads or max(1, cores // 2), "trl": cores,
                    "note": "OMP_NUM_THREADS of each torch process: TRL is one process with all cores; "
                            "jet up's inference worker and trainer split them"}
    python, skipped = trl_interpreter(trl_python)
    sides = {"jet": run_jet(model, p, out, say)}
    if python:
        sides["trl"] = run_trl(model, p, out, python, say)
    report = {"model": model, "task": "add", "params": p, "sides": sides, "ratios": ratios(sides),
              **evaluate_all(model, sides, p, say),
              "unmatched": UNMATCHED, "skipped": [f"trl side skipped: {skipped}"] if skipped else []}
    if "trl" in sides:
        report["matched"] = {"loss_type": f"jet token_mean = trl {sides['trl']['loss_type']}"}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    try:
        plot(report, out / "reward.png")
        report["plot"] = str(out / "reward.png")
    except Exception as e:  # noqa: BLE001 - a plot that fails must not hide the numbers
        say(f"plot not written: {e}")
    report["out"] = str(out)
    emit(report, as_json, table)
