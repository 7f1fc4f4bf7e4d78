"""Synthetic trajectories on traj:<model> for trainer tests: random token ids, real wire messages."""

from __future__ import annotations

import random
from pathlib import Path

import anyio
import yaml

from jet.config import load_file
from jet.keys import Keys
from jet.queues.connect import connect
from jet.queues.producer import Producer
from jet.timeline import Call, merge_calls
from jet.wire import Trajectory
from tests.trainer.helpers import MODEL


def synthetic_group(group: str, size: int, rng: random.Random, version: int = 0, vocab: int = 500,
                    turns: int = 2) -> list[Trajectory]:
    """One GRPO group of `size` members: multi-turn episodes of random tokens, rewards 0/1."""
    prompt = [rng.randrange(vocab) for _ in range(6)]
    out = []
    for i in range(size):
        calls, ids = [], list(prompt)
        for _ in range(turns):
            completion = [rng.randrange(vocab) for _ in range(rng.randint(2, 6))]
            calls.append(Call(tuple(ids), tuple(completion), [-6.0] * len(completion), version, MODEL, "main"))
            ids += completion + [rng.randrange(vocab) for _ in range(2)]
        reward = float(rng.random() < 0.5)
        samples = merge_calls(calls, "exact", episode_id=f"{group}-{i}", reward=reward)
        out.append(Trajectory(task="t", group_id=group, index=i, episode_id=f"{group}-{i}", model=MODEL,
                              reward=reward, samples=tuple(samples), group_size=size))
    return out


async def produce(url: str, keys: Keys, trajectories: list[Trajectory]) -> None:
    r = await connect(url)
    try:
        await Producer(r, url, keys, keys.traj(MODEL)).send([t.to_fields() for t in trajectories])
    finally:
        await r.aclose()


def produce_sync(url: str, keys: Keys, trajectories: list[Trajectory]) -> None:
    anyio.run(produce, url, keys, trajectories)


async def stream_state(url: str, keys: Keys) -> dict:
    """Entry ids left in traj:<model> (acked ones get trimmed) and the trainer group's pending count."""
    r = await connect(url)
    try:
        entries = [i.decode() for i, _ in await r.xrange(keys.traj(MODEL))]
        groups = await r.xinfo_groups(keys.traj(MODEL))
        pending = sum(int(g.get("pending", g.get(b"pending", 0))) for g in groups)
        return {"entries": entries, "pending": pending}
    finally:
        await r.aclose()


def write_config(path: Path, run: str, model_dir: Path, runs_dir: Path, adapter: dict | None = None,
                 **trainer) -> Path:
    """A trainer config of one model (with a LoRA `adapter` section when given) and these trainer settings."""
    model = {"name": MODEL, "path": str(model_dir), **({"adapter": adapter} if adapter is not None else {})}
    data = {"run": run, "runs_dir": str(runs_dir), "queues": {"block_ms": 200, "lease_ms": 3000},
            "models": [model],
            "trainer": {"lr": 1e-3, "batch_groups": 2, "micro_batch_tokens": 128, "max_staleness": 1000,
                        "publish_every": 1, "checkpoint_every": 2, "steps": 6, "group_timeout_s": 30,
                        "lease_s": 60, **trainer}}
    path.write_text(yaml.safe_dump(data))
    load_file(path)  # validate
    return path
