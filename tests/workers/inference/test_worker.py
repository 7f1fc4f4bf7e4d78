"""The inference worker and the LLM client against a real server: error replies, duplicates,
expired and orphaned requests, dead letters, timeouts, and weight following."""

from __future__ import annotations

import contextlib
import functools
import time

import anyio
import pytest
from safetensors.torch import load_file

from jet.errors import GenerationError, GenerationTimeout
from jet.llm import Tokenizers, open_client
from jet.queues import codec
from jet.queues.connect import connect
from jet.wire import GenRequest, GenResult, WeightVersion
from jet.workers.inference import worker as infer
from tests.weights import perturbed_weights
from tests.workers.conftest import MODEL, wait_for, write_config
from tests.workers.test_e2e import assert_logprobs_match_a_forward_pass, load_model


@contextlib.asynccontextmanager
async def serving(cfg, url):
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(infer.run, cfg, MODEL, url, stop))
        try:
            yield
        finally:
            stop.set()


@pytest.fixture
def cfg(tmp_path, keys, tiny_model):
    return write_config(tmp_path / "c.yaml", keys.run, tiny_model, [{"name": "t", "workflow": "a.b:c"}])


async def settled(r, keys) -> bool:
    """Every gen request read and finished (nothing pending, nothing unread)."""
    groups = await r.xinfo_groups(keys.gen(MODEL))
    return bool(groups) and groups[0]["pending"] == 0 and groups[0]["lag"] == 0


@pytest.mark.anyio
async def test_requests_get_one_reply_or_a_reason(redis_url, keys, cfg):
    r = await connect(redis_url)
    probe = keys.reply("probe")
    await r.xdel(probe, await r.xadd(probe, {b"x": b"1"}))  # the reply stream of a live client

    def req(**kw):
        return GenRequest(**{"reply_to": probe, "model": MODEL, "prompt_ids": [5, 6, 7], "max_tokens": 3, **kw})

    dup, expired = req(), req(deadline=time.time() - 10)
    long = req(prompt_ids=[5] * 300)
    orphan = GenRequest(reply_to=keys.reply("gone"), model=MODEL, prompt_ids=[5], max_tokens=2)
    foreign = GenRequest(reply_to="jet:{other}:reply:x", model=MODEL, prompt_ids=[5], max_tokens=2)
    for fields in [dup.to_fields(), dup.to_fields(), expired.to_fields(), long.to_fields(), orphan.to_fields(),
                   foreign.to_fields(), {b"v": b"1", b"k": b"gen", b"i": b"z", b"m": b"{}"}]:
        await r.xadd(keys.gen(MODEL), fields)
    async with serving(cfg, redis_url):
        await wait_for(lambda: settled(r, keys), timeout=30)
        replies = [GenResult.from_payload(codec.decode(f)) for _, f in await r.xrange(probe)]
        assert sorted(x.request_id for x in replies) == sorted([dup.msg_id, long.msg_id])  # dup answered once
        too_long = next(x for x in replies if x.request_id == long.msg_id)
        assert too_long.finish_reason == "error" and "context of 256 tokens" in too_long.error
        ok = next(x for x in replies if x.request_id == dup.msg_id)
        assert ok.finish_reason in ("stop", "length") and len(ok.token_ids) == len(ok.logprobs) >= 1
        assert ok.version == 0 and ok.worker.endswith(f"-infer-{MODEL}-0")
        # Skipped without a marker: expired (its caller gave up) and orphaned (the client is gone).
        assert not await r.exists(keys.done_marker("infer", expired.msg_id), keys.done_marker("infer", orphan.msg_id))
        assert not await r.exists(keys.reply("gone"))
        assert int(await r.hget(keys.stats, "gen_skipped")) == 2
        # ... so a retry under the same id is still served.
        await r.xadd(keys.gen(MODEL), GenRequest(reply_to=probe, model=MODEL, prompt_ids=[5, 6], max_tokens=2,
                                                 msg_id=expired.msg_id).to_fields())
        await wait_for(lambda: settled(r, keys), timeout=30)
        assert expired.msg_id in [GenResult.from_payload(codec.decode(f)).request_id for _, f in await r.xrange(probe)]
    dead = sorted(codec.decode(f).meta["reason"] for _, f in await r.xrange(keys.dead))
    assert len(dead) == 2 and "gen: missing required field 'reply_to'" in dead[0] and "not a key of run" in dead[1]
    await r.aclose()


