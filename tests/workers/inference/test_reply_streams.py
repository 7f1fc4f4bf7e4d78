"""Reply streams never outlive their client: a reply to a vanished client is dropped
and counted, and after drains and rolling reloads of env workers with requests in flight no reply
stream is left without a TTL."""

from __future__ import annotations

import signal

import anyio
import pytest

from jet.keys import GROUP_ENV
from jet.llm import Tokenizers, open_client
from jet.queues.connect import connect
from jet.workers.inference import worker as infer
from jet.workers.inference.hf import HFBackend
from tests.workers.conftest import MODEL, enqueue, wait_for, write_config


async def gen_pending(r, keys) -> int:
    if not await r.exists(keys.gen(MODEL)):
        return 0
    groups = await r.xinfo_groups(keys.gen(MODEL))
    return groups[0]["pending"] if groups else 0


async def settled(r, keys) -> bool:
    groups = await r.xinfo_groups(keys.gen(MODEL))
    return bool(groups) and groups[0]["pending"] == 0 and groups[0]["lag"] == 0


async def reply_streams_without_ttl(r, keys) -> list[str]:
    found = [k.decode() async for k in r.scan_iter(match=keys.pattern(), count=1000) if b":reply:" in k]
    return [k for k in found if await r.ttl(k) < 0]


@pytest.mark.anyio
async def test_a_reply_to_a_client_that_vanished_mid_request_is_dropped_and_counted(redis_url, keys, tmp_path,
                                                                                 tiny_model):
    cfg = write_config(tmp_path / "c.yaml", keys.run, tiny_model, [{"name": "t", "workflow": "a.b:c"}])
    backend = HFBackend(tiny_model)
    r = await connect(redis_url)
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: infer.run(cfg, MODEL, redis_url, stop, backend=backend))
        async with open_client(redis_url, keys, Tokenizers({MODEL: str(tiny_model)}), timeout_s=30) as client:
            llm = client.session("ep", MODEL)
            assert (await llm.generate([5, 6], max_tokens=2)).finish_reason in ("stop", "length")  # serving
            reply_to = client.reply_to
            async with backend.engine.gate.exclusive():  # admission paused, as during a weight load
                async with anyio.create_task_group() as calls:
                    calls.start_soon(lambda: llm.generate([5, 6, 7], max_tokens=50))
                    await wait_for(lambda: gen_pending(r, keys), timeout=30, every=0.01)  # the worker holds it
                    await wait_for(lambda: backend.engine.gate.waiting == 1, timeout=30, every=0.01)  # in the engine
                    calls.cancel_scope.cancel()  # the client gives up ...
        # ... and is gone (its reply stream deleted) before the worker generates the answer.
        assert not await r.exists(reply_to)
        await wait_for(lambda: settled(r, keys), timeout=30)
        stop.set()
    assert not await r.exists(reply_to)  # not recreated by the late reply
    assert int(await r.hget(keys.stats, "outputs_dropped")) == 1
    await r.aclose()


@pytest.mark.slow
@pytest.mark.anyio
async def test_drains_and_rolling_reloads_leave_no_reply_stream_without_a_ttl(redis_url, keys, tiny_model, procs):
    write_config(procs.cfg_path, keys.run, tiny_model, [{"name": "chat", "workflow": "tests.workers.flows:chat",
                                                         "concurrency": 16, "max_retries": 3}], lease_ms=3000)
    # More episodes than the test lets run: there is always work in flight when it signals.
    await enqueue(redis_url, keys, "chat", [{"turns": 2, "max_tokens": 100}] * 400)
    r = await connect(redis_url)
    procs.start("infer")
    env = procs.start("env", "-n", "2", "--drain-timeout", "0.1")
    await wait_for(lambda: gen_pending(r, keys), timeout=60, every=0.01)  # requests in flight
    env.send_signal(signal.SIGHUP)  # a rolling reload: the old generation drains with requests in flight
    await wait_for(lambda: _consumer_ending(r, keys, ".1"), timeout=60)
    await wait_for(lambda: gen_pending(r, keys), timeout=60, every=0.01)
    env.send_signal(signal.SIGTERM)  # and a drain, cut short by its deadline mid-request
    env.wait(60)
    await wait_for(lambda: settled(r, keys), timeout=60)  # the inference worker answered everything it held
    assert await reply_streams_without_ttl(r, keys) == []
    stats = {k.decode(): int(v) for k, v in (await r.hgetall(keys.stats)).items()}
    # the race happened: replies (or requests) of clients that were gone
    assert stats.get("outputs_dropped", 0) + stats.get("gen_skipped", 0) >= 1, stats
    await r.aclose()


async def _consumer_ending(r, keys, suffix: str) -> bool:
    if not await r.exists(keys.tasks("chat")):
        return False
    consumers = await r.xinfo_consumers(keys.tasks("chat"), GROUP_ENV)
    return any(c["name"].decode().endswith(suffix) for c in consumers)
