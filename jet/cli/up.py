"""`jet up`: the whole swarm on one machine, for demos, development and CI.

It builds missing tiny models, starts the embedded Redis (unless a URL is
given), launches every role as its own process under `jet.supervisor` (one
inference worker per model, the env workers, one trainer per trainable model
when the trainer is installed), keeps the task streams topped up from the
datasets in the mixing ratio of the tasks' weights, and shows live progress.
A role that crashes is restarted with backoff; one that keeps crashing, or
stops with a fatal error (bad config, refused credentials, the wrong server),
ends `jet up` with that error and the role's last log lines on the terminal.
Ctrl-C (or SIGTERM) drains: every role gets SIGTERM (finish or release work,
checkpoint; a trainer in a long step abandons it at its next micro-batch), the
inference workers once the env workers have exited (their running episodes get
their replies), then the server stops gracefully. The drain waits `drain_deadline`: a minute plus twice
the longest micro-batch a trainer has reported, then kills what is left. Role logs go to
`<runs_dir>/<run>/logs/`.

What it is not: a deployment tool. Each role it starts is a plain `jet`
command (shown with --dry-run) that runs the same way on other machines or in
docker compose.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
from pathlib import Path

import click

from jet.options import config_options, load_config
from jet.config import JetConfig
from jet.errors import ConfigError, JetError
from jet.runs import RunDir
from jet.supervisor import Child, Supervisor, python_module

DEFAULT_MODEL_HOME = ".jet/models"  # models under this folder are built on demand
DRAIN_S = 60.0  # how long a drain waits for the roles before killing what is left (s), plus a trainer's share


def drain_deadline(micro_batch_s: float) -> float:
    """The drain's wait: DRAIN_S, plus twice the longest micro-batch a trainer reported (a stop abandons a
    step before its next micro-batch, so a trainer is busy that long at most before it checkpoints)."""
    return DRAIN_S + 2 * micro_batch_s


def has_trainer() -> bool:
    return importlib.util.find_spec("jet.trainer.cli") is not None


def roles_for(cfg: JetConfig, config_path: str, overrides: tuple[str, ...], env_n: int,
              run: RunDir | None = None) -> list[Child]:
    """The commands `jet up` runs, one Child each (logs in the run's `logs/<name>.log`)."""
    sets = [x for o in overrides for x in ("--set", o)]
    role = lambda module, *args: python_module(module) + ["--config", config_path, *args] + sets  # noqa: E731
    specs = [(infer_role(group), role("jet.workers.inference.worker", *[x for m in group for x in ("--model", m)]),
              False) for group in cfg.serving_groups()]
    specs.append(("env", role("jet.workers.rollout.worker", "-n", str(env_n)), False))
    if has_trainer():
        specs += [(f"train-{m.name}", role("jet.trainer.cli", "--model", m.name), True)
                  for m in cfg.models if m.trainable]
    threads = thread_shares(cfg, has_trainer())
    # The inference workers serve the env workers' episodes: a drain reaches them once the env workers exited.
    serving = {infer_role(group) for group in cfg.serving_groups()}
    children = [Child(name, argv, log=run.log(name) if run else None, required=req, serves=name in serving,
                      env=_thread_env(threads[name]) if name in threads else {})
                for name, argv, req in specs]
    # The evaluators: one thread and a lower CPU priority each, optional (a failing one never stops the run) and
    # lingering (once the trainers are done it evaluates their final versions, then exits by itself).
    return children + [Child(f"eval-{m}", role("jet.workers.evaluator.worker", "--model", m, "--threads", "1"),
                             log=run.log(f"eval-{m}") if run else None, env=_thread_env(1), optional=True,
                             lingers=True) for m in evaluated_models(cfg)]


def evaluated_models(cfg: JetConfig) -> list[str]:
    """The trained models with a task that has an `eval` section: each gets an evaluator under `jet up`."""
    if not has_trainer():
        return []
    return [m.name for m in cfg.models if m.trainable and any(t.model == m.name and t.eval for t in cfg.tasks)]


def infer_role(models: list[str]) -> str:
    """The role name of the inference worker serving `models` (several: adapters of one base)."""
    return "infer-" + "+".join(models)


def cpu_count() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_shares(cfg: JetConfig, trainers: bool = True, cores: int | None = None) -> dict[str, int]:
    """Torch threads of each CPU role `jet up` starts: its configured `threads`, else an equal share of
    the cores among the CPU inference workers and trainers (at least 1). Roles on a GPU are not listed.

    Why: each torch process otherwise takes a thread per core, so on one machine the trainer and the
    inference worker oversubscribe every core and both slow down (see docs/trainer.md, "CPU threads").
    $OMP_NUM_THREADS set for `jet up` wins over the share (a study runs each run on one thread)."""
    cores = cores or cpu_count()
    wanted = {infer_role(g): cfg.model(g[0]).threads for g in cfg.serving_groups() if cfg.model(g[0]).device == "cpu"}
    if trainers:
        wanted |= {f"train-{m.name}": cfg.trainer_of(m.name).threads for m in cfg.models
                   if m.trainable and cfg.trainer_of(m.name).device == "cpu"}
    if os.environ.get("OMP_NUM_THREADS"):
        return {name: n for name, n in wanted.items() if n}
    free = [name for name, n in wanted.items() if not n]
    left = max(cores - sum(n for n in wanted.values() if n), len(free))
    return {name: n or max(1, left // len(free)) for name, n in wanted.items()}


def _thread_env(n: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)}


def ensure_models(cfg: JetConfig) -> tuple[list[str], JetConfig, tuple[str, ...]]:
    """Build missing tiny models that live under .jet/models, resolve Hub ids; other missing paths are
    errors naming the key. Returns the folders built, the config with every model at its local folder,
    and the `--set` overrides that pin each Hub id to the commit it resolved to, so every role loads
    the same weights even when the branch moves while they start."""
    from jet.config import check_models, pins

    built = []
    for m in cfg.models:
        if not (Path(m.path) / "config.json").is_file() and DEFAULT_MODEL_HOME in Path(m.path).as_posix():
            from jet.models import init_model

            init_model(m.path, seed=cfg.trainer_of(m.name).seed)  # a model's own trainer.seed: teams differ
            built.append(m.path)
    resolved = check_models(cfg)
    return built, resolved, pins(cfg, resolved)




@click.command("up")
@config_options("all of it")
@click.option("--steps", type=int, default=None, help="Optimiser steps to run (sets trainer.steps).")
@click.option("--episodes", type=int, default=None,
              help="Stop after this many trajectories (useful without a trainer).")
@click.option("--env-workers", "env_n", type=int, default=1, show_default=True, help="Env worker processes.")
@click.option("--redis-url", envvar="JET_REDIS_URL", default=None, help="Use this Redis instead of an embedded one.")
@click.option("--run-dir", default=".jet", show_default=True, help="Embedded server data.")
@click.option("--dry-run", is_flag=True, help="Print the role commands and exit.")
@click.option("--no-live", is_flag=True, help="Plain progress lines instead of a live table.")
@click.option("--dash-port", type=int, default=8265, show_default=True,
              help="Port of the dashboard on loopback (0: any free one; taken: any free one).")
@click.option("--no-dash", is_flag=True, help="Do not start the dashboard.")
def cli(config_path, overrides, steps, episodes, env_n, redis_url, run_dir, dry_run, no_live, dash_port, no_dash):
    """Run everything on this machine: embedded Redis, inference, env workers, trainer."""
    from jet.config import write_resolved

    overrides = tuple(overrides) + ((f"trainer.steps={steps}",) if steps is not None else ())
    cfg = load_config(config_path, overrides)
    run_path = RunDir.of(cfg)
    roles = roles_for(cfg, config_path, overrides, env_n, run_path)
    if dry_run:
        for r in roles:
            click.echo(f"{r.name}: {' '.join(r.argv)}")
        return
    try:
        built, resolved, pins = ensure_models(cfg)
    except ConfigError as e:
        raise click.ClickException(f"{config_path}: {e}") from None
    for path in built:
        click.echo(f"built tiny model at {path}", err=True)
    if pins:
        roles = roles_for(cfg, config_path, overrides + pins, env_n, run_path)
    write_resolved(resolved, run_path.root)
    server = None
    if not redis_url:
        from jet.queues.server import EmbeddedServer

        server = EmbeddedServer(run_dir).start()
        redis_url = server.url
        click.echo(f"embedded Redis at {redis_url} (data in {server.data_dir})", err=True)
    from jet.workers.feeder.feeder import Feeder

    sup = Supervisor(lambda bank: roles, env={**os.environ, "JET_REDIS_URL": redis_url})
    try:
        feed = Feeder(cfg, redis_url)
    except JetError as e:  # refused password, MOVED from a cluster node, ...: say so, start nothing
        sup.close()
        if server:
            server.stop()
        raise click.ClickException(str(e)) from None
    dash = None if no_dash else _start_dashboard(cfg, redis_url, run_path.log("dash"), dash_port)
    code, started = 0, time.monotonic()
    try:
        code = _run(cfg, sup, feed, episodes, no_live, dash.url if dash else None)
    except JetError as e:  # from the feeder, in this process: the roles are stopped below
        click.echo(f"jet up: error: {e}", err=True)
        code = 1
    finally:
        click.echo(feed.summary(), err=True)
        drain_s = drain_deadline(feed.longest_micro_batch_s())
        if sup.stops == 0:
            click.echo("draining roles...", err=True)
            sup.stop()
        _linger(sup)
        sup.wait(timeout=drain_s)
        feed.close()
        if dash:
            dash.stop()
        if server:
            server.stop()
        codes = {p.child.name: p.popen.returncode if p.popen else None for p in sup.procs}
        click.echo(f"stopped: {codes}; logs in {run_path.logs}", err=True)
        _summary(cfg, feed, started, dash.url if dash else None)
        if sup.failure:
            click.echo(f"jet up: {sup.failure}", err=True)
        optional = {p.child.name for p in sup.procs if p.child.optional}
        if not code and (sup.failure or any(c not in (0, None) for n, c in codes.items() if n not in optional)):
            code = 1
        for message in sup.gave_up:
            click.echo(f"jet up: an optional role stopped (training was not held back): {message}", err=True)
    raise SystemExit(code)


LINGER_S = 900.0  # longest wait for the evaluators' final evaluations once the trainers are done (s)


def _linger(sup: Supervisor) -> None:
    """Once the trainers are done, wait (at most LINGER_S; Ctrl-C or SIGTERM ends it) for the evaluators to
    evaluate the final versions; they exit by themselves."""
    if not sup.lingering():
        return
    click.echo(f"waiting for {', '.join(sup.lingering())} to evaluate the final version (Ctrl-C stops it)...",
               err=True)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    deadline = time.monotonic() + LINGER_S
    try:
        while sup.poll() and sup.lingering() and not stop and time.monotonic() < deadline:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    if sup.lingering():
        sup.stop()  # the second stop: the evaluators too


def _start_dashboard(cfg: JetConfig, redis_url: str, log: Path, port: int):
    """The dashboard of this run (its URL printed), or None when it cannot start: it is only a viewer."""
    from jet.dash import launch

    try:
        dash = launch.start(cfg.run, cfg.runs_dir, redis_url, log, port=port)
    except OSError as e:
        click.echo(f"dashboard not started: {e}", err=True)
        return None
    click.echo(f"dashboard at {dash.url} (log {dash.log})", err=True)
    return dash


def _summary(cfg: JetConfig, feed, started: float, dash_url: str | None) -> None:
    from jet.cli.progress import summary, write_plots
    from jet.dash.training import Curves

    try:
        plots = write_plots(cfg)
    except Exception as e:  # noqa: BLE001 - a plot that fails must not hide the summary
        click.echo(f"plots not written: {e}", err=True)
        plots = []
    click.echo(summary(cfg, Curves(cfg.runs_dir), (time.monotonic() - started) / 60, plots=plots,
                       dash_url=dash_url), err=True)


def _run(cfg, sup: Supervisor, feed, episodes: int | None, no_live: bool, dash_url: str | None = None) -> int:
    """Supervise and feed until the trainers are done (or a role failed, or a signal came)."""
    from jet.cli import progress
    from jet.dash.training import Curves

    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    sup.start()
    started = time.monotonic()
    curves = Curves(cfg.runs_dir)

    def step() -> bool:
        feed.tick()
        if not sup.poll() or sup.failure or sup.stops:
            return False
        return episodes is None or feed.trajectories < episodes

    try:
        if no_live or not sys.stdout.isatty():
            last = 0.0
            while not stop and step():
                if time.monotonic() - last > 10:
                    last = time.monotonic()
                    click.echo(progress.line(cfg, sup.procs, feed, curves, started), err=True)
                time.sleep(1)
        else:
            from rich.live import Live

            show = lambda: progress.view(cfg, sup.procs, feed, curves, started, dash_url)  # noqa: E731
            with Live(show(), refresh_per_second=2) as live:
                while not stop and step():
                    live.update(show())
                    time.sleep(1)
    except KeyboardInterrupt:
        pass
    if sup.failure:
        return 1
    req = [p for p in sup.procs if p.child.required]
    return max((p.popen.returncode or 0 for p in req if p.popen and p.popen.poll() is not None), default=0)
