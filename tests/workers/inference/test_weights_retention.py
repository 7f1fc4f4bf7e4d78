"""A follower behind the trainer's weight retention: announcements whose folders were pruned
(`jet.trainer.weights.prune_weights`) are skipped, without a dead letter, and the newest version is
loaded.

In-process `WeightFollower` on the real Redis of the fixture, a real HF backend of the tiny model,
real folders in tmp_path; and a real inference worker process, whose heartbeat is what the trainer's
retention reads as the version it serves (`jet.queues.registry.served`)."""

from __future__ import annotations

import anyio
import pytest

from jet.queues import registry
from jet.queues.connect import connect
from jet.trainer.weights import prune_weights, published_versions
from jet.wire import WeightVersion
from jet.workers.inference.hf import HFBackend
from jet.workers.inference.weights import WeightFollower
from tests.weights import perturbed_weights
from tests.workers.conftest import HOST, MODEL, wait_for, write_config


async def announce_versions(r, keys, root, tiny_model, versions) -> None:
    for v in versions:
        file, sha = perturbed_weights(tiny_model, root / f"v{v}", seed=v, scale=0.01)
        await r.xadd(keys.weights(MODEL), WeightVersion(MODEL, v, str(file.parent), sha, v).to_fields())


@pytest.mark.anyio
async def test_a_late_follower_skips_pruned_versions_to_the_newest(redis_url, keys, tiny_model, tmp_path):
    root = tmp_path / "weights" / MODEL
    r = await connect(redis_url)
    rb = await connect(redis_url, block_ms=200)
    backend = HFBackend(tiny_model)
    try:
        follower = WeightFollower(r, rb, redis_url, keys, MODEL, "h-infer-tiny-0", [root], block_ms=200)
        await follower.catch_up(backend)  # an empty stream: serving the model's own weights
        assert backend.version == 0
        # 20 versions are published while the follower is busy; retention keeps the newest 2
        await announce_versions(r, keys, root, tiny_model, range(1, 21))
        assert prune_weights(tmp_path, MODEL, 20, 2, {}) == [*range(1, 19)]
        assert published_versions(tmp_path, MODEL) == [19, 20]
        async with anyio.create_task_group() as tg:
            tg.start_soon(follower.run, backend)  # reads 16 at a time: the first read's newest (v16) is gone
            await wait_for(lambda: _serving(backend, 20), timeout=30)
            tg.cancel_scope.cancel()
        assert await r.xlen(keys.dead) == 0, "a pruned version is not poison"
        assert await r.hlen(keys.weights_rejected(MODEL)) == 0

        # a worker starting now catches up on the newest, past the pruned announcements
        late = HFBackend(tiny_model)
        await WeightFollower(r, rb, redis_url, keys, MODEL, "h-infer-tiny-1", [root]).catch_up(late)
        assert late.version == 20
    finally:
        await rb.aclose()
        await r.aclose()


async def _serving(backend, version: int):
    return backend.version == version or None


@pytest.mark.slow
@pytest.mark.anyio
async def test_an_inference_worker_reports_the_version_it_serves_to_retention(redis_url, keys, tiny_model, tmp_path,
                                                                             procs):
    cfg = write_config(procs.cfg_path, keys.run, tiny_model, [{"name": "t", "workflow": "a.b:c"}])
    root = cfg.run_dir / "weights" / MODEL
    r = await connect(redis_url)
    name = f"{HOST}-infer-{MODEL}-0"

    async def served(version: int):
        return await registry.served(r, keys, MODEL) == {name: version} or None

    try:
        procs.start("infer")
        await wait_for(lambda: served(0), timeout=60)  # the model's own weights: every version is kept
        await announce_versions(r, keys, root, tiny_model, [1])
        await wait_for(lambda: served(1), timeout=60)
        await announce_versions(r, keys, root, tiny_model, [2, 3])
        await wait_for(lambda: served(3), timeout=60)
        assert prune_weights(cfg.run_dir, MODEL, 3, 1, await registry.served(r, keys, MODEL)) == [1, 2]
    finally:
        await r.aclose()
