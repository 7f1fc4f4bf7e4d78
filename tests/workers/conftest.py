"""Fixtures of the worker tests: a tiny model, configs, enqueueing and reading trajectories back."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import yaml

from jet.config import load_file
from jet.keys import Keys
from jet.models import init_model
from jet.queues import codec
from jet.queues.connect import connect
from jet.queues.producer import Producer
from jet.wire import Task, Trajectory

MODEL = "tiny"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("model") / MODEL, vocab_size=512, hidden_size=32, layers=2,
                      heads=4, kv_heads=2, max_position=256, seed=0)


def write_config(path: Path, run: str, model_dir: Path, tasks: list[dict], **queues):
    """A config file for run `run`: one model, the given tasks (defaults filled), short leases."""
    defaults = {"dataset": "guess", "group_size": 2, "concurrency": 4, "episode_timeout_s": 60, "max_retries": 1}
    data = {"run": run, "queues": {"lease_ms": 3000, "block_ms": 200, "max_deliveries": 5, **queues},
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
    """Poll the async `predicate` until it returns something truthy; return it."""
    with anyio.fail_after(timeout):
        while not (value := await predicate()):
            await anyio.sleep(every)
    return value
