"""Small helpers for queue tests: build consumers and read streams back."""

from __future__ import annotations

from jet.keys import Keys
from jet.queues import codec
from jet.queues.connect import connect
from jet.queues.consumer import Consumer, Settings


async def make_consumer(url: str, keys: Keys, stream: str, name: str = "c0", group: str = "g",
                        **settings) -> Consumer:
    cfg = Settings(**{"block_ms": 200, **settings})
    r = await connect(url)
    rb = await connect(url, block_ms=cfg.block_ms)
    c = Consumer(r, rb, url, keys, stream, group, name, cfg)
    await c.ensure_group()
    return c


async def close(c: Consumer) -> None:
    await c.r.aclose()
    await c.rb.aclose()


def entry(i: int, **meta) -> dict[bytes, bytes]:
    return codec.encode("test", {"n": i, **meta}, msg_id=f"m{i}")


async def read_all(r, stream: str) -> list[codec.Payload]:
    return [codec.decode(f) for _, f in await r.xrange(stream)]


async def serve(c: Consumer, handle, stop, *, drain_timeout_s: float = 30.0) -> None:
    """`handle` served in batches by a consumer runtime with `c`'s stream, group, name and settings."""
    from jet.queues.runtime import Runtime

    async with Runtime(c.url, c.keys, c.stream, c.group, c.name, c.cfg, stop=stop) as rt:
        await rt.serve_batches(handle, stop, drain_timeout_s=drain_timeout_s)


async def eventually(probe, timeout: float = 20.0, every: float = 0.02):
    """Call `probe()` (awaiting what it returns, when awaitable) until it gives something truthy (and
    return it); fail after `timeout` s."""
    import anyio

    with anyio.fail_after(timeout):
        while not (got := await _value(probe())):
            await anyio.sleep(every)
    return got


async def _value(x):
    import inspect

    return await x if inspect.isawaitable(x) else x


async def idle_ms(r, stream: str, group: str, entry_id: str) -> int:
    """How long an entry has been idle in `group`'s PEL (ms); -1 if it is not pending."""
    rows = await r.xpending_range(stream, group, entry_id, entry_id, 1)
    return rows[0]["time_since_delivered"] if rows else -1
