"""What `jet up` shows: live progress while the swarm runs, and a short summary when it ends.

What it is: `view` (a rich renderable, redrawn by `jet up`'s live display) and
`line` (the same in one line, for logs and non-terminals) show per trained
model the optimiser steps, the latest reward, tokens per second and steps per
minute (from the trainers' metrics files, read as they grow by
`jet.dash.training.Curves`), the trajectories the feeder saw with their mean
reward and rate, the roles alive, the stream backlog, and the dashboard's URL.
`summary` is the closing block: steps, the mean reward of the first and last
10 steps, minutes, the plots written and where the dashboard was.

What it is not: the supervisor. It reads what it is handed (the supervisor's
processes: `child.name`, `popen`, `alive`, `crashes`, `restart_at`; the
feeder's counters; the metrics files) and starts, stops or restarts nothing.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from jet.dash.training import Curves
from jet.runs import RunDir, metrics_files

FIRST_LAST = 10  # steps averaged for the summary's "first" and "last" reward


def _alive(roles: Sequence[Any]) -> tuple[int, int]:
    return sum(1 for r in roles if r.alive), len(roles)


def _models(cfg) -> list[str]:
    return [m.name for m in cfg.models if m.trainable]


def _rate(feed, started: float) -> float:
    return feed.trajectories / max(1e-9, time.monotonic() - started) * 60


def view(cfg, roles: Sequence[Any], feed, curves: Curves, started: float, dash_url: str | None = None):
    """The live display: trainers, rollouts, roles, streams."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    elapsed = time.monotonic() - started
    alive, total = _alive(roles)
    head = Text.assemble(("jet up ", "bold"), f"run {cfg.run} · {elapsed / 60:.1f} min · roles alive {alive}/{total}")
    if dash_url:
        head.append(" · dashboard ")
        head.append(dash_url, style="cyan")
    train = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for col in ("model", "step", "reward", "tokens/s", "steps/min", "version", "staleness", "held-out"):
        train.add_column(col, justify="right" if col != "model" else "left")
    for m in _models(cfg):
        last = curves.latest(cfg.run, m)
        steps = f"{last.get('step', 0):g} / {cfg.trainer_of(m).steps}"
        train.add_row(m, steps, *(_num(last.get(k)) for k in ("rollout/reward_mean", "perf/tokens_per_s",
                                                               "perf/steps_per_min", "policy/version",
                                                               "policy/staleness")),
                      held_out(curves, cfg.run, m).strip() or "-")
    recent = feed.rewards[-64:]
    rollouts = Text(f"trajectories {feed.trajectories} ({feed.failed} failed) · {_rate(feed, started):.1f}/min · "
                    f"reward (last {len(recent)}) {_num(sum(recent) / len(recent) if recent else None)}")
    roles_t = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for col in ("role", "pid", "state", "restarts"):
        roles_t.add_column(col)
    for r in roles:
        code = r.popen.poll() if r.popen else None
        state = ("[green]running[/green]" if r.alive else "[yellow]restarting[/yellow]" if r.restart_at
                 else f"exit {code}" if code == 0 else f"[red]exit {code}[/red]")
        roles_t.add_row(r.child.name, str(r.popen.pid if r.popen else "-"), state, str(r.crashes))
    streams = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for col in ("stream", "length", "pending", "lag"):
        streams.add_column(col)
    for row in feed.last_report:
        streams.add_row(*map(str, row))
    return Group(head, train, rollouts, roles_t, streams)


def line(cfg, roles: Sequence[Any], feed, curves: Curves, started: float) -> str:
    """One progress line (for --no-live and logs)."""
    parts = []
    for m in _models(cfg):
        last = curves.latest(cfg.run, m)
        parts.append(f"{m}: step {last.get('step', 0):g}/{cfg.trainer_of(m).steps} reward "
                     f"{_num(last.get('rollout/reward_mean'))} {_num(last.get('perf/tokens_per_s'))} tok/s"
                     + held_out(curves, cfg.run, m))
    alive, total = _alive(roles)
    return " · ".join(parts + [feed.summary(), f"{_rate(feed, started):.1f} traj/min", f"roles alive {alive}/{total}"])


def held_out(curves: Curves, run: str, model: str) -> str:
    """' held-out <task> <result> (step <k>)' per evaluated task: the evaluator's newest results."""
    return "".join(f" held-out {task} {value:.3f} (step {step:g})"
                   for task, (step, value) in sorted(curves.held_out(run, model).items()))


def write_plots(cfg) -> list[Path]:
    """PNG curves of every trained model of the run (jet.trainer.metrics.plot); [] without a trainer."""
    try:
        from jet.trainer.metrics import plot
    except ImportError:
        return []
    written = []
    for path in metrics_files(RunDir.of(cfg).root):
        written += plot(path)
    return written


def summary(cfg, curves: Curves, minutes: float, *, plots: Sequence[Path] = (), dash_url: str | None = None,
            feed=None) -> str:
    """The closing lines of `jet up`."""
    out = [f"jet up: run {cfg.run} ran {minutes:.1f} min"]
    for m in _models(cfg):
        rewards = curves.values(cfg.run, m, "rollout/reward_mean")
        steps = curves.latest(cfg.run, m).get("step", 0)
        if rewards:
            first = sum(rewards[:FIRST_LAST]) / len(rewards[:FIRST_LAST])
            last = sum(rewards[-FIRST_LAST:]) / len(rewards[-FIRST_LAST:])
            out.append(f"  {m}: {steps:g} steps; reward first {min(FIRST_LAST, len(rewards))} steps {first:.3f}, "
                       f"last {min(FIRST_LAST, len(rewards))} {last:.3f}")
        else:
            out.append(f"  {m}: {steps:g} steps (no reward logged)")
        if curves.held_out(cfg.run, m):
            out.append(f"  {m}:{held_out(curves, cfg.run, m)} (greedy, the evaluator's newest)")
    if feed is not None:
        out.append(f"  {feed.summary()}")
    if plots:
        folders = sorted({str(Path(p).parent) for p in plots})
        out.append(f"  plots: {', '.join(folders)} ({', '.join(sorted({Path(p).name for p in plots}))})")
    run_dir = Path(cfg.runs_dir) / cfg.run
    out.append(f"  metrics, checkpoints, logs: {run_dir}")
    if dash_url:
        out.append(f"  dashboard was at {dash_url}; browse the run again with `jet dash --runs-dir {cfg.runs_dir} "
                   f"--run {cfg.run}` (curves and studies; the swarm pages need its Redis)")
    return "\n".join(out)


def _num(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if isinstance(v, float) else str(v)
