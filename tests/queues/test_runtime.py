"""The consumer runtime's per-message mode (`serve_each`): slow and fast messages in flight together,
each committed as it finishes, nothing lost when the process is SIGKILLed mid-work."""

import functools
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from jet.queues import codec
from jet.queues.connect import connect
from jet.queues.consumer import Settings
from jet.queues.messages import Commit, Dead, Drop
from jet.queues.producer import Producer
from jet.queues.runtime import Runtime
from tests.queues.helpers import entry, eventually, idle_ms, read_all

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]


async def test_each_message_commits_as_it_finishes_while_slow_ones_run(redis_url, keys):
    src, dst = keys.tasks("src"), keys.traj("dst")
    r = await connect(redis_url)
    await Producer(r, redis_url, keys, src).send([entry(0, slow=True)] + [entry(i) for i in range(1, 9)])
    release_slow, stop = anyio.Event(), anyio.Event()
    in_flight: set[int] = set()
    peak = 0

    async def handle(d):
        nonlocal peak
        n = d.payload.meta["n"]
        in_flight.add(n)
        peak = max(peak, len(in_flight))
        try:
            if d.payload.meta.get("slow"):
                await release_slow.wait()
            else:
                await anyio.sleep(0.01 * n)
        finally:
            in_flight.discard(n)
        return Commit([(dst, entry(n))])

    async def fast_ones_out() -> bool:
        return await r.xlen(dst) == 8

    async with Runtime(redis_url, keys, src, "g", "each", Settings(block_ms=200)) as rt:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(rt.serve_each, handle, stop, concurrency=4))
            await eventually(fast_ones_out)  # eight fast ones committed around the slow one ...
            assert 0 in in_flight and (await r.xpending(src, "g"))["pending"] == 1  # ... still running
            release_slow.set()
            await eventually(lambda: _equals(r.xlen(dst), 9))
            stop.set()
    assert sorted(p.meta["n"] for p in await read_all(r, dst)) == list(range(9))
    assert [p.meta["n"] for p in await read_all(r, dst)][-1] == 0  # the slow one was committed last
    assert peak == 4  # never more in flight than asked
    assert (await r.xpending(src, "g"))["pending"] == 0
    await r.aclose()


async def _equals(value, want) -> bool:
    return await value == want


async def _at_least(value, least) -> bool:
    return await value >= least


async def test_each_outcomes_are_values(redis_url, keys):
    src, dst = keys.tasks("src"), keys.traj("dst")
    r = await connect(redis_url)
    await Producer(r, redis_url, keys, src).send([entry(i) for i in range(4)])
    stop, tries = anyio.Event(), {}

    async def handle(d):
        n = d.payload.meta["n"]
        tries[n] = tries.get(n, 0) + 1
        if n == 0:
            return Commit([(dst, entry(0))])
        if n == 1:
            return Dead("no good")
        if n == 2:
            return Drop("moot")
        if tries[n] == 1:
            raise RuntimeError("flaky")  # an exception is a Release with its traceback
        return Commit([(dst, entry(3))])

    async with Runtime(redis_url, keys, src, "g", "each", Settings(block_ms=200, lease_ms=300)) as rt:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(rt.serve_each, handle, stop, concurrency=2))
            await eventually(lambda: _equals(r.xlen(dst), 2))
            stop.set()
    assert sorted(p.meta["n"] for p in await read_all(r, dst)) == [0, 3]
    [dl] = await read_all(r, keys.dead)
    assert dl.meta["reason"] == "no good" and codec.decode({k.encode(): v for k, v in dl.raw.items()}).meta["n"] == 1
    stats = await r.hgetall(keys.stats)
    assert stats[b"dead"] == b"1" and stats[b"moot"] == b"1"
    assert tries[3] == 2 and (await r.xpending(src, "g"))["pending"] == 0
    await r.aclose()


