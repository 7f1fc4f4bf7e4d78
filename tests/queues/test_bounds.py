"""What the queues keep is bounded: the dead stream (capped, drops counted, large originals truncated
with size and hash), idempotency markers (lifetime from the lease and delivery settings), replies to a
client that is gone (dropped and counted, never a new stream), and output streams (a commit waits,
atomically, while its output stream is full: it never overshoots)."""

import functools
import hashlib

import anyio
import pytest

from jet.errors import QueueError
from jet.queues import admin, codec
from jet.queues.connect import connect
from jet.queues.consumer import DEAD_ORIGINAL_MAX, Settings, default_marker_ttl
from jet.queues.messages import Commit
from jet.queues.producer import Producer
from jet.queues.runtime import Runtime
from tests.queues.helpers import close, entry, make_consumer, read_all

pytestmark = pytest.mark.anyio


async def test_dead_stream_is_capped_and_counts_what_it_drops(redis_url, keys):
    src = keys.tasks("a")
    c = await make_consumer(redis_url, keys, src, maxlen={"dead": 5})
    for i in range(8):
        await c.r.xadd(src, {b"v": b"9", b"k": b"x", b"i": b"%d" % i, b"m": b"{}"})
    while await c.fetch():
        pass
    assert await c.r.xlen(keys.dead) == 5  # the newest five
    stats = {k.decode(): int(v) for k, v in (await c.r.hgetall(keys.stats)).items()}
    assert stats["dead"] == 8 and stats["dead_dropped"] == 3
    kept = [p.raw["i"] for p in await read_all(c.r, keys.dead)]
    assert kept == [b"3", b"4", b"5", b"6", b"7"]
    assert (await c.r.xpending(src, "g"))["pending"] == 0
    await close(c)


async def test_a_large_original_is_kept_truncated_with_its_size_and_hash(redis_url, keys):
    src = keys.tasks("a")
    c = await make_consumer(redis_url, keys, src)
    big = {b"v": b"9", b"k": b"x", b"i": b"big", b"m": b"{}", b"i4:tokens": bytes(400_000)}
    await c.r.xadd(src, big)
    await c.r.xadd(src, {b"v": b"9", b"k": b"x", b"i": b"small", b"m": b"{}"})
    assert await c.fetch() == []
    dead = await c.r.xrange(keys.dead)
    sizes = [codec.entry_size(f) for _, f in dead]
    assert sizes[0] < DEAD_ORIGINAL_MAX  # 400 KB in, a few hundred bytes kept
    p = codec.decode(dead[0][1], max_bytes=1 << 30)
    assert p.meta["truncated"] is True and p.meta["original_bytes"] == codec.entry_size(big)
    digest = hashlib.sha256(b"".join(k + b"\0" + v for k, v in sorted(big.items()))).hexdigest()
    assert p.meta["original_sha256"] == digest
    assert "i4:tokens" not in p.raw and p.raw["i"] == b"big"
    # The small one is whole, and can be requeued; the truncated one cannot, and says why.
    ids = [i.decode() for i, _ in dead]
    with pytest.raises(QueueError, match=r"moved 1; cannot requeue .*400\d+ bytes kept truncated"):
        await admin.requeue(c.r, keys, ids, redis_url)
    assert await c.r.xlen(keys.dead) == 1
    await close(c)


@pytest.mark.parametrize("lease_ms, max_deliveries", [(1000, 2), (60_000, 5)])
async def test_markers_live_as_long_as_a_copy_can_arrive(redis_url, keys, lease_ms, max_deliveries):
    src, dst = keys.tasks("a"), keys.traj("b")
    c = await make_consumer(redis_url, keys, src, lease_ms=lease_ms, max_deliveries=max_deliveries)
    await c.r.xadd(src, entry(1))
    [d] = await c.fetch()
    assert await c.commit([(d, [(dst, entry(1))])]) == [True]
    ttl = await c.r.ttl(keys.done_marker("g", d.payload.msg_id))
    want = default_marker_ttl(lease_ms, max_deliveries)
    assert want == max(300, 2 * (max_deliveries + 1) * lease_ms // 1000)
    assert want - 5 <= ttl <= want  # not the 6 hours of before
    await close(c)


async def test_a_reply_to_a_client_that_is_gone_is_dropped_and_counted(redis_url, keys):
    src = keys.gen("m")
    c = await make_consumer(redis_url, keys, src)
    live = keys.reply("live")
    await c.r.xadd(live, entry(0))
    await c.r.expire(live, 600)
    await c.r.xadd(src, entry(1))
    await c.r.xadd(src, entry(2))
    d1, d2 = await c.fetch()
    assert await c.commit([(d1, [(live, entry(1))]), (d2, [(keys.reply("gone"), entry(2))])]) == [True, True]
    assert not await c.r.exists(keys.reply("gone"))  # never created
    assert int(await c.r.hget(keys.stats, "outputs_dropped")) == 1
    assert await c.r.xlen(live) == 2 and 590 <= await c.r.ttl(live) <= 600  # its TTL untouched
    await close(c)


async def test_a_full_output_stream_holds_commits_back_and_is_never_overshot(redis_url, keys):
    """Eight handlers finish at once into an output capped at 3 entries: the commit step checks room
    before it acks, so the stream never holds more than 3, and nothing is lost or doubled."""
    src, dst, n = keys.tasks("src"), keys.traj("dst"), 40
    r = await connect(redis_url)
    await Producer(r, redis_url, keys, src).send([entry(i) for i in range(n)])
    reader = await make_consumer(redis_url, keys, dst, "reader", group="trainer", batch=2)
    stop, seen, longest = anyio.Event(), [], 0

    async def handle(d):
        return Commit([(dst, entry(d.payload.meta["n"]))])

    async def read_slowly() -> None:
        nonlocal longest
        while len(seen) < n:
            longest = max(longest, await r.xlen(dst))
            for d in await reader.fetch():
                seen.append(d.payload.meta["n"])
                await reader.commit([(d, [])])
            await anyio.sleep(0.01)

    settings = Settings(block_ms=200, maxlen={"traj": 3})
    async with Runtime(redis_url, keys, src, "g", "each", settings) as rt:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(rt.serve_each, handle, stop, concurrency=8))
            with anyio.fail_after(60):
                await read_slowly()
            stop.set()
    assert sorted(seen) == list(range(n)) and longest <= 3
    assert (await r.xpending(src, "g"))["pending"] == 0
    await close(reader)
    await r.aclose()
