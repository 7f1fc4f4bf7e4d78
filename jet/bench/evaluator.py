"""`jet bench evaluator`: what held-out evaluation during training costs training, on one machine.

What it is: `jet up` on a real model (SmolLM2-135M-Instruct on `add`, `jet/study/builtin/smollm2-add.yaml`)
for `--budget-s` seconds, twice per repeat: with the evaluator at its defaults (`tasks[].eval` as a user
writes it: every 10th version, 100 held-out rows, the base weights first) and without it (no `eval`
section), in alternating order (repeat 1: on, off; repeat 2: off, on; ...). The trainer's optimiser steps
a minute are counted from its first step to its last (start-up excluded, the same way for both), and
the ratio on/off is reported per repeat with its mean and a 95% t interval over repeats. Each run's
evaluations are listed too, so the ratio is read knowing how much evaluating happened.

What it is not: a measure of the evaluator's own speed (`eval/<task>/seconds` in its rows is that).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import click

from jet.bench import emit, progress
from jet.runs import RunDir, read_metrics
from jet.stats import mean_interval

BASE = Path(__file__).resolve().parents[1] / "study" / "builtin" / "smollm2-add.yaml"


def config(out: Path, evaluate: bool, model: str) -> Path:
    """The run's config: the `add` base on `model`, with or without the evaluator at its defaults."""
    import yaml

    cfg = yaml.safe_load(BASE.read_text())
    cfg |= {"run": "bench-eval", "runs_dir": str(out / "runs")}
    cfg["models"][0]["path"] = model
    cfg["trainer"] |= {"steps": 100_000, "checkpoint_every": 0}
    if evaluate:
        cfg["tasks"][0]["eval"] = {}  # every default: every 10th version, 100 rows, the base weights first
    else:
        cfg["tasks"][0].pop("eval", None)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def one_run(out: Path, evaluate: bool, model: str, budget_s: float, say) -> dict:
    from jet.bench.trl_arms import supervise

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    argv = [sys.executable, "-m", "jet.cli.main", "up", "--config", str(config(out, evaluate, model)), "--no-live",
            "--no-dash", "--run-dir", str(out / "server")]
    env = {k: v for k, v in os.environ.items() if k != "JET_REDIS_URL"}
    say(f"evaluator {'on' if evaluate else 'off'}: jet up for {budget_s:.0f} s (log {out / 'up.log'})")
    t0 = time.time()
    code, samples = supervise(argv, env, out / "up.log", budget_s, t0, stop_at_budget=True)
    if code != 0:
        raise click.ClickException(f"jet up failed (exit {code}); see {out / 'up.log'}")
    run = RunDir(out / "runs", "bench-eval")
    steps = [r for r in read_metrics(run.metrics("policy")) if r["time"] - t0 <= budget_s]
    evals = [{"version": e["version"], "step": e["step"], "at_s": round(e["eval_time"] - t0, 1),
              "seconds": e["eval/add/seconds"], "accuracy": e["eval/add/reward_mean"]}
             for e in read_metrics(run.evals("policy"))]
    span = steps[-1]["time"] - steps[0]["time"] if len(steps) > 1 else 0.0
    return {"evaluator": evaluate, "steps": len(steps), "first_step_s": steps[0]["time"] - t0 if steps else None,
            "steps_per_min": (len(steps) - 1) / span * 60 if span > 0 else None, "evaluations": evals,
            "load_mean": samples["load_mean"], "peak_rss_mib": samples["peak_rss_mib"]}


def table(report: dict):
    from rich.console import Group
    from rich.table import Table

    t = Table(title=f"jet bench evaluator: SmolLM2 add, {report['budget_s']:.0f} s per run, "
                    f"{report['repeats']} repeats")
    for col in ("repeat", "evaluator", "steps", "steps/min", "evaluations (version: seconds)", "load"):
        t.add_column(col)
    for r in report["runs"]:
        evals = ", ".join(f"v{e['version']}: {e['seconds']:.0f}" for e in r["evaluations"]) or "-"
        t.add_row(str(r["repeat"] + 1), "on" if r["evaluator"] else "off", str(r["steps"]),
                  f"{r['steps_per_min']:.2f}" if r["steps_per_min"] else "-", evals, f"{r['load_mean']:.2f}")
    ratio = report["ratio_on_off"]
    ci = f", 95% CI {ratio['ci95'][0]:.3f}-{ratio['ci95'][1]:.3f}" if ratio["ci95"] else ""
    line = (f"steps a minute with the evaluator / without: {ratio['mean']:.3f}{ci} (per repeat "
            f"{[round(x, 3) for x in ratio['per_repeat']]}); goal: at least 0.95")
    return Group(t, line)


@click.command("evaluator")
@click.option("--budget-s", type=click.FloatRange(min=30), default=300, show_default=True, help="Seconds per run.")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True,
              help="Pairs of runs (on, off), the order alternating.")
@click.option("--model", "model_spec", default="builtin:smollm2", show_default=True, help="The model trained.")
@click.option("--out", "out_dir", default=None, help="Keep the runs here.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def cli(budget_s, repeats, model_spec, out_dir, as_json) -> None:
    """What the evaluator at its default interval costs training on the same machine: steps/min on vs off."""
    import json
    import tempfile

    from jet.sources import resolve_model

    say = progress(as_json)
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="jet-bench-evaluator-"))
    model = resolve_model(model_spec, "--model")
    runs = []
    for repeat in range(repeats):
        for evaluate in ((True, False) if repeat % 2 == 0 else (False, True)):
            run = one_run(out / f"r{repeat + 1}-{'on' if evaluate else 'off'}", evaluate, model, budget_s, say)
            runs.append({"repeat": repeat, **run})
    pairs = [(a, b) for a in runs for b in runs if a["repeat"] == b["repeat"] and a["evaluator"] and not b["evaluator"]]
    per_repeat = [a["steps_per_min"] / b["steps_per_min"] for a, b in pairs
                  if a["steps_per_min"] and b["steps_per_min"]]
    report = {"budget_s": budget_s, "repeats": repeats, "model": model, "runs": runs,
              "ratio_on_off": {"per_repeat": per_repeat, **mean_interval(per_repeat)}}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    emit(report, as_json, table)
