"""`jet up`: the whole swarm on one machine, for demos, development and CI.

It builds missing tiny models, starts the embedded Redis (unless a URL is
given), launches every role as its own process (one inference worker per
model, the env workers, one trainer per trainable model when the trainer is
installed), keeps the task streams topped up from the datasets in the mixing
ratio of the tasks' weights, and shows live progress. Ctrl-C (or SIGTERM)
drains: every role gets SIGTERM (finish or release work, checkpoint), then the
server stops gracefully. Role logs go to `<runs_dir>/<run>/logs/`.

What it is not: a deployment tool. Each role it starts is a plain `jet`
command (shown with --dry-run) that runs the same way on other machines or in
docker compose.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from jet.cliopts import config_options, load_config
from jet.config import JetConfig
from jet.errors import ConfigError

DEFAULT_MODEL_HOME = ".jet/models"  # models under this folder are built on demand


@dataclass
class Role:
    name: str
    argv: list[str]
    required: bool = False  # `jet up` ends when every required role has exited
    proc: subprocess.Popen | None = None
    restarts: int = 0
    log: Path | None = None


def has_trainer() -> bool:
    return importlib.util.find_spec("jet.trainer.cli") is not None


def roles_for(cfg: JetConfig, config_path: str, overrides: tuple[str, ...], env_n: int) -> list[Role]:
    """The commands `jet up` runs, one Role each."""
    py = [sys.executable, "-m"]
    sets = [x for o in overrides for x in ("--set", o)]
    roles = [Role(f"infer-{m.name}", py + ["jet.workers.infer", "--config", config_path, "--model", m.name] + sets)
             for m in cfg.models]
    roles.append(Role("env", py + ["jet.workers.env", "--config", config_path, "-n", str(env_n)] + sets))
    if has_trainer():
        roles += [Role(f"train-{m.name}", py + ["jet.trainer.cli", "--config", config_path, "--model", m.name] + sets,
                       required=True) for m in cfg.models if m.trainable]
    return roles


def ensure_models(cfg: JetConfig) -> list[str]:
    """Build missing tiny models that live under .jet/models; other missing paths are errors."""
    built = []
    for i, m in enumerate(cfg.models):
        if (Path(m.path) / "config.json").is_file():
            continue
        if DEFAULT_MODEL_HOME not in Path(m.path).as_posix():
            raise ConfigError(f"models[{i}].path: no model directory at {m.path!r}")
        from jet.models import init_model

        init_model(m.path, seed=cfg.trainer_of(m.name).seed)  # a model's own trainer.seed: teams differ
        built.append(m.path)
    return built


class Supervisor:
    """Starts roles with their logs in `log_dir`; restarts one that crashes (it is disposable)."""

    def __init__(self, roles: list[Role], env: dict[str, str], log_dir: Path):
        self.roles, self.env, self.log_dir = roles, env, log_dir
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, role: Role) -> None:
        role.log = self.log_dir / f"{role.name}.log"
        out = open(role.log, "ab")
        role.proc = subprocess.Popen(role.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()

    def start_all(self) -> None:
        for r in self.roles:
            self.start(r)

    def poll(self) -> None:
        """Restart a role that crashed (a trainer resumes from its checkpoint); a clean exit is final."""
        for r in self.roles:
            code = r.proc.poll() if r.proc else None
            if code is not None and code != 0 and r.restarts < 5:
                r.restarts += 1
                self.start(r)

    def required_done(self) -> bool:
        req = [r for r in self.roles if r.required]
        return bool(req) and all(r.proc.poll() is not None for r in req)

    def stop(self, timeout: float) -> dict[str, int | None]:
        for r in self.roles:
            if r.proc and r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for r in self.roles:
            if r.proc is None:
                continue
            try:
                r.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()
        return {r.name: r.proc.returncode if r.proc else None for r in self.roles}


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
    roles = roles_for(cfg, config_path, overrides, env_n)
    if dry_run:
        for r in roles:
            click.echo(f"{r.name}: {' '.join(r.argv)}")
        return
    try:
        for path in ensure_models(cfg):
            click.echo(f"built tiny model at {path}", err=True)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    run_path = Path(cfg.runs_dir) / cfg.run
    write_resolved(cfg, run_path)
    server = None
    if not redis_url:
        from jet.queues.server import EmbeddedServer

        server = EmbeddedServer(run_dir).start()
        redis_url = server.url
        click.echo(f"embedded Redis at {redis_url} (data in {server.data_dir})", err=True)
    from jet.feed import Feeder

    env = {**os.environ, "JET_REDIS_URL": redis_url}
    sup = Supervisor(roles, env, run_path / "logs")
    feed = Feeder(cfg, redis_url)
    dash = None if no_dash else _start_dashboard(cfg, redis_url, run_path / "logs", dash_port)
    code, started = 0, time.monotonic()
    try:
        code = _run(cfg, sup, feed, episodes, no_live, dash.url if dash else None)
    finally:
        click.echo(feed.summary(), err=True)
        click.echo("draining roles...", err=True)
        codes = sup.stop(timeout=60)
        feed.close()
        if dash:
            dash.stop()
        if server:
            server.stop()
        bad = {k: v for k, v in codes.items() if v not in (0, None)}
        click.echo(f"stopped: {codes}; logs in {run_path / 'logs'}", err=True)
        _summary(cfg, feed, started, dash.url if dash else None)
        if bad and not code:
            code = 1
    raise SystemExit(code)


def _start_dashboard(cfg: JetConfig, redis_url: str, log_dir: Path, port: int):
    """The dashboard of this run (its URL printed), or None when it cannot start: it is only a viewer."""
    from jet.dash import launch

    try:
        dash = launch.start(cfg.run, cfg.runs_dir, redis_url, log_dir, port=port)
    except OSError as e:
        click.echo(f"dashboard not started: {e}", err=True)
        return None
    click.echo(f"dashboard at {dash.url} (log {dash.log})", err=True)
    return dash


def _summary(cfg: JetConfig, feed, started: float, dash_url: str | None) -> None:
    from jet.dash.training import Curves
    from jet.progress import summary, write_plots

    try:
        plots = write_plots(cfg)
    except Exception as e:  # noqa: BLE001 - a plot that fails must not hide the summary
        click.echo(f"plots not written: {e}", err=True)
        plots = []
    click.echo(summary(cfg, Curves(cfg.runs_dir), (time.monotonic() - started) / 60, plots=plots,
                       dash_url=dash_url), err=True)


def _run(cfg, sup: Supervisor, feed, episodes: int | None, no_live: bool, dash_url: str | None = None) -> int:
    from jet.dash.training import Curves
    from jet import progress

    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    sup.start_all()
    started = time.monotonic()
    curves = Curves(cfg.runs_dir)

    def step() -> bool:
        feed.tick()
        sup.poll()
        if episodes is not None and feed.trajectories >= episodes:
            return False
        return not sup.required_done()

    try:
        if no_live or not sys.stdout.isatty():
            last = 0.0
            while not stop and step():
                if time.monotonic() - last > 10:
                    last = time.monotonic()
                    click.echo(progress.line(cfg, sup.roles, feed, curves, started), err=True)
                time.sleep(1)
        else:
            from rich.live import Live

            show = lambda: progress.view(cfg, sup.roles, feed, curves, started, dash_url)  # noqa: E731
            with Live(show(), refresh_per_second=2) as live:
                while not stop and step():
                    live.update(show())
                    time.sleep(1)
    except KeyboardInterrupt:
        pass
    req = [r for r in sup.roles if r.required]
    return max((r.proc.returncode or 0 for r in req if r.proc and r.proc.poll() is not None), default=0)
