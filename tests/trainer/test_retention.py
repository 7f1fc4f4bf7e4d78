"""Bounded disk: only the newest `trainer.keep_checkpoints` checkpoints and `trainer.keep_weights` published
versions stay, never one a live inference worker serves (its heartbeat in the registry), and the ledger
stays exact across pruning, a SIGKILL in the middle of it, and resumes.

Real folders in tmp_path, the real Redis of the fixture, real trainer runs (in-process or a SIGKILLed
`jet train` process, `jet.trainer.checkpoint.die_at`)."""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path

import anyio
import pytest

from jet.config import load_file
from jet.queues import registry
from jet.queues.connect import connect
from jet.trainer.checkpoint import DIE_AT_ENV, STATE_FILE, Checkpoints
from jet.trainer.weights import prune_weights, published_versions
from tests.trainer.helpers import MODEL
from tests.trainer.rollouts import produce_sync, synthetic_group, write_config
from tests.trainer.test_checkpoint_faults import acked, run_trainer
from tests.trainer.test_trainer_redis import check_exactly_once, trainer_dir


def record(step: int) -> list[dict]:
    return [{"entry": f"{step}-0", "msg": f"m{step}", "outcome": "trained", "step": step}]


def fake_save(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"x" * 64)


def test_only_the_newest_keep_checkpoints_stay_and_the_ledger_keeps_every_entry(tmp_path):
    ckpts = Checkpoints(tmp_path, keep=2)
    for step in range(1, 6):
        ckpts.write(step, {"version": step, "consumed": record(step)}, fake_save)
    assert ckpts.whole() == [(4, 0), (5, 0)]
    assert sorted(d.name for d in ckpts.dir.iterdir()) == ["step-00000004", "step-00000005"]
    assert [c["msg"] for c in ckpts.consumed()] == [f"m{s}" for s in range(1, 6)], "pruning keeps the ledger"

    # a checkpoint being written, and one half deleted by a crash mid-prune: neither counts
    (ckpts.dir / ".tmp-step-00000006").mkdir()
    (ckpts.dir / ".tmp-step-00000006" / STATE_FILE).write_text(json.dumps({"step": 6, "consumed": []}))
    half = ckpts.dir / ".old-step-00000003"
    half.mkdir()
    (half / STATE_FILE).write_text(json.dumps({"step": 3, "consumed": record(3)}))
    assert ckpts.whole() == [(4, 0), (5, 0)]
    folder, state = ckpts.resume()
    assert (folder.name, state["step"]) == ("step-00000005", 5)
    assert sorted(d.name for d in ckpts.dir.iterdir()) == ["step-00000004", "step-00000005"], "resume tidies"

    # keep 1: the next write deletes every other one, never the one it just wrote
    one = Checkpoints(tmp_path, keep=1)
    one.write(6, {"version": 6, "consumed": record(6)}, fake_save)
    assert one.whole() == [(6, 0)] and one.resume()[1]["step"] == 6
    assert [c["msg"] for c in one.consumed()] == [f"m{s}" for s in range(1, 7)]


def folders(root: Path, versions) -> None:
    for v in versions:
        (root / f"v{v}").mkdir(parents=True)
        (root / f"v{v}" / "model.safetensors").write_bytes(b"w" * 32)


def test_prune_weights_keeps_the_newest_k_and_every_version_from_the_oldest_served(tmp_path):
    root = tmp_path / "weights" / MODEL
    folders(root, range(1, 9))
    (root / ".old-v0").mkdir()  # a crash between a rename and its rmtree
    assert prune_weights(tmp_path, MODEL, 8, 2, None) == [] and published_versions(tmp_path, MODEL) == [*range(1, 9)]
    assert not (root / ".old-v0").exists()
    # a worker serving v3 (older than the newest 2) keeps v3 and everything newer
    assert prune_weights(tmp_path, MODEL, 8, 2, {"w-infer-0": 3, "w-infer-1": 8}) == [1, 2]
    assert published_versions(tmp_path, MODEL) == [3, 4, 5, 6, 7, 8]
    # a worker on the model's own weights (version 0) keeps everything
    assert prune_weights(tmp_path, MODEL, 8, 2, {"w-infer-2": 0}) == []
    # no worker, or workers all recent: the newest k
    assert prune_weights(tmp_path, MODEL, 8, 2, {"w-infer-1": 8}) == [3, 4, 5, 6]
    assert published_versions(tmp_path, MODEL) == [7, 8]
    assert prune_weights(tmp_path, MODEL, 8, 1, {}) == [7]
    assert sorted(p.name for p in root.iterdir()) == ["v8"]


