"""The trainer against a real Redis: exactly-once training across SIGKILL, a crash between a checkpoint
and its acks, the synchronous barrier (max_staleness 0), and weight publication.

Each test produces synthetic trajectories (random token ids, real wire messages) to traj:<model> and
checks the ledger of the surviving checkpoint lineage against the stream: every entry decided exactly
once, every trainable trajectory trained exactly once, nothing left pending.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import anyio
import pytest

from jet.config import load_file
from jet.queues import codec
from jet.queues.connect import connect
from jet.runs import read_metrics as read
from jet.trainer.checkpoint import Checkpoints
from jet.trainer.link import Link
from jet.wire import WeightVersion
from tests.trainer.helpers import MODEL, traj
from tests.trainer.rollouts import produce_sync, stream_state, synthetic_group, write_config

ROOT = Path(__file__).resolve().parents[2]


def trainer_dir(cfg) -> Path:
    return Path(cfg.run_dir) / "trainer" / MODEL


def start_trainer(config: Path, url: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JET_LOG_LEVEL": "INFO"}
    return subprocess.Popen([sys.executable, "-m", "jet.trainer.cli", "--config", str(config), "--redis-url", url],
                            env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def wait_until(predicate, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"trainer exited {proc.returncode}:\n{log.read_text()[-3000:] if log else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; log:\n{log.read_text()[-3000:] if log else ''}")
        time.sleep(0.1)


def last_step(cfg) -> int:
    path = trainer_dir(cfg) / "metrics.jsonl"
    return max((r["step"] for r in read(path)), default=0) if path.is_file() else 0


def signal_at_step(config: Path, url: str, log: Path, cfg, step: int, sig: int, wait_s: float) -> int:
    """Start a trainer, send it `sig` once its metrics reach `step` (it then waits for data); its exit status."""
    proc = start_trainer(config, url, log)
    try:
        wait_until(lambda: last_step(cfg) >= step, 120, proc, log)
        time.sleep(0.5)
        proc.send_signal(sig)
        return proc.wait(wait_s)
    finally:
        proc.kill()


def check_exactly_once(cfg, url, keys, produced: list, trainable_msgs: set[str]) -> list[dict]:
    """The ledger decides every produced entry once (the stream itself is trimmed once acked)."""
    ledger = Checkpoints(trainer_dir(cfg)).consumed()
    assert max(Counter(c["entry"] for c in ledger).values()) == 1, "an entry was decided twice"
    assert sorted(c["msg"] for c in ledger) == sorted(t.msg_id for t in produced), "every entry is decided"
    trained = [c["msg"] for c in ledger if c["outcome"] == "trained"]
    assert Counter(trained) == Counter(trainable_msgs), "every trainable trajectory is trained exactly once"
    assert anyio.run(stream_state, url, keys)["pending"] == 0
    return ledger


@pytest.mark.slow
@pytest.mark.every_server  # the trainer's exactly-once protocol, processes and all, on each server once
def test_sigkill_then_sigterm_lose_no_trajectory_and_train_none_twice(tiny_model, redis_url, keys, tmp_path):
    rng = random.Random(1)
    config = write_config(tmp_path / "c.yaml", keys.run, tiny_model, tmp_path / "runs", steps=8,
                          checkpoint_every=3, batch_groups=2, resume="checkpoint")  # resume points: test_resume_points
    cfg = load_file(config)
    log = tmp_path / "trainer.log"
    ckpts = Checkpoints(trainer_dir(cfg))

    # 1. four steps' worth; SIGKILL once step 4 is done (checkpoint at 3) and the trainer waits for more
    first = [t for g in range(8) for t in synthetic_group(f"a{g}", 2, rng)]
    produce_sync(redis_url, keys, first)
    signal_at_step(config, redis_url, log, cfg, 4, signal.SIGKILL, 10)
    assert ckpts.steps()[-1] == 3
    assert anyio.run(stream_state, redis_url, keys)["pending"] == 4, "step 4's trajectories stay pending"

    # 2. one more step's worth: the restart redoes step 4, does 5, waits; SIGTERM drains with a checkpoint
    second = [t for g in range(2) for t in synthetic_group(f"b{g}", 2, rng)]
    produce_sync(redis_url, keys, second)
    assert signal_at_step(config, redis_url, log, cfg, 5, signal.SIGTERM, 60) == 0, log.read_text()[-3000:]
    assert ckpts.steps()[-1] == 5, "SIGTERM writes a checkpoint"
    assert anyio.run(stream_state, redis_url, keys)["pending"] == 0, "and acks what it covers"

    # 3. the rest: three steps, a group that ends below min_group_size, a retried member
    third = [t for g in range(5) for t in synthetic_group(f"c{g}", 2, rng)]
    small = [traj("s", 0, size=2), traj("s", 1, size=2, failed=True)]
    retried = synthetic_group("r", 2, rng)
    retry = [traj("r", 1, size=2, failed=True, retry=True)]
    produce_sync(redis_url, keys, third + small + retry + retried)
    proc = start_trainer(config, redis_url, log)
    try:
        assert proc.wait(180) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
    produced = first + second + third + small + retry + retried
    ledger = check_exactly_once(cfg, redis_url, keys, produced, {t.msg_id for t in first + second + third + retried})
    assert Counter(c["outcome"] for c in ledger) == {"trained": 32, "small_group": 1, "failed": 1, "retried": 1}
    rows = read(trainer_dir(cfg) / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9)), "lost steps' lines are dropped, redone ones kept"
    # step 4 had published version 4; the restored step-3 weights are republished as 5, then steps 4-8: 10
    assert rows[-1]["policy/version"] == 10, "restored weights republished past the lost lineage's version 4"


@pytest.mark.slow
def test_a_crash_between_checkpoint_and_ack_does_not_retrain(tiny_model, redis_url, keys, tmp_path, monkeypatch):
    from jet.trainer import loop

    rng = random.Random(2)
    cfg = load_file(write_config(tmp_path / "c.yaml", keys.run, tiny_model, tmp_path / "runs", steps=4,
                                 checkpoint_every=2, batch_groups=2, resume="checkpoint"))  # the first ack: step 2's
    trajs = [t for g in range(8) for t in synthetic_group(f"g{g}", 2, rng)]
    produce_sync(redis_url, keys, trajs)

    class Crash(Exception):
        pass

    real_ack = Link.ack

    def crashing_ack(self, entries):
        if entries:
            raise Crash()
        real_ack(self, entries)

    monkeypatch.setattr(Link, "ack", crashing_ack)
    with pytest.raises(Crash):
        loop.run(cfg, MODEL, redis_url, lambda: False)
    assert Checkpoints(trainer_dir(cfg)).steps() == [2]
    assert anyio.run(stream_state, redis_url, keys)["pending"] == 16  # checkpointed, never acked
    monkeypatch.setattr(Link, "ack", real_ack)
    state = loop.run(cfg, MODEL, redis_url, lambda: False)
    assert state.step == 4
    check_exactly_once(cfg, redis_url, keys, trajs, {t.msg_id for t in trajs})


@pytest.mark.slow
def test_max_staleness_zero_trains_only_the_current_version(tiny_model, redis_url, keys, tmp_path):
    from jet.trainer import loop

    rng = random.Random(3)
    cfg = load_file(write_config(tmp_path / "c.yaml", keys.run, tiny_model, tmp_path / "runs", steps=2,
                                 max_staleness=0, batch_groups=2))
    v0 = [t for g in range(4) for t in synthetic_group(f"old{g}", 2, rng, version=0)]
    v1 = [t for g in range(2) for t in synthetic_group(f"new{g}", 2, rng, version=1)]
    produce_sync(redis_url, keys, v0 + v1)
    state = loop.run(cfg, MODEL, redis_url, lambda: False)
    assert (state.step, state.version) == (2, 2)
    ledger = check_exactly_once(cfg, redis_url, keys, v0 + v1, {t.msg_id for t in v0[:4] + v1})
    assert sorted(c["outcome"] for c in ledger if c["msg"] in {t.msg_id for t in v0[4:]}) == ["stale"] * 4
    rows = read(trainer_dir(cfg) / "metrics.jsonl")
    assert rows[-1]["counts/stale"] == 4 and [r["policy/staleness"] for r in rows] == [0, 0]


@pytest.mark.slow
@pytest.mark.parametrize("adapter", [None, {"r": 2}], ids=["full", "lora"])
def test_published_weights_are_on_disk_hashed_and_announced(tiny_model, redis_url, keys, tmp_path, adapter):
    from jet import adapters
    from jet.trainer import loop
    from jet.workers.inference.hf import HFBackend

    rng = random.Random(4)
    cfg = load_file(write_config(tmp_path / "c.yaml", keys.run, tiny_model, tmp_path / "runs", steps=2,
                                 publish_every=2, adapter=adapter))
    produce_sync(redis_url, keys, [t for g in range(4) for t in synthetic_group(f"g{g}", 2, rng)])
    loop.run(cfg, MODEL, redis_url, lambda: False)

    async def announcements():
        r = await connect(redis_url)
        try:
            return [WeightVersion.from_payload(codec.decode(f)) for _, f in await r.xrange(keys.weights(MODEL))]
        finally:
            await r.aclose()

    [w] = anyio.run(announcements)
    assert (w.version, w.step) == (1, 2)
    backend = HFBackend(tiny_model)
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    backend.load_weights(w.path, w.sha256, w.version)  # checks the hash and every tensor's name and shape
    assert backend.version == 1
    assert any(not (v == before[k]).all() for k, v in backend.model.state_dict().items())
    if adapter is None:
        assert json.loads((Path(w.path) / "config.json").read_text())["vocab_size"] == 512
        assert (w.blob, w.blob_chunks) == ("", 0), "full weights never go through Redis"
    else:  # the adapter alone, with peft's config
        assert adapters.is_adapter(w.path) and not (Path(w.path) / "model.safetensors").exists()
        assert json.loads((Path(w.path) / adapters.CONFIG_FILE).read_text())["r"] == 2
        assert w.blob and w.blob_chunks == 2, "and its two files travel through Redis too"


@pytest.mark.slow
def test_malformed_entries_and_other_models_trajectories_are_dead_lettered(tiny_model, redis_url, keys, tmp_path):
    from jet.trainer import loop
    from jet.wire import Trajectory

    cfg = load_file(write_config(tmp_path / "c.yaml", keys.run, tiny_model, tmp_path / "runs", steps=1))
    group = [t for g in range(2) for t in synthetic_group(f"g{g}", 2, random.Random(5))]
    other = Trajectory(task="t", group_id="x", index=0, episode_id="x", model="other", group_size=2)

    async def add_bad():
        r = await connect(redis_url)
        try:
            await r.xadd(keys.traj(MODEL), {b"v": b"1", b"k": b"traj", b"i": b"bad", b"m": b"not json"})
            await r.xadd(keys.traj(MODEL), other.to_fields())
        finally:
            await r.aclose()

    anyio.run(add_bad)
    produce_sync(redis_url, keys, group)
    assert loop.run(cfg, MODEL, redis_url, lambda: False).step == 1

    async def dead_reasons():
        r = await connect(redis_url)
        try:
            return sorted(codec.decode(f).meta["reason"] for _, f in await r.xrange(keys.dead))
        finally:
            await r.aclose()

    reasons = anyio.run(dead_reasons)
    assert len(reasons) == 2 and "model 'other'" in reasons[0] and "malformed entry" in reasons[1]
    assert anyio.run(stream_state, redis_url, keys)["pending"] == 0


@pytest.mark.slow
def test_a_stop_during_a_long_step_abandons_it_and_a_restart_trains_it(tiny_model, redis_url, keys, tmp_path):
    """A SIGTERM in the middle of a step far longer than a drain may wait: the trainer leaves it at the next
    micro-batch and exits 0 at once, nothing of the step acked; a restart trains those trajectories once."""
    from jet.trainer.step import DELAY_ENV

    config = write_config(tmp_path / "c.yaml", keys.run, tiny_model, tmp_path / "runs", steps=1,
                          checkpoint_every=1, batch_groups=2, micro_batch_tokens=12, prefix_trees=False,
                          kl_coef=0.01)  # KL on: every sample is forwarded, signal or not, so the step is long
    cfg = load_file(config)
    log = tmp_path / "trainer.log"
    rng = random.Random(3)
    produced = [t for g in range(2) for t in synthetic_group(f"a{g}", 2, rng)]
    produce_sync(redis_url, keys, produced)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JET_LOG_LEVEL": "INFO", DELAY_ENV: "1.5"}
    proc = subprocess.Popen([sys.executable, "-m", "jet.trainer.cli", "--config", str(config), "--redis-url",
                             redis_url], env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: anyio.run(stream_state, redis_url, keys)["pending"] == 4, 120, proc, log)
        time.sleep(2.5)  # in its step: more than 6 micro-batches of 1.5 s each (> 9 s)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-3000:]
        took = time.monotonic() - stopped
    finally:
        proc.kill()
    text = log.read_text()
    assert "abandoned" in text and "micro-batch" in text, text[-3000:]
    assert took < 6, f"the stop waited {took:.1f} s: more than a micro-batch and a clean exit"
    assert not Checkpoints(trainer_dir(cfg)).steps() and last_step(cfg) == 0, "nothing of the step was kept"
    assert anyio.run(stream_state, redis_url, keys)["pending"] == 4, "its trajectories stay pending"
    proc = start_trainer(config, redis_url, log)
    try:
        assert proc.wait(120) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
    check_exactly_once(cfg, redis_url, keys, produced, {t.msg_id for t in produced})
