"""One test (or more) per delivery rule of docs/design.md, against a real server."""

import socket
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from jet.keys import GROUP_ENV, GROUP_ENV_SHADOW
from jet.queues import codec
from jet.queues.connect import connect
from jet.queues.consumer import consumer_name
from jet.queues.producer import Producer, safe_trim
from jet.queues.reaper import Reaper
from tests.queues.helpers import close, entry, eventually, idle_ms, make_consumer, read_all, serve

ROOT = Path(__file__).resolve().parents[2]


def spawn_hop(url: str, run: str, slot: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.queues.hop_worker", url, run, str(slot), *args],
                            cwd=ROOT, stdout=subprocess.DEVNULL)


async def outputs(r, keys, n: int) -> list[dict] | None:
    """The metadata of the hop's outputs once there are `n` of them."""
    rows = [codec.decode(f).meta for _, f in await r.xrange(keys.traj("dst"))]
    return rows if len(rows) >= n else None

pytestmark = pytest.mark.anyio


async def test_rule1_commit_is_atomic_and_effectively_once(redis_url, keys):
    src, dst = keys.tasks("a"), keys.traj("b")
    a = await make_consumer(redis_url, keys, src, "a", lease_ms=100)
    b = await make_consumer(redis_url, keys, src, "b", lease_ms=100)
    await a.r.xadd(src, entry(1))
    [da] = await a.fetch()
    # a stalls past its lease; b's reaper takes the message over (as soon as it may)
    assert await eventually(lambda: Reaper(b).reap()) == 1
    [db] = await b.fetch()
    assert db.deliveries == 2
    assert await b.commit([(db, [(dst, entry(1, by="b"))])]) == [True]
    assert await a.commit([(da, [(dst, entry(1, by="a"))])]) == [False]  # the stalled one writes nothing
    assert [p.meta["by"] for p in await read_all(a.r, dst)] == ["b"]
    # A redelivered copy of a committed message (same message id) is acked, not redone.
    await a.r.xadd(src, entry(1))
    assert await a.fetch() == []
    assert (await a.r.xpending(src, "g"))["pending"] == 0
    assert int(await a.r.hget(keys.stats, "duplicates")) == 1
    await close(a), await close(b)


async def test_rule1_commit_retry_after_lost_reply_writes_nothing_twice(redis_url, keys):
    src, dst = keys.tasks("a"), keys.traj("b")
    c = await make_consumer(redis_url, keys, src)
    await c.r.xadd(src, entry(1))
    [d] = await c.fetch()
    out = [(d, [(dst, entry(1)), (keys.traj("c"), entry(2))])]
    assert await c.commit(out) == [True]
    assert await c.commit(out) == [False]
    assert await c.r.xlen(dst) == 1 and await c.r.xlen(keys.traj("c")) == 1
    await close(c)


async def test_rule2_own_pending_entries_come_first(redis_url, keys):
    src = keys.tasks("a")
    c1 = await make_consumer(redis_url, keys, src, "same", lease_ms=60_000)
    for i in range(3):
        await c1.r.xadd(src, entry(i))
    first = await c1.fetch()
    assert [d.payload.meta["n"] for d in first] == [0, 1, 2]
    await close(c1)  # "crash" with 3 entries pending
    await c1.r.xadd(src, entry(3))
    c2 = await make_consumer(redis_url, keys, src, "same", lease_ms=60_000)
    again = await c2.fetch()
    assert [(d.payload.meta["n"], d.deliveries) for d in again] == [(0, 2), (1, 2), (2, 2)]
    assert [d.payload.meta["n"] for d in await c2.fetch()] == [3]
    await close(c2)


async def test_rule2_reaper_reclaims_idle_and_follows_cursor(redis_url, keys):
    src = keys.tasks("a")
    dead = await make_consumer(redis_url, keys, src, "gone", batch=500)
    live = await make_consumer(redis_url, keys, src, "live", lease_ms=100, batch=7)
    for i in range(120):
        await dead.r.xadd(src, entry(i))
    assert len(await dead.fetch()) == 120
    ids = [e[0] for e in await dead.r.xrange(src)]
    await dead.r.xdel(src, *ids[:30])  # payloads deleted while pending: lost work
    reaper, seen = Reaper(live), []

    async def reaped_all() -> bool:
        await reaper.reap()
        seen.extend(d.payload.meta["n"] for d in await live.fetch())
        for d in list(live.inflight.values()):
            await live.commit([(d, [])])
        return reaper.cursor == "0-0" and not live.claimed and len(seen) >= 90

    await eventually(reaped_all)
    assert sorted(seen) == list(range(30, 120))
    assert reaper.lost == 30 and int(await live.r.hget(keys.stats, "lost")) == 30
    assert (await live.r.xpending(src, "g"))["pending"] == 0
    await close(dead), await close(live)