@pytest.mark.anyio
async def test_served_versions_are_those_live_inference_workers_of_the_model_report(redis_url, keys):
    r = await connect(redis_url)
    try:
        await registry.beat(r, keys, "h-infer-tiny-0", "infer", every_s=60, model=MODEL, weight_version=2)
        await registry.beat(r, keys, "h-infer-tiny-1", "infer", every_s=60, model=MODEL, weight_version=5)
        await registry.beat(r, keys, "h-infer-other-0", "infer", every_s=60, model="other", weight_version=1)
        await registry.beat(r, keys, "h-trainer-tiny-0", "trainer", every_s=60, model=MODEL, weight_version=9)
        await registry.beat(r, keys, "h-env-0", "env", every_s=60)
        await registry.beat(r, keys, "h-infer-tiny-9", "infer", every_s=0.1, model=MODEL, weight_version=0)
        await anyio.sleep(1.2)  # that last one's hash expires: a dead worker pins nothing
        assert await registry.served(r, keys, MODEL) == {"h-infer-tiny-0": 2, "h-infer-tiny-1": 5}
    finally:
        await r.aclose()


def beat_sync(url, keys, name: str, version: int) -> None:
    async def go():
        r = await connect(url)
        try:
            await registry.beat(r, keys, name, "infer", every_s=60, model=MODEL, weight_version=version)
        finally:
            await r.aclose()

    anyio.run(go)


@pytest.mark.slow
def test_a_served_version_older_than_keep_weights_stays_and_the_ledger_stays_exact(tiny_model, redis_url, keys,
                                                                                   tmp_path):
    from jet.trainer import loop

    rng = random.Random(7)
    config = write_config(tmp_path / "c.yaml", keys.run, tiny_model, tmp_path / "runs", steps=2, batch_groups=1,
                          checkpoint_every=1, keep_checkpoints=1, keep_weights=1)
    cfg = load_file(config)
    groups = [t for g in range(6) for t in synthetic_group(f"g{g}", 2, rng)]
    produce_sync(redis_url, keys, groups)

    # 1. no inference worker: the newest version alone stays, and the newest checkpoint
    assert loop.run(cfg, MODEL, redis_url, lambda: False).version == 2
    assert published_versions(cfg.run_dir, MODEL) == [2]
    assert Checkpoints(trainer_dir(cfg)).whole() == [(2, 0)]

    # 2. a worker serves v2: resumed, three more steps; v2 and everything newer stay, though keep_weights is 1
    beat_sync(redis_url, keys, "h-infer-tiny-0", 2)
    cfg = load_file(write_config(config, keys.run, tiny_model, tmp_path / "runs", steps=5, batch_groups=1,
                                 checkpoint_every=1, keep_checkpoints=1, keep_weights=1))
    assert loop.run(cfg, MODEL, redis_url, lambda: False).version == 5
    assert published_versions(cfg.run_dir, MODEL) == [2, 3, 4, 5]
    assert Checkpoints(trainer_dir(cfg)).whole() == [(5, 0)]

    # 3. the worker moves on to v5: the next publish deletes what is older than it and than the newest one
    beat_sync(redis_url, keys, "h-infer-tiny-0", 5)
    cfg = load_file(write_config(config, keys.run, tiny_model, tmp_path / "runs", steps=6, batch_groups=1,
                                 checkpoint_every=1, keep_checkpoints=1, keep_weights=1))
    assert loop.run(cfg, MODEL, redis_url, lambda: False).version == 6
    assert published_versions(cfg.run_dir, MODEL) == [5, 6]

    ledger = check_exactly_once(cfg, redis_url, keys, groups, {t.msg_id for t in groups})
    assert [c["step"] for c in ledger] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]


@pytest.mark.slow
def test_a_kill_in_the_middle_of_pruning_loses_nothing(tiny_model, redis_url, keys, tmp_path):
    rng = random.Random(8)
    config = write_config(tmp_path / "c.yaml", keys.run, tiny_model, tmp_path / "runs", steps=4, batch_groups=1,
                          checkpoint_every=1, keep_checkpoints=1, keep_weights=1)
    cfg = load_file(config)
    log = tmp_path / "trainer.log"
    produced = [t for g in range(4) for t in synthetic_group(f"g{g}", 2, rng)]
    produce_sync(redis_url, keys, produced)
    ids = [t.msg_id for t in produced]

    # the second checkpoint renames the first to .old-step-00000001, then the trainer is SIGKILLed
    rc = run_trainer(config, redis_url, log, {DIE_AT_ENV: "checkpoint:pruning"}, 120)
    assert rc == -signal.SIGKILL, f"the trainer did not die while pruning (exit {rc}):\n{log.read_text()[-3000:]}"
    ckpts = Checkpoints(trainer_dir(cfg))
    assert sorted(d.name for d in ckpts.dir.iterdir()) == [".old-step-00000001", "step-00000002"]
    assert ckpts.whole() == [(2, 0)], "a half-pruned checkpoint no longer counts"
    assert acked(redis_url, keys, ids) <= {c["msg"] for c in ckpts.consumed()}

    assert run_trainer(config, redis_url, log, {}, 120) == 0, log.read_text()[-3000:]
    assert sorted(d.name for d in ckpts.dir.iterdir()) == ["step-00000004"]
    assert published_versions(cfg.run_dir, MODEL) == [4]
    ledger = check_exactly_once(cfg, redis_url, keys, produced, set(ids))
    assert acked(redis_url, keys, ids) == {c["msg"] for c in ledger} == set(ids)
