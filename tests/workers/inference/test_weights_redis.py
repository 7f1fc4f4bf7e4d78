"""Adapter versions through Redis (`jet.queues.blobs`), on a real inference worker process that shares no
folder with the trainer: it serves each new adapter version from the chunks alone (the trainer's folder
is deleted before the announcement), generating what the adapter model generates; a corrupted chunk
and a truncated version are dead-lettered with their reason while the old version keeps serving."""

from __future__ import annotations

import hashlib
import shutil
import time

import pytest
import torch

from jet.config import AdapterConfig, TrainerConfig
from jet.llm import Tokenizers, open_client
from jet.queues import blobs, codec
from jet.queues.connect import connect
from jet.trainer.backend_torch import TorchBackend
from jet.trainer.batch import build_step
from jet.trainer.packing import pack
from jet.trainer.weights import write_version
from jet.wire import WeightVersion
from jet.workers.inference.backend import SamplingParams
from jet.workers.inference.hf import HFBackend
from tests.trainer.test_step import small_batch
from tests.workers.conftest import MODEL, wait_for, write_config

PROMPT = [5, 6, 7, 8]


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_worker_without_the_run_folder_serves_adapter_versions_from_redis(redis_url, keys, tmp_path,
                                                                                  tiny_model, procs):
    write_config(tmp_path / "c.yaml", keys.run, tiny_model, [{"name": "t", "workflow": "a.b:c"}])
    elsewhere = tmp_path / "trainer-machine"  # the trainer's run folder: never inside the worker's roots
    trainer = TorchBackend(str(tiny_model), TrainerConfig(lr=0.05), adapter=AdapterConfig(r=4, alpha=16.0))
    inputs = build_step(small_batch(), advantage="grpo", loss_agg="token_mean", prefix_trees=False)
    rows = pack(inputs.samples, 64)
    local = HFBackend(tiny_model)  # what the adapter model generates, computed here
    r = await connect(redis_url)

    async def publish(version: int) -> tuple[WeightVersion, list[int]]:
        for _ in range(3):
            trainer.train_step(rows, inputs, lr=0.05)
        folder = elsewhere / f"v{version}"
        with trainer.full_module() as module:
            sha = write_version(module, folder)
        first, n = await blobs.put(r, keys, MODEL, version, folder, ("adapter_config.json", "adapter_model.safetensors"),
                                   chunk_bytes=4096, keep_versions=3)
        local.load_weights(folder, sha, version)
        [want] = local.generate([PROMPT], [SamplingParams(temperature=0, max_tokens=6)])
        shutil.rmtree(folder)  # nothing on disk for the worker to read
        return WeightVersion(MODEL, version, str(folder), sha, version, blob=first, blob_chunks=n), want

    async def announce(w: WeightVersion) -> None:
        await r.xadd(keys.weights(MODEL), w.to_fields())

    async def reasons() -> list[str]:
        return [codec.decode(f).meta["reason"] for _, f in await r.xrange(keys.dead)]

    procs.start("infer")
    async with open_client(redis_url, keys, Tokenizers({MODEL: str(tiny_model)}), timeout_s=60) as client:
        llm = client.session("ep", MODEL)

        async def served(version: int):
            result = await llm.generate(PROMPT, max_tokens=6, temperature=0)
            return result if result.version == version else None

        base = await llm.generate(PROMPT, max_tokens=6, temperature=0)
        assert base.version == 0
        for version in (1, 2):
            w, want = await publish(version)
            assert w.blob_chunks > 2, "chunked"
            t0 = time.monotonic()
            await announce(w)
            got = await wait_for(lambda: served(version), timeout=30, every=0.02)
            print(f"version {version} served {time.monotonic() - t0:.2f} s after its announcement")
            # the worker generates what the adapter model generates, with its logprobs, not the base's
            assert list(got.token_ids) == want.token_ids
            assert list(got.logprobs) == pytest.approx(want.logprobs, abs=1e-5)
            assert list(got.logprobs) != pytest.approx(list(base.logprobs), abs=1e-3)

        # a corrupted chunk: its bytes changed (the stream keeps what was written; a new entry carries it)
        w3, _ = await publish(3)
        entries = await r.xrange(keys.weight_blobs(MODEL), w3.blob, "+")
        forged = None
        for entry_id, fields in entries:
            f = dict(fields)
            f[b"data"] = f[b"data"][:-1] + bytes([f[b"data"][-1] ^ 1]) if f[b"i"] == b"1" else f[b"data"]
            new_id = await r.xadd(keys.weight_blobs(MODEL), f)
            forged = forged or new_id.decode()
        await announce(WeightVersion(MODEL, 3, w3.path, w3.sha256, 3, blob=forged, blob_chunks=w3.blob_chunks))
        dead = await wait_for(lambda: _count(reasons, 1), timeout=30)
        assert "chunk 1 of" in dead[0] and "fails its sha256" in dead[0], dead
        assert (await llm.generate(PROMPT, max_tokens=3)).version == 2, "the old version keeps serving"

        # a truncated version: its last chunks never written
        w4, _ = await publish(4)
        entries = await r.xrange(keys.weight_blobs(MODEL), w4.blob, "+")
        cut = None
        for entry_id, fields in entries[:-2]:
            new_id = await r.xadd(keys.weight_blobs(MODEL), dict(fields))
            cut = cut or new_id.decode()
        await r.xadd(keys.weight_blobs(MODEL), {b"v": b"9", b"f": b"x", b"i": b"0", b"n": b"1",
                                                b"sha": hashlib.sha256(b"").hexdigest().encode(), b"data": b""})
        await announce(WeightVersion(MODEL, 4, w4.path, w4.sha256, 4, blob=cut, blob_chunks=w4.blob_chunks))
        dead = await wait_for(lambda: _count(reasons, 2), timeout=30)
        assert "expected chunk" in dead[1], dead
        assert (await llm.generate(PROMPT, max_tokens=3)).version == 2

        # and the next good version is served
        w5, want = await publish(5)
        await announce(w5)
        got = await wait_for(lambda: served(5), timeout=30, every=0.02)
        assert list(got.token_ids) == want.token_ids
        assert list(got.logprobs) == pytest.approx(want.logprobs, abs=1e-5)
    await r.aclose()
    assert not elsewhere.exists() or not any(elsewhere.iterdir())