@pytest.mark.anyio
async def test_client_errors_and_timeouts(redis_url, keys, cfg, tiny_model):
    tokenizers = Tokenizers({MODEL: str(tiny_model)})
    async with open_client(redis_url, keys, tokenizers, timeout_s=1.0) as client:
        llm = client.session("ep", MODEL, agent="solo")
        with pytest.raises(GenerationTimeout, match="in 1s"):
            await llm.generate([5, 6], max_tokens=2)  # nobody serves yet
        with pytest.raises(TypeError, match="stop_strings"):
            await llm.chat([{"role": "user", "content": "hi"}], stop_strings=["x"])
        with pytest.raises(ValueError, match="unknown model 'other'"):
            await llm.chat([{"role": "user", "content": "hi"}], model="other")
        r = await connect(redis_url)
        assert await r.xlen(keys.gen(MODEL)) == 1  # sent once: waiting is not a reason to send again
        await anyio.sleep(infer.DEADLINE_GRACE_S + 0.2)  # now past its deadline
        async with serving(cfg, redis_url):
            await wait_for(lambda: settled(r, keys), timeout=30)  # the stale request is skipped
            with pytest.raises(GenerationError, match="context"):
                await llm.generate([5] * 300, max_tokens=2)
            reply = await llm.chat([{"role": "user", "content": "hi"}], max_tokens=3)
            assert reply["role"] == "assistant" and isinstance(reply["content"], str)
            # Sampling parameters reach the backend: seeds reproduce, stop ids stop.
            first = await llm.generate([5, 6, 7], max_tokens=8, temperature=1.5, seed=3)
            again = await llm.generate([5, 6, 7], max_tokens=8, temperature=1.5, seed=3)
            assert first.token_ids == again.token_ids and first.finish_reason == "length"
            stop = first.token_ids[2]
            stopped = await llm.generate([5, 6, 7], max_tokens=8, temperature=1.5, seed=3, stop_token_ids=[stop])
            cut = first.token_ids.index(stop) + 1
            assert stopped.finish_reason == "stop" and stopped.token_ids == first.token_ids[:cut]
        call = llm.calls[0]  # errors are not recorded
        assert len(llm.calls) == 4 and call.agent == "solo" and call.model == MODEL and len(call.completion_ids) <= 3
        assert int(await r.hget(keys.stats, "gen_skipped")) == 1
        await r.aclose()


@pytest.mark.anyio
async def test_new_weights_are_followed_between_batches(redis_url, keys, cfg, tiny_model, tmp_path):
    v3 = cfg.run_dir / "weights" / MODEL / "v3"
    _, digest = perturbed_weights(tiny_model, v3, seed=1, scale=0.3)
    r = await connect(redis_url)
    async with open_client(redis_url, keys, Tokenizers({MODEL: str(tiny_model)}), timeout_s=30) as client:
        llm = client.session("ep", MODEL)
        async with serving(cfg, redis_url):
            assert (await llm.generate([5, 6, 7], max_tokens=4)).version == 0
            await r.xadd(keys.weights(MODEL), WeightVersion(MODEL, 3, str(v3), "0" * 64, 30).to_fields())
            await anyio.sleep(0.5)
            assert (await llm.generate([5, 6, 7], max_tokens=4)).version == 0  # hash mismatch: not loaded
            await r.xadd(keys.weights(MODEL), WeightVersion(MODEL, 3, str(v3), digest, 30).to_fields())
            result = await wait_for(lambda: _version(llm, 3), timeout=20)
    call = llm.calls[-1]
    assert result.version == call.version == 3
    from jet.timeline import merge_calls

    [sample] = merge_calls([call], "exact", episode_id="ep")
    model = load_model(tiny_model)
    model.load_state_dict(load_file(v3 / "model.safetensors"))
    assert_logprobs_match_a_forward_pass(model, sample, temperature=1.0)
    with pytest.raises(AssertionError):  # the old weights would not give these logprobs
        assert_logprobs_match_a_forward_pass(load_model(tiny_model), sample, temperature=1.0)
    await r.aclose()


async def _version(llm, version):
    result = await llm.generate([5, 6, 7], max_tokens=4)
    return result if result.version == version else None
