"""A two-task cocktail over a real run (docs/swarm.md): one task's workers under a separate
virtual env, both tasks training one model, mixed 3:1 by groups.

Real processes: an inference worker, the env worker supervisor (which starts the
second task's worker under the other interpreter) and the trainer. Groups are
offered 1:1; the trainer's per-task counters must end at 3:1 (tolerance: one group).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
import yaml

from tests.workers.conftest import MODEL, ROOT, Procs, enqueue, trajectories, wait_for
from tests.workers.rollout.test_runtimes import two_runtimes


@pytest.mark.slow
@pytest.mark.anyio
async def test_cocktail_ratio_with_one_task_in_its_own_venv(redis_url, keys, tiny_model, tmp_path):
    python, mine, theirs = two_runtimes(tmp_path)
    task = {"workflow": "conflictflow:flow", "dataset": "guess", "group_size": 2, "concurrency": 4,
            "episode_timeout_s": 60, "max_retries": 1}
    cfg = {"run": keys.run, "runs_dir": str(tmp_path / "runs"),
           "queues": {"lease_ms": 3000, "block_ms": 200},
           "models": [{"name": MODEL, "path": str(tiny_model), "max_batch": 8}],
           "tasks": [{**task, "name": "mine", "weight": 3.0, "runtime": {"cwd": str(mine)}},
                     {**task, "name": "theirs", "weight": 1.0,
                      "runtime": {"cwd": str(theirs), "python": str(python)}}],
           "trainer": {"min_group_size": 1, "batch_groups": 4, "steps": 4, "mix_wait_s": 60,
                       "micro_batch_tokens": 1024, "max_staleness": 100, "checkpoint_every": 2}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    await enqueue(keys=keys, url=redis_url, task="mine", rows=[{}] * 12, group_size=2, prefix="a")
    await enqueue(keys=keys, url=redis_url, task="theirs", rows=[{}] * 12, group_size=2, prefix="b")
    procs = Procs(path, redis_url, tmp_path)
    try:
        procs.start("infer")
        procs.start("env")
        trainer = subprocess.Popen([sys.executable, "-m", "jet.trainer.cli", "--config", str(path),
                                    "--model", MODEL], cwd=ROOT, env=procs_env(redis_url),
                                   stdout=open(tmp_path / "trainer.log", "w"), stderr=subprocess.STDOUT)
        assert trainer.wait(240) == 0, procs.dump()
        trajs = await wait_for(lambda: _at_least(redis_url, keys, 16), timeout=30)
    finally:
        procs.kill_all()
    metrics = [json.loads(line) for line in
               (tmp_path / "runs" / keys.run / "trainer" / MODEL / "metrics.jsonl").read_text().splitlines()]
    last = metrics[-1]
    assert last["step"] == 4
    trained = {t: last[f"train/{t}/groups"] for t in ("mine", "theirs")}
    assert trained["mine"] + trained["theirs"] == 16
    assert abs(trained["mine"] - 12) <= 1 and abs(trained["theirs"] - 4) <= 1, trained
    for m in metrics:  # the ratio holds at every step, not only at the end
        total = m["train/mine/groups"] + m["train/theirs/groups"]
        assert abs(m["train/mine/groups"] - 0.75 * total) <= 1, m
    versions = Counter((t.task, t.meta["info"]["jetconflict"]) for t in trajs if not t.failed)
    assert set(versions) == {("mine", "1.0"), ("theirs", "2.0")}


def procs_env(url: str) -> dict:
    import os

    return {**os.environ, "JET_REDIS_URL": url, "OMP_NUM_THREADS": "1"}


async def _at_least(url, keys, n):
    trajs = await trajectories(url, keys)
    return trajs if len(trajs) >= n else None
