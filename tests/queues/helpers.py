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