async def test_rule2_renewed_lease_is_not_reclaimed(redis_url, keys):
    src, lease = keys.tasks("a"), 1000
    a = await make_consumer(redis_url, keys, src, "a", lease_ms=lease)
    b = await make_consumer(redis_url, keys, src, "b", lease_ms=lease)
    await a.r.xadd(src, entry(1))
    [d] = await a.fetch()

    async def past_lease() -> bool:
        return await idle_ms(a.r, src, "g", d.entry_id) > lease

    await eventually(past_lease, timeout=10)  # unrenewed, it is reclaimable now ...
    assert await a.renew() == []  # ... but a renews it:
    assert await idle_ms(a.r, src, "g", d.entry_id) < lease
    assert await Reaper(b).reap() == 0  # b may not take it
    assert (await a.r.xpending_range(src, "g", d.entry_id, d.entry_id, 1))[0]["consumer"] == b"a"
    await eventually(past_lease, timeout=10)  # a stops renewing: now b takes it
    assert await Reaper(b).reap() == 1
    assert await a.renew() == [d.entry_id]  # a learns it lost the lease
    await close(a), await close(b)


async def test_rule3_poison_goes_dead_after_max_deliveries(redis_url, keys):
    src, dst = keys.tasks("a"), keys.traj("b")
    c = await make_consumer(redis_url, keys, src, lease_ms=100, max_deliveries=3)
    await c.r.xadd(src, entry(1, poison=True))
    await c.r.xadd(src, entry(2))
    calls = []

    async def handle(batch):
        calls.extend(d.payload.meta["n"] for d in batch)
        return [ValueError("boom") if d.payload.meta.get("poison") else [(dst, entry(9))] for d in batch]

    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve, c, handle, stop)
        with anyio.fail_after(15):
            while not await c.r.xlen(keys.dead):
                await anyio.sleep(0.05)
        stop.set()
    assert calls.count(1) == 3 and calls.count(2) == 1
    [dl] = await read_all(c.r, keys.dead)
    assert "max_deliveries=3" in dl.meta["reason"] and "ValueError: boom" in dl.meta["last_error"]
    assert codec.decode({k.encode(): v for k, v in dl.raw.items()}).meta["n"] == 1
    assert (await c.r.xpending(src, "g"))["pending"] == 0
    await close(c)


async def test_rule4_trim_never_removes_pending_or_unread(redis_url, keys):
    src = keys.tasks("a")
    g1 = await make_consumer(redis_url, keys, src, "x", group="g1", batch=100)
    g2 = await make_consumer(redis_url, keys, src, "y", group="g2", batch=4)
    for i in range(10):
        await g1.r.xadd(src, entry(i))
    for d in await g1.fetch():  # g1 read and acked everything
        await g1.commit([(d, [])])
    got = await g2.fetch()  # g2 read 4: acks 0..1, keeps 2..3 pending; 4..9 unread
    await g2.commit([(d, []) for d in got[:2]])
    assert await safe_trim(g1.r, src) == 2
    left = [p.meta["n"] for p in await read_all(g1.r, src)]
    assert left == list(range(2, 10))
    await g2.commit([(d, []) for d in got[2:]])
    assert await safe_trim(g1.r, src) == 2
    assert [p.meta["n"] for p in await read_all(g1.r, src)] == list(range(4, 10))
    await g1.r.xadd(keys.tasks("nogroup"), entry(1))
    assert await safe_trim(g1.r, keys.tasks("nogroup")) == 0  # nobody read it yet
    await close(g1), await close(g2)


async def test_rule4_a_best_effort_group_never_holds_trimming_back(redis_url, keys):
    src = keys.tasks("a")
    live = await make_consumer(redis_url, keys, src, "x", group=GROUP_ENV, batch=100)
    shadow = await make_consumer(redis_url, keys, src, "s", group=GROUP_ENV_SHADOW, batch=3)
    for i in range(10):
        await live.r.xadd(src, entry(i))
    assert len(await shadow.fetch()) == 3  # then SIGKILLed: 3 pending, 7 never read, forever
    assert await safe_trim(live.r, src) == 0  # the live group has read nothing yet
    await live.commit([(d, []) for d in await live.fetch()])
    assert await safe_trim(live.r, src, best_effort=()) == 0  # waited for, the shadow would hold all 10 back
    assert await safe_trim(live.r, src) == 10
    await live.r.xadd(src, entry(10))
    await live.r.xgroup_destroy(src, GROUP_ENV)  # only the shadow group is left: nothing is trimmed
    assert await safe_trim(live.r, src) == 0 and await live.r.xlen(src) == 1
    await close(live), await close(shadow)


async def test_rule4_full_stream_applies_backpressure_never_drops(redis_url, keys):
    src = keys.tasks("a")
    c = await make_consumer(redis_url, keys, src, batch=3)
    prod = Producer(c.r, redis_url, keys, src, maxlen=10, batch=4)
    seen, maxlen_seen = [], 0

    async def consume():
        nonlocal maxlen_seen
        while len(seen) < 40:
            maxlen_seen = max(maxlen_seen, await c.r.xlen(src))
            for d in await c.fetch():
                seen.append(d.payload.meta["n"])
                await c.commit([(d, [])])
            await anyio.sleep(0.02)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await prod.send([entry(i) for i in range(40)])
    assert seen == list(range(40))
    assert prod.waited_s > 0 and maxlen_seen <= 10
    await close(c)


