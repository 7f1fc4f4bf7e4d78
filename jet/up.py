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
    """Build missing tiny models that live under .jet/models; other missing paths are errors naming the key."""
    from jet.config import check_models

    built = []
    for m in cfg.models:
        if not (Path(m.path) / "config.json").is_file() and DEFAULT_MODEL_HOME in Path(m.path).as_posix():
            from jet.models import init_model

            init_model(m.path, seed=cfg.trainer_of(m.name).seed)  # a model's own trainer.seed: teams differ
            built.append(m.path)
    check_models(cfg)
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


def _progress_table(cfg: JetConfig, sup: Supervisor, feed, started: float):
    from rich.table import Table

    t = Table(title=f"jet up: run {cfg.run}  ({time.monotonic() - started:.0f}s)")
    for col in ("role", "pid", "state", "restarts"):
        t.add_column(col)
    for r in sup.roles:
        code = r.proc.poll() if r.proc else None
        t.add_row(r.name, str(r.proc.pid if r.proc else "-"), "running" if code is None else f"exit {code}",
                  str(r.restarts))
    s = Table(show_header=True)
    for col in ("stream", "length", "pending", "lag"):
        s.add_column(col)
    for row in feed.last_report:
        s.add_row(*map(str, row))
    from rich.console import Group

    lines = [t, s]
    if feed.rewards:
        from rich.text import Text

        recent = feed.rewards[-64:]
        lines.append(Text(f"trajectories: {feed.trajectories}  reward (last {len(recent)}): "
                          f"{sum(recent) / len(recent):.3f}"))
    return Group(*lines)


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
def cli(config_path, overrides, steps, episodes, env_n, redis_url, run_dir, dry_run, no_live):
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
        raise click.ClickException(f"{config_path}: {e}") from None
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
    code = 0
    try:
        code = _run(cfg, sup, feed, episodes, no_live)
    finally:
        click.echo(feed.summary(), err=True)
        click.echo("draining roles...", err=True)
        codes = sup.stop(timeout=60)
        feed.close()
        if server:
            server.stop()
        bad = {k: v for k, v in codes.items() if v not in (0, None)}
        click.echo(f"stopped: {codes}; logs in {run_path / 'logs'}", err=True)
        if bad and not code:
            code = 1
    raise SystemExit(code)


def _run(cfg, sup: Supervisor, feed, episodes: int | None, no_live: bool) -> int:
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    sup.start_all()
    started = time.monotonic()

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
                    click.echo(feed.summary(), err=True)
                time.sleep(1)
        else:
            from rich.live import Live

            with Live(_progress_table(cfg, sup, feed, started), refresh_per_second=2) as live:
                while not stop and step():
                    live.update(_progress_table(cfg, sup, feed, started))
                    time.sleep(1)
    except KeyboardInterrupt:
        pass
    req = [r for r in sup.roles if r.required]
    return max((r.proc.returncode or 0 for r in req if r.proc and r.proc.poll() is not None), default=0)
