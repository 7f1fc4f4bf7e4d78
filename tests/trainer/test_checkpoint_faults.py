"""The ledger against the acks, with the trainer SIGKILLed at every point of the checkpoint protocol.

A real `jet train` process runs with $JET_TRAINER_DIE_AT naming a point of
the protocol (`jet.trainer.checkpoint.die_at`: after the backend saved,
after state.json, after the rename, after the ledger write, after the acks;
POINTS says which others leave the same state), and SIGKILLs itself
the n-th time it gets there: the first checkpoint (step 2) or the second
(the stop's, at step 3). The same points of a resume point (`point:...`,
written at every publish that is not a checkpoint's: steps 1 and 3) are
killed too. Right after the kill, every acked trajectory (its idempotency
marker is set) must be in the ledger or in the `consumed` of the newest whole
checkpoint or point (which a resume acks and copies to the ledger).
Then a trainer restarts on the same run and finishes: the ledger must hold
every entry exactly once, every trainable trajectory trained exactly once,
the acked set equal to the ledger's, nothing pending, and the versions
announced on `weights:<model>` only ever grew. Two points (a checkpoint's
first, a resume point's last) are killed with a LoRA adapter model
(`models[].adapter`) instead of the full one: its checkpoints hold the adapter
alone and its resume points load the published adapter.

A second test is the deterministic repro of a ledger bug: one good group, a
checkpoint, then four failed trajectories and SIGTERM: the stop's checkpoint
of the same step must add the four, not replace the group's two.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from jet.config import load_file
from jet.keys import GROUP_TRAINER
from jet.queues import codec
from jet.queues.connect import connect
from jet.trainer.checkpoint import DIE_AT_ENV, STATE_FILE, Checkpoints
from jet.wire import WeightVersion
from tests.trainer.helpers import MODEL, traj
from tests.trainer.rollouts import produce_sync, stream_state, synthetic_group, write_config
from tests.trainer.test_trainer_redis import ROOT, check_exactly_once, trainer_dir, wait_until

# Where a kill leaves something different on disk or in Redis. Left out, as they leave what a listed one
# does: checkpoint:begin (as :saved, nothing whole yet) and checkpoint:written (as :ledger: with at most
# two checkpoints, keep_checkpoints 2 prunes nothing in between); point:begin and :saved (as :state).
POINTS = ["checkpoint:saved", "checkpoint:state", "checkpoint:renamed", "checkpoint:ledger", "checkpoint:acked"]
RESUME_POINTS = ["point:state", "point:renamed", "point:ledger", "point:acked"]
# +adapter: a LoRA adapter model at that point instead of the full model (the protocol is the backend's
# either way; the full model's checkpoints are killed at every other point).
CASES = ["checkpoint:saved+adapter"] + POINTS[1:] + RESUME_POINTS[:-1] + ["point:acked+adapter",
                                                                          "checkpoint:renamed@2", "checkpoint:acked@2",
                                                                          "point:written@2"]


def acked(url, keys, msg_ids: list[str]) -> set[str]:
    """Message ids whose trainer idempotency marker is set: what the trainer acked."""
    async def go():
        r = await connect(url)
        try:
            flags = await r.mget([keys.done_marker(GROUP_TRAINER, m) for m in msg_ids])
            return {m for m, f in zip(msg_ids, flags) if f is not None}
        finally:
            await r.aclose()

    return anyio.run(go)


def announced(url, keys) -> list[int]:
    """The versions announced on weights:<model>, in stream order."""
    async def go():
        r = await connect(url)
        try:
            return [WeightVersion.from_payload(codec.decode(f)).version
                    for _, f in await r.xrange(keys.weights(MODEL))]
        finally:
            await r.aclose()

    return anyio.run(go)


def run_trainer(config: Path, url: str, log: Path, env_extra: dict, timeout: float) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JET_LOG_LEVEL": "INFO", **env_extra}
    proc = subprocess.Popen([sys.executable, "-m", "jet.trainer.cli", "--config", str(config), "--redis-url", url],
                            env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    try:
        return proc.wait(timeout)
    finally:
        proc.kill()


@pytest.mark.slow
@pytest.mark.parametrize("point", CASES)
def test_a_kill_at_any_checkpoint_point_loses_no_ack_from_the_ledger(point, tiny_model, redis_url, keys, tmp_path):
    rng = random.Random(hash(point) % 1000)
    point, _, with_adapter = point.partition("+")
    config = write_config(tmp_path / "c.yaml", keys.run, tiny_model, tmp_path / "runs", steps=3,
                          checkpoint_every=2, batch_groups=1, adapter={"r": 2} if with_adapter else None)
    cfg = load_file(config)
    log = tmp_path / "trainer.log"
    good = [t for g in range(3) for t in synthetic_group(f"g{g}", 2, rng)]
    failed = [traj("f", i, size=2, failed=True) for i in range(2)]  # decided without a step: in the last ledger
    produced = good[:4] + failed + good[4:]
    produce_sync(redis_url, keys, produced)
    ids = [t.msg_id for t in produced]

    rc = run_trainer(config, redis_url, log, {DIE_AT_ENV: point}, 120)
    assert rc == -signal.SIGKILL, f"the trainer did not die at {point} (exit {rc}):\n{log.read_text()[-3000:]}"
    ckpts = Checkpoints(trainer_dir(cfg))
    in_ledger = {c["msg"] for c in ckpts.consumed()}
    newest = set()
    if ckpts.newest():
        (key, prefix) = ckpts.newest()
        folder = ckpts.dir / (prefix + ckpts.path(*key).name)
        newest = {c["msg"] for c in json.loads((folder / STATE_FILE).read_text())["consumed"]}
    assert acked(redis_url, keys, ids) <= in_ledger | newest, f"{point}: an acked entry is in no ledger"

    assert run_trainer(config, redis_url, log, {}, 120) == 0, log.read_text()[-3000:]
    ledger = check_exactly_once(cfg, redis_url, keys, produced, {t.msg_id for t in good})
    assert acked(redis_url, keys, ids) == {c["msg"] for c in ledger} == set(ids)
    versions = announced(redis_url, keys)
    assert versions == sorted(set(versions)), f"{point}: versions announced out of order: {versions}"
    if with_adapter:  # the checkpoints hold the adapter, not the model
        newest = ckpts.path(*ckpts.whole()[-1])
        assert (newest / "adapter.safetensors").is_file() and not (newest / "model.safetensors").exists()


@pytest.mark.slow
def test_a_second_checkpoint_of_a_step_adds_to_the_ledger(tiny_model, redis_url, keys, tmp_path):
    config = write_config(tmp_path / "c.yaml", keys.run, tiny_model, tmp_path / "runs", steps=10,
                          checkpoint_every=1, batch_groups=1)
    cfg = load_file(config)
    log = tmp_path / "trainer.log"
    good = synthetic_group("g", 2, random.Random(0))
    produce_sync(redis_url, keys, good)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JET_LOG_LEVEL": "INFO"}
    proc = subprocess.Popen([sys.executable, "-m", "jet.trainer.cli", "--config", str(config), "--redis-url",
                             redis_url], env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    try:
        ckpts = Checkpoints(trainer_dir(cfg))
        wait_until(lambda: len(ckpts.consumed()) == 2 and anyio.run(stream_state, redis_url, keys)["pending"] == 0,
                   120, proc, log)
        failed = [traj("f", i, size=4, failed=True) for i in range(4)]
        produce_sync(redis_url, keys, failed)
        wait_until(lambda: anyio.run(stream_state, redis_url, keys)["pending"] == 4, 60, proc, log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
    assert [k for k in ckpts.whole()] == [(1, 0), (1, 1)], "the stop wrote a second checkpoint of step 1"
    ledger = check_exactly_once(cfg, redis_url, keys, good + failed, {t.msg_id for t in good})
    assert sorted(c["outcome"] for c in ledger) == ["failed"] * 4 + ["trained"] * 2
    assert acked(redis_url, keys, [t.msg_id for t in good + failed]) == {c["msg"] for c in ledger}
