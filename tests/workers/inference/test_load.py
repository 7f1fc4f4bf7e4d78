"""The inference worker under load, with its real hf engine slowed down: a call waits as long as its
request queues (never re-sent, never decoded twice), a copy of a request being decoded joins it, a
request whose caller gave up is dropped undecoded, and a lost reply stream makes the call send again."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import Counter

import anyio
import pytest

from jet.config import load_file
from jet.errors import GenerationTimeout
from jet.llm import Tokenizers, open_client
from jet.queues import codec
from jet.queues.connect import connect
from jet.wire import GenRequest, GenResult
from jet.workers.inference import worker as infer
from jet.workers.inference.hf import HFBackend
from tests.workers.conftest import MODEL, wait_for, write_config

pytestmark = pytest.mark.anyio
LEASE_MS = 600


class SlowEngine:
    """An HFBackend whose continuous-batching engine (the real one) takes `step_s` more per step and
    holds its steps while `gate` is clear; `decoded` counts the requests admitted, by prompt."""

    def __init__(self, model_dir, max_inflight: int, step_s: float):
        self.backend = HFBackend(str(model_dir), max_inflight=max_inflight)
        self.decoded: Counter[tuple[int, ...]] = Counter()
        self.gate = threading.Event()
        self.gate.set()
        sched = self.backend.engine.sched
        step = sched.step

        def slow_step(new=()):
            self.decoded.update(tuple(row.prompt) for row in new)
            self.gate.wait(30)
            time.sleep(step_s)
            return step(new)

        sched.step = slow_step


def config(tmp_path, keys, tiny_model, max_inflight: int):
    path = tmp_path / "c.yaml"
    write_config(path, keys.run, tiny_model, [{"name": "t", "workflow": "a.b:c"}], lease_ms=LEASE_MS)
    return load_file(path, [f"models.0.max_inflight={max_inflight}"])


@contextlib.asynccontextmanager
async def serving(cfg, url, engine: SlowEngine):
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(infer.run, cfg, MODEL, url, stop, backend=engine.backend))
        try:
            yield
        finally:
            engine.gate.set()
            stop.set()


async def stats(r, keys) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in (await r.hgetall(keys.stats)).items()}


async def test_a_saturated_engine_decodes_every_request_once(redis_url, keys, tmp_path, tiny_model):
    """Twelve calls at once on an engine that decodes two at a time: the last ones wait in the queue far
    longer than three leases (the client's old retry timeout, after which it sent a copy that was decoded
    again), and every call still gets its one reply from one decoding."""
    cfg = config(tmp_path, keys, tiny_model, max_inflight=2)
    engine, n = SlowEngine(tiny_model, max_inflight=2, step_s=0.1), 12
    results, waited = {}, []
    r = await connect(redis_url)
    async with serving(cfg, redis_url, engine), \
            open_client(redis_url, keys, Tokenizers({MODEL: str(tiny_model)}), timeout_s=60) as client:
        llm = client.session("ep", MODEL)

        async def call(i: int) -> None:
            t0 = time.monotonic()
            results[i] = await llm.generate([5, 10 + i, 7], max_tokens=6, seed=i)
            waited.append(time.monotonic() - t0)

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(call, i)
    assert sorted(results) == list(range(n)) and all(x.finish_reason in ("stop", "length") for x in results.values())
    assert max(waited) > 3 * LEASE_MS / 1000  # the premise: the queue was longer than the old timeout
    assert engine.decoded == Counter({(5, 10 + i, 7): 1 for i in range(n)})  # each decoded exactly once
    assert "gen_skipped" not in await stats(r, keys) and "duplicates" not in await stats(r, keys)
    await r.aclose()


async def test_a_copy_of_a_request_being_decoded_joins_it(redis_url, keys, tmp_path, tiny_model):
    """The same request id twice in the stream (a client that sent it again): both copies are read at
    once, the second waits for the first's decoding; one decoding, one reply, both entries acked."""
    cfg = config(tmp_path, keys, tiny_model, max_inflight=2)
    engine = SlowEngine(tiny_model, max_inflight=2, step_s=0.1)
    r = await connect(redis_url)
    probe = keys.reply("probe")
    await r.xdel(probe, await r.xadd(probe, {b"x": b"1"}))  # the reply stream of a live client
    req = GenRequest(reply_to=probe, model=MODEL, prompt_ids=[5, 6, 7], max_tokens=4, seed=1)
    for _ in range(2):
        await r.xadd(keys.gen(MODEL), req.to_fields())

    async def settled() -> bool:
        groups = await r.xinfo_groups(keys.gen(MODEL))  # (none before the worker made its group)
        return bool(groups) and groups[0]["pending"] == 0 and groups[0]["lag"] == 0

    async with serving(cfg, redis_url, engine):
        await wait_for(settled, timeout=30)
    replies = [GenResult.from_payload(codec.decode(f)) for _, f in await r.xrange(probe)]
    assert [x.request_id for x in replies] == [req.msg_id]
    assert engine.decoded == Counter({(5, 6, 7): 1})
    await r.aclose()


