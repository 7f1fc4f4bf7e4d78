"""A consumer process for fault tests: moves `tasks:src` to `traj:dst` through
the atomic commit, optionally sleeping per message. Run as
`python -m tests.queues.hop_worker URL RUN SLOT [--lease-ms N] [--sleep S]`.
"""

from __future__ import annotations

import argparse
import logging

import anyio

from jet.keys import Keys
from jet.queues import codec
from jet.queues.connect import connect
from jet.queues.consumer import Consumer, Settings, consumer_name
from jet.queues.serve import serve, watch_signals


async def main(args) -> None:
    keys = Keys(args.run)
    cfg = Settings(lease_ms=args.lease_ms, block_ms=300, batch=args.batch, max_deliveries=args.max_deliveries)
    r = await connect(args.url)
    rb = await connect(args.url, block_ms=cfg.block_ms)
    c = Consumer(r, rb, args.url, keys, keys.tasks("src"), "g", consumer_name("hop", args.slot), cfg)
    dst = keys.traj("dst")
    stop = anyio.Event()

    async def handle(batch):
        if args.sleep:
            await anyio.sleep(args.sleep)
        return [[(dst, codec.encode("out", {"n": d.payload.meta["n"], "by": c.name,
                                            "deliveries": d.deliveries}))] for d in batch]

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_signals, stop)
        await serve(c, handle, stop, drain_timeout_s=args.drain_s)
        tg.cancel_scope.cancel()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("run")
    p.add_argument("slot", type=int)
    p.add_argument("--lease-ms", type=int, default=1000)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=20)
    p.add_argument("--max-deliveries", type=int, default=50)
    p.add_argument("--drain-s", type=float, default=30.0)
    logging.basicConfig(level=logging.WARNING)
    anyio.run(main, p.parse_args())
