"""Fixtures of the worker tests (the model is tests/conftest.py's tiny_model): configs, enqueueing and
reading trajectories back, and worker processes (`procs`) whose logs a failing test's report shows."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from jet.config import load_file
from jet.keys import Keys
from jet.queues import codec
from jet.queues.connect import connect
from jet.queues.producer import Producer
from jet.wire import Task, Trajectory
from tests.queues.helpers import eventually

MODEL = "tiny"


def write_config(path: Path, run: str, model_dir: Path, tasks: list[dict], **queues):
    """A config file for run `run`: one model, the given tasks (defaults filled), short leases."""
    defaults = {"dataset": "guess", "group_size": 2, "concurrency": 4, "episode_timeout_s": 60, "max_retries": 1}
    data = {"run": run, "runs_dir": str(path.parent / "runs"), "queues": {"lease_ms": 3000, "block_ms": 200, "max_deliveries": 5, **queues},
            "models": [{"name": MODEL, "path": str(model_dir), "max_batch": 8}],
            "tasks": [{**defaults, **t} for t in tasks], "trainer": {"min_group_size": 1}}
    path.write_text(yaml.safe_dump(data))
    return load_file(path)


async def enqueue(url: str, keys: Keys, task: str, rows: list[dict], group_size: int = 2,
                  prefix: str = "g") -> list[Task]:
    tasks = [Task(task, row, group_id=f"{prefix}{i}", index=j, group_size=group_size)
             for i, row in enumerate(rows) for j in range(group_size)]
    r = await connect(url)
    await Producer(r, url, keys, keys.tasks(task)).send([t.to_fields() for t in tasks])
    await r.aclose()
    return tasks


async def trajectories(url: str, keys: Keys, model: str = MODEL) -> list[Trajectory]:
    r = await connect(url)
    try:
        return [Trajectory.from_payload(codec.decode(f)) for _, f in await r.xrange(keys.traj(model))]
    finally:
        await r.aclose()


async def wait_for(predicate, timeout: float, every: float = 0.1):
    """Poll `predicate` (awaiting what it returns, when awaitable) until it gives something truthy; return it.
    `tests.queues.helpers.eventually`, with the timeout always given and a slower default poll."""
    return await eventually(predicate, timeout, every)


ROOT = Path(__file__).resolve().parents[2]
HOST = socket.gethostname()


ROLE_MODULES = {"env": "jet.workers.rollout.worker", "infer": "jet.workers.inference.worker",
                "gateway": "jet.workers.gateway.app"}


class Procs:
    """Worker processes of one test, each logging to a file shown when the test fails."""

    def __init__(self, cfg_path: Path, url: str, logs: Path):
        self.cfg_path, self.url, self.logs, self.all = cfg_path, url, logs, []

    def start(self, role: str, *args: str) -> subprocess.Popen:
        env = {**os.environ, "JET_REDIS_URL": self.url, "OMP_NUM_THREADS": "1", "JET_LOG_LEVEL": "INFO"}
        log = open(self.logs / f"{role}-{len(self.all)}.log", "w")
        p = subprocess.Popen([sys.executable, "-m", ROLE_MODULES[role], "--config", str(self.cfg_path), *args],
                             cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.all.append(p)
        return p

    def kill_all(self) -> None:
        for p in self.all:
            if p.poll() is None:  # a -n supervisor forwards SIGTERM; twice: its children exit at once
                p.send_signal(signal.SIGTERM)
                time.sleep(0.2)
                p.send_signal(signal.SIGTERM)
        for p in self.all:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def dump(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(self.logs.glob("*.log")))


@pytest.fixture
def procs(tmp_path, redis_url):
    p = Procs(tmp_path / "c.yaml", redis_url, tmp_path)
    yield p
    p.kill_all()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that started worker processes (`procs`) shows their logs in its report."""
    outcome = yield
    report = outcome.get_result()
    procs = getattr(item, "funcargs", {}).get("procs")
    if report.when == "call" and report.failed and isinstance(procs, Procs):
        report.sections.append(("worker logs", procs.dump()))
