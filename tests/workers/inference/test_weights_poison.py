"""The poison policy of `weights:<model>` (docs/design.md, "Poison"), on a real inference worker process: crafted
announcements are dead-lettered with their real reason, the worker keeps serving the weights it
had, and after a SIGKILL and restart it never reads what it rejected again."""

from __future__ import annotations

import os
import shutil

import pytest

from jet.llm import Tokenizers, open_client
from jet.queues import codec
from jet.queues.connect import connect
from jet.wire import WeightVersion, file_sha256
from tests.weights import perturbed_weights
from tests.workers.conftest import MODEL, wait_for, write_config


async def dead_reasons(r, keys) -> list[str]:
    return [codec.decode(f).meta["reason"] for _, f in await r.xrange(keys.dead)]


async def serving_version(llm, version: int):
    result = await llm.generate([5, 6, 7], max_tokens=3)
    return result if result.version == version else None


@pytest.mark.slow
@pytest.mark.anyio
async def test_crafted_weight_announcements_are_dead_lettered_and_never_reread(redis_url, keys, tmp_path,
                                                                              tiny_model, procs):
    cfg = write_config(tmp_path / "c.yaml", keys.run, tiny_model, [{"name": "t", "workflow": "a.b:c"}])
    root = cfg.run_dir / "weights" / MODEL
    r = await connect(redis_url)

    async def announce(version, path, sha):
        await r.xadd(keys.weights(MODEL), WeightVersion(MODEL, version, str(path), sha, 1).to_fields())

    async def rejected(n: int, timeout=30) -> list[str]:
        return await wait_for(lambda: _at_least(r, keys, n), timeout=timeout)

    # Crafted files: a non-safetensors file (with its true hash), a good file outside the run,
    # a symlink from inside the weights folder to that file.
    (root / "v1").mkdir(parents=True)
    junk = root / "v1" / "model.safetensors"
    junk.write_bytes(b"this is not a safetensors file" * 10)
    outside, outside_sha = perturbed_weights(tiny_model, tmp_path / "elsewhere" / "v2", seed=1, scale=0.3)
    os.symlink(outside.parent, root / "v3")
    good, good_sha = perturbed_weights(tiny_model, root / "v4", seed=2, scale=0.3)
    older = root / "v2"
    shutil.copytree(good.parent, older)

    procs.start("infer")
    async with open_client(redis_url, keys, Tokenizers({MODEL: str(tiny_model)}), timeout_s=60) as client:
        llm = client.session("ep", MODEL)
        assert (await llm.generate([5, 6, 7], max_tokens=3)).version == 0

        await announce(1, junk.parent, file_sha256(junk))
        assert "not a readable safetensors file" in (await rejected(1))[0]
        await announce(2, outside.parent, outside_sha)
        await announce(3, root / "v3", outside_sha)
        await announce(-1, good.parent, good_sha)
        await r.xadd(keys.weights(MODEL), {b"v": b"1", b"k": b"weights", b"i": b"x", b"m": b"{not json"})
        reasons = await rejected(5)
        assert "outside the allowed weights folders" in reasons[1] and "outside" in reasons[2]
        assert "version must be >= 0" in reasons[3] and "malformed weights announcement" in reasons[4]
        assert (await llm.generate([5, 6, 7], max_tokens=3)).version == 0  # still serving

        await announce(4, good.parent, good_sha)
        await wait_for(lambda: serving_version(llm, 4), timeout=30)
        await announce(2, older, good_sha)  # a version that does not increase
        assert "does not increase on version 4" in (await rejected(6))[5]
        assert (await llm.generate([5, 6, 7], max_tokens=3)).version == 4

        # SIGKILL and restart: the newest announcement is the one it rejected last; it takes
        # the newest one it did not reject (v4) and dead-letters nothing again.
        victim = procs.all[0]
        victim.kill()
        victim.wait()
        procs.start("infer")
        await wait_for(lambda: serving_version(llm, 4), timeout=60)
    assert len(await dead_reasons(r, keys)) == 6
    meta = [codec.decode(f).meta for _, f in await r.xrange(keys.dead)]
    assert {m["stream"] for m in meta} == {f"weights:{MODEL}"} and all(m["consumer"].endswith("-0") for m in meta)
    assert await r.hlen(keys.weights_rejected(MODEL)) == 6
    assert int(await r.hget(keys.stats, "dead")) == 6
    await r.aclose()


async def _at_least(r, keys, n):
    reasons = await dead_reasons(r, keys)
    return reasons if len(reasons) >= n else None