@pytest.mark.slow
async def test_each_sigkill_mid_work_loses_nothing(redis_url, keys):
    """Fast messages are committed at once; the slow ones are in flight when the process is
    SIGKILLed; a restarted process on the same slot finishes them, each exactly once."""
    src, n = keys.tasks("src"), 12
    r = await connect(redis_url)
    await Producer(r, redis_url, keys, src).send([entry(i, sleep=600 if i % 4 == 0 else 0.01) for i in range(n)])
    args = [redis_url, keys.run, "3", "--each", "4", "--lease-ms", "600000"]
    p = subprocess.Popen([sys.executable, "-m", "tests.queues.hop_worker", *args], cwd=ROOT, stdout=subprocess.DEVNULL)

    async def fast_done_slow_held() -> bool:
        return await r.xlen(keys.traj("dst")) == 9 and (await r.xpending(src, "g"))["pending"] == 3

    try:
        await eventually(fast_done_slow_held, timeout=30)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    q = subprocess.Popen([sys.executable, "-m", "tests.queues.hop_worker", *args], cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        await eventually(lambda: _equals(r.xlen(keys.traj("dst")), n), timeout=30)
    finally:
        q.send_signal(signal.SIGTERM)
        assert q.wait(30) == 0
    out = [x.meta for x in await read_all(r, keys.traj("dst"))]
    assert sorted(o["n"] for o in out) == list(range(n))
    assert {o["n"]: o["deliveries"] for o in out} == {i: 2 if i % 4 == 0 else 1 for i in range(n)}
    assert (await r.xpending(src, "g"))["pending"] == 0
    await r.aclose()


async def test_a_busy_consumer_leaves_a_dead_ones_work_to_an_idle_one(redis_url, keys):
    """Reclaiming follows free capacity: a consumer whose handler slots are all busy claims nothing,
    so the entry of a consumer that died goes to one that can start it now."""
    src, dst = keys.tasks("src"), keys.traj("dst")
    r = await connect(redis_url)
    await r.xgroup_create(src, "g", id="0", mkstream=True)
    await r.xadd(src, entry(1))
    settings, stop, release, by = Settings(block_ms=100, lease_ms=300), anyio.Event(), anyio.Event(), {}

    def handler(name):
        async def handle(d):
            by[d.payload.meta["n"]] = name
            if name == "busy":
                await release.wait()
            return Commit([(dst, entry(d.payload.meta["n"]))])
        return handle

    async def serve(name):
        async with Runtime(redis_url, keys, src, "g", name, settings) as rt:
            await rt.serve_each(handler(name), stop, concurrency=1)

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve, "busy")
        await eventually(lambda: _equals(anyio.to_thread.run_sync(lambda: by.get(1)), "busy"))
        await r.xadd(src, entry(0))  # the busy one is full, so it reads nothing new: a consumer that
        [[_, [(dead_id, fields)]]] = await r.xreadgroup("g", "died", {src: ">"}, count=1)  # then dies takes 0
        assert codec.decode(fields).meta["n"] == 0
        # the dead one's entry stays unclaimed past three leases (several reaper passes of the busy one):
        # a claim would reset its idle time
        await eventually(lambda: _at_least(idle_ms(r, src, "g", dead_id), 3 * settings.lease_ms))
        assert 0 not in by
        tg.start_soon(serve, "idle")
        await eventually(lambda: _equals(anyio.to_thread.run_sync(lambda: by.get(0)), "idle"))
        release.set()
        await eventually(lambda: _equals(r.xlen(dst), 2))
        stop.set()
    assert by == {0: "idle", 1: "busy"}
    await r.aclose()