@pytest.mark.slow
async def test_rule6_a_restarted_process_finds_its_own_pending_entries(redis_url, keys):
    """Consumer names are host-role-slot: a process SIGKILLed mid-work and started again on the same
    slot re-reads the entries it held, though no reaper could take them (a 10-minute lease)."""
    src, n = keys.tasks("src"), 5
    a_client = await connect(redis_url)
    await Producer(a_client, redis_url, keys, src).send([entry(i, sleep=600) for i in range(n)])
    args = ["--each", str(n), "--lease-ms", "600000"]
    p = spawn_hop(redis_url, keys.run, 7, *args)
    name = consumer_name("hop", 7)
    assert name == f"{socket.gethostname()}-hop-7"

    async def all_held() -> bool:
        groups = await a_client.xinfo_groups(src)
        consumers = await a_client.xinfo_consumers(src, "g") if groups else []
        return [(c["name"], c["pending"]) for c in consumers] == [(name.encode(), n)]

    await eventually(all_held)
    p.kill()
    p.wait()
    q = spawn_hop(redis_url, keys.run, 7, *args)
    try:
        out = await eventually(lambda: outputs(a_client, keys, n), timeout=30)
    finally:
        q.terminate()
        assert q.wait(30) == 0
    assert sorted(o["n"] for o in out) == list(range(n))
    assert {(o["by"], o["deliveries"]) for o in out} == {(name, 2)}  # its own entries, re-read once
    assert (await a_client.xpending(src, "g"))["pending"] == 0
    await a_client.aclose()


async def test_rule7_blocking_read_outlasts_the_default_socket_timeout(redis_url, keys):
    """A BLOCK longer than redis-py's default 5 s socket timeout waits as asked and returns the entry
    that arrives meanwhile (with default settings the read times out and is retried silently)."""
    src = keys.tasks("quiet")
    c = await make_consumer(redis_url, keys, src, block_ms=9000)
    got: list = []

    async def read() -> None:
        got.extend(await c.fetch())

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        await anyio.sleep(6.0)  # past the 5 s default socket timeout, the read still blocks
        assert not got
        await c.r.xadd(src, entry(42))
    assert [d.payload.meta["n"] for d in got] == [42]
    await close(c)


async def test_rule3_rereads_after_restarts_need_not_count(redis_url, keys):
    """A consumer that holds entries on purpose (the trainer, until its checkpoint) re-reads them after
    each restart without counting a delivery, so ten restarts never dead-letter what it held; with
    counting on (every other role), the same restarts do."""
    for counting, want_dead in ((False, 0), (True, 3)):
        src = keys.tasks(f"held{int(counting)}")
        c = await make_consumer(redis_url, keys, src, "trainer", max_deliveries=5, count_rereads=counting)
        for i in range(3):
            await c.r.xadd(src, entry(i))
        assert len(await c.fetch()) == 3
        for _ in range(10):  # crash and restart under the same name, ten times
            await close(c)
            c = await make_consumer(redis_url, keys, src, "trainer", max_deliveries=5, count_rereads=counting)
            got = await c.fetch()
        dead = [p for p in await read_all(c.r, keys.dead) if p.meta["stream"] == keys.short(src)]
        assert len(dead) == want_dead
        if not counting:
            assert [d.deliveries for d in got] == [1, 1, 1] and (await c.r.xpending(src, "g"))["pending"] == 3
        await close(c)


async def test_rule3_reclaims_of_a_dead_predecessor_need_not_count(redis_url, keys):
    """A trainer in a crash loop: each restart finds the entries it held idle past the lease, and its
    reaper claims them before it re-reads them. Without counting, ten such restarts dead-letter nothing
    and the delivery count stays 1; with counting (every other role) the same reclaims dead-letter them."""
    for counting, want_dead in ((False, 0), (True, 2)):
        src = keys.tasks(f"reaped{int(counting)}")
        settings = dict(max_deliveries=5, count_rereads=counting, lease_ms=100)
        c = await make_consumer(redis_url, keys, src, "trainer", **settings)
        for i in range(2):
            await c.r.xadd(src, entry(i))
        assert len(await c.fetch()) == 2
        for _ in range(10):  # crash; the lease runs out; the next process reaps, then reads
            await close(c)
            await anyio.sleep(0.15)
            c = await make_consumer(redis_url, keys, src, "trainer", **settings)
            assert await Reaper(c).reap() == (2 if not counting or _ < 5 else 0)
            got = await c.fetch()
        dead = [p for p in await read_all(c.r, keys.dead) if p.meta["stream"] == keys.short(src)]
        assert len(dead) == want_dead
        if not counting:
            assert sorted(d.payload.meta["n"] for d in got) == [0, 1] and [d.deliveries for d in got] == [1, 1]
        await close(c)
