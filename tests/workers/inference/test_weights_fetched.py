"""Versions fetched from Redis (`jet.queues.blobs`) stay bounded and never outlive their worker: the follower's
folder holds the serving version (and the one being fetched), a version given up on goes at the next fetch,
the folder is deleted when the follower stops, and a worker that starts deletes the folders of dead workers.

In-process `WeightFollower` on the real Redis of the fixture, real chunks written by `blobs.put`; the backend
is a recorder of what it was asked to load (a version whose load fails raises the backend's WeightsError), so
no model is loaded: what is under test is the folder, not the load."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import anyio
import pytest

from jet.errors import WeightsError
from jet.queues import blobs
from jet.queues.connect import connect
from jet.wire import WeightVersion
from jet.workers.inference import weights
from jet.workers.inference.weights import WeightFollower, sweep_fetched
from tests.workers.conftest import MODEL, wait_for

FILES = ("adapter_config.json", "adapter_model.safetensors")


class Recorder:
    """A backend that serves whatever it is told to load, except the versions in `fail`; it checks the
    fetched files are there when asked to load them."""

    def __init__(self, fail=()):
        self.version, self.fail, self.loaded, self.beside = 0, set(fail), [], {}

    async def aload_weights(self, path: str, sha256: str, version: int) -> None:
        assert sorted(p.name for p in Path(path).iterdir()) == sorted(FILES)
        self.beside[version] = sorted(p.name for p in Path(path).parent.iterdir())  # the fetched folder now
        if version in self.fail:
            raise WeightsError(f"version {version}: refused by the test")
        self.version = version
        self.loaded.append((version, path))


@pytest.mark.anyio
async def test_fetched_versions_are_bounded_and_deleted_when_the_follower_stops(redis_url, keys, tmp_path,
                                                                              monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(weights, "RETRY_S", 0.01)
    r = await connect(redis_url)
    rb = await connect(redis_url, block_ms=100)
    backend = Recorder(fail={3})
    follower = WeightFollower(r, rb, redis_url, keys, MODEL, "h-infer-tiny-0", [tmp_path / "mine"], block_ms=100)

    async def announce(version: int) -> None:
        folder = tmp_path / "trainer" / f"v{version}"  # the trainer's folder: outside this worker's roots
        folder.mkdir(parents=True)
        for name in FILES:
            (folder / name).write_bytes(os.urandom(3000))
        first, n = await blobs.put(r, keys, MODEL, version, folder, FILES, chunk_bytes=1024)
        await r.xadd(keys.weights(MODEL), WeightVersion(MODEL, version, str(folder), "0" * 64, version,
                                                        blob=first, blob_chunks=n).to_fields())

    def fetched() -> list[str]:
        return sorted(p.name for p in follower._cache.iterdir()) if follower._cache else []

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(follower.run, backend)
            for version in (1, 2):
                await announce(version)
                await wait_for(lambda v=version: backend.version == v, timeout=20)
                assert fetched() == [f"v{version}"], "only the serving version is kept"
            cache = follower._cache
            assert cache.parent == tmp_path / "tmp" and cache.name.startswith(f"jet-weights-{MODEL}-{os.getpid()}-")
            await announce(3)  # refused: dead-lettered after its tries, the old version keeps serving
            await wait_for(lambda: r.xlen(keys.dead), timeout=20)
            assert backend.version == 2 and fetched() == ["v2", "v3"]
            await announce(4)  # the next fetch deletes the version given up on
            await wait_for(lambda: backend.version == 4, timeout=20)
            assert fetched() == ["v4"]
            tg.cancel_scope.cancel()
        assert not cache.exists(), "the follower stopped: its fetched versions are deleted"
        assert [v for v, _ in backend.loaded] == [1, 2, 4]
        # at most the serving version and the one being loaded: v3, given up on, went before v4 was fetched
        assert backend.beside == {1: ["v1"], 2: ["v1", "v2"], 3: ["v2", "v3"], 4: ["v2", "v4"]}
    finally:
        await rb.aclose()
        await r.aclose()


def test_a_starting_worker_deletes_the_folders_of_dead_workers_only(tmp_path):
    dead_pid = 2**22 + 12345  # above Linux's largest pid: no such process
    dead = tmp_path / f"jet-weights-my-model-{dead_pid}-abc_12"
    alive = tmp_path / f"jet-weights-my-model-{os.getpid()}-def34"
    other = tmp_path / "jet-weights-notes"  # not a follower's folder: left alone
    for folder in (dead, alive, other):
        (folder / "v1").mkdir(parents=True)
    assert sweep_fetched(tmp_path) == [dead]
    assert not dead.exists() and alive.exists() and other.exists()