async def _count(reasons, n: int):
    got = await reasons()
    return got if len(got) >= n else None


def test_chunks_round_trip_and_the_stream_keeps_the_newest_versions(tmp_path, redis_url, keys):
    import anyio

    async def go():
        r = await connect(redis_url)
        try:
            heads = []
            for version in range(1, 6):
                src = tmp_path / f"src{version}"
                src.mkdir()
                (src / "a.json").write_text('{"r": %d}' % version)
                (src / "b.bin").write_bytes(bytes(range(256)) * 40 * version)
                heads.append(await blobs.put(r, keys, MODEL, version, src, ("a.json", "b.bin"), chunk_bytes=1000,
                                             keep_versions=2))
            out = await blobs.fetch(r, keys, MODEL, 5, *heads[-1], tmp_path / "out")
            assert (out / "b.bin").read_bytes() == (tmp_path / "src5" / "b.bin").read_bytes()
            assert (out / "a.json").read_text() == '{"r": 5}'
            # versions 4 and 5 are kept whole (exact MAXLEN of the newest version's chunk count x 2)
            assert await r.xlen(keys.weight_blobs(MODEL)) == 2 * heads[-1][1]
            with pytest.raises(blobs.BlobError) as info:
                await blobs.fetch(r, keys, MODEL, 1, *heads[0], tmp_path / "old")
            assert info.value.gone and "not in" in str(info.value)
        finally:
            await r.aclose()

    anyio.run(go)
