import anyio
import pytest

from jet.queues.producer import Producer
from tests.queues.helpers import close, entry, make_consumer, read_all, serve

pytestmark = pytest.mark.anyio


async def test_hop_moves_every_message_once(redis_url, keys):
    src, dst = keys.tasks("a"), keys.traj("b")
    c = await make_consumer(redis_url, keys, src)
    await Producer(c.r, redis_url, keys, src).send([entry(i) for i in range(250)])
    stop = anyio.Event()

    async def handle(batch):
        return [[(dst, entry(d.payload.meta["n"]))] for d in batch]

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve, c, handle, stop)
        with anyio.fail_after(20):
            while await c.r.xlen(dst) < 250:
                await anyio.sleep(0.05)
        stop.set()
    out = sorted(p.meta["n"] for p in await read_all(c.r, dst))
    assert out == list(range(250))
    assert (await c.r.xpending(src, "g"))["pending"] == 0
    await close(c)