async def test_messages_finishing_together_as_the_drain_ends_are_all_committed(redis_url, keys):
    """The committer is settling one message while all the others finish and the drain closes the result
    stream: it takes the rest in its next settle and ends cleanly (it once raised EndOfStream there, which
    crashed the worker). Each round lets the loop turn a different number of times before the others finish."""
    src, dst = keys.tasks("src"), keys.traj("dst")
    r = await connect(redis_url)
    n, sent = 8, 0
    for turns in range(1, 13):
        first = sent
        await Producer(r, redis_url, keys, src).send([entry(first + i) for i in range(n)])
        go_first, go, stop, started = anyio.Event(), anyio.Event(), anyio.Event(), set()

        async def handle(d, first=first, go_first=go_first, go=go, started=started):
            started.add(d.payload.meta["n"])
            await (go_first if d.payload.meta["n"] == first else go).wait()
            return Commit([(dst, entry(d.payload.meta["n"]))])

        async with Runtime(redis_url, keys, src, "g", "together", Settings(block_ms=100)) as rt:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(rt.serve_each, handle, stop, concurrency=n, drain_timeout_s=10))
                await eventually(lambda: len(started) == n)
                stop.set()  # the drain: every message is running
                go_first.set()  # the first finishes; its commit goes to the server ...
                for _ in range(turns):
                    await anyio.sleep(0)
                go.set()  # ... while the rest finish and the drain closes the stream
        sent += n
    assert sorted(p.meta["n"] for p in await read_all(r, dst)) == list(range(sent))
    assert (await r.xpending(src, "g"))["pending"] == 0
    await r.aclose()


@pytest.mark.parametrize("mode", ["each", "batches"])
async def test_a_call_finishing_after_the_drain_deadline_leaves_its_entry_pending(redis_url, keys, mode):
    """A handler that finishes inside a shielded step (the hf engine's decoding step) after the drain
    deadline cancelled the committer: the role still stops cleanly (serve_each raised BrokenResourceError,
    which crashed the inference worker), and the outcome is not committed: the entry stays pending,
    released, and the next consumer commits it exactly once."""
    src, dst = keys.tasks("src"), keys.traj("dst")
    r = await connect(redis_url)
    await Producer(r, redis_url, keys, src).send([entry(0)])
    stop, started, finished = anyio.Event(), anyio.Event(), anyio.Event()

    async def late(d):
        started.set()
        with anyio.CancelScope(shield=True):  # a step always completes, deadline or not
            await anyio.sleep(0.6)
        finished.set()
        return Commit([(dst, entry(d.payload.meta["n"], by="late"))])

    async with Runtime(redis_url, keys, src, "g", "late", Settings(block_ms=100)) as rt:
        async with anyio.create_task_group() as tg:
            if mode == "each":
                tg.start_soon(functools.partial(rt.serve_each, late, stop, concurrency=2, drain_timeout_s=0.1))
            else:
                tg.start_soon(functools.partial(rt.serve_batches, _each_of(late), stop, drain_timeout_s=0.1))
            await started.wait()
            stop.set()
    assert finished.is_set()  # the call did finish, after the deadline
    if mode == "each" or await r.xlen(dst) == 0:  # (a batch's settle may have reached the server first)
        assert await r.xlen(dst) == 0  # ... and was not committed
        [pending] = await r.xpending_range(src, "g", "-", "+", 10)
        assert pending["time_since_delivered"] > 10**8  # released: the next reaper pass takes it at once

    async def again(d):
        return Commit([(dst, entry(d.payload.meta["n"], by="next"))])

    stop = anyio.Event()
    async with Runtime(redis_url, keys, src, "g", "next", Settings(block_ms=100, lease_ms=300)) as rt:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(rt.serve_each, again, stop, concurrency=1))
            await eventually(lambda: _equals(r.xlen(dst), 1))
            stop.set()
    committed = [(p.meta["n"], p.meta["by"]) for p in await read_all(r, dst)]
    assert committed == [(0, "next")] or (mode == "batches" and committed == [(0, "late")])  # exactly once
    assert (await r.xpending(src, "g"))["pending"] == 0
    await r.aclose()


def _each_of(handle):
    """A batch handler that runs `handle` on each message of its batch."""
    async def batch(ds):
        return [await handle(d) for d in ds]
    return batch