async def test_a_request_whose_caller_gave_up_is_dropped_undecoded(redis_url, keys, tmp_path, tiny_model):
    """A call whose request queues behind a long one past its timeout raises GenerationTimeout, having
    sent its request once; the worker that reaches it later drops it without decoding it."""
    cfg = config(tmp_path, keys, tiny_model, max_inflight=1)
    engine = SlowEngine(tiny_model, max_inflight=1, step_s=0.01)
    r = await connect(redis_url)
    async with serving(cfg, redis_url, engine), \
            open_client(redis_url, keys, Tokenizers({MODEL: str(tiny_model)}), timeout_s=60) as client:
        llm = client.session("ep", MODEL)
        async with anyio.create_task_group() as tg:
            engine.gate.clear()  # the long request holds the engine's only slot
            tg.start_soon(functools.partial(llm.generate, [5, 6, 7], max_tokens=4))
            await wait_for(lambda: engine.decoded[(5, 6, 7)] == 1, timeout=30)
            with pytest.raises(GenerationTimeout, match=r"no reply to \w+ from gen:tiny in 1s"):
                await llm.generate([8, 9], max_tokens=4, timeout_s=1.0)
            copies = [codec.decode(f).msg_id for _, f in await r.xrange(keys.gen(MODEL))]
            assert len(copies) == 2 and len(set(copies)) == 2  # the long request and ONE copy of the late one
            await anyio.sleep(infer.DEADLINE_GRACE_S)  # the late one is past its deadline, skew included
            engine.gate.set()
        await wait_for(lambda: _skipped(r, keys), timeout=30)
    assert engine.decoded == Counter({(5, 6, 7): 1})  # the late one was never decoded
    await r.aclose()


async def test_a_lost_reply_stream_makes_waiting_calls_send_again(redis_url, keys, tmp_path, tiny_model):
    """The server loses the data (here: the reply stream and the request are deleted) while a call
    waits: the reader sees its stream gone, makes it again, and the call sends its request again."""
    cfg = config(tmp_path, keys, tiny_model, max_inflight=2)
    engine = SlowEngine(tiny_model, max_inflight=2, step_s=0.01)
    r = await connect(redis_url)
    async with open_client(redis_url, keys, Tokenizers({MODEL: str(tiny_model)}), timeout_s=60,
                           block_ms=200) as client:
        llm = client.session("ep", MODEL)
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(llm.generate, [5, 6, 7], max_tokens=4))
            await wait_for(lambda: r.xlen(keys.gen(MODEL)), timeout=10)  # sent; nobody serves yet
            await r.delete(keys.gen(MODEL), client.reply_to)
            await wait_for(lambda: r.xlen(keys.gen(MODEL)), timeout=10)  # sent again
            async with serving(cfg, redis_url, engine):
                await wait_for(lambda: len(llm.calls) == 1, timeout=30)
    assert engine.decoded == Counter({(5, 6, 7): 1})
    await r.aclose()


async def _skipped(r, keys) -> bool:
    return (await stats(r, keys)).get("gen_skipped") == 1


async def test_a_call_waits_no_longer_than_its_episode(redis_url, keys, tiny_model):
    """A session with a deadline (an env worker's episode timeout) sends requests that end with it,
    sooner than the model's timeout: no worker decodes for an episode that is over."""
    r = await connect(redis_url)
    async with open_client(redis_url, keys, Tokenizers({MODEL: str(tiny_model)}), timeout_s=60) as client:
        llm = client.session("ep", MODEL)
        llm.deadline = time.time() + 1.0
        t0 = time.monotonic()
        with pytest.raises(GenerationTimeout):
            await llm.generate([5, 6], max_tokens=2)  # nobody serves
        assert time.monotonic() - t0 < 10
    [(_, fields)] = await r.xrange(keys.gen(MODEL))
    assert GenRequest.from_payload(codec.decode(fields)).deadline == pytest.approx(llm.deadline, abs=0.01)
    await r.aclose()
