"""A consumer process for fault tests: moves `tasks:src` to `traj:dst` through the
consumer runtime's atomic commit. Run as
`python -m tests.queues.hop_worker URL RUN SLOT [--lease-ms N] [--sleep S] [--each N]`.

Batches by default (`serve_batches`, sleeping `--sleep` per batch); with `--each N`,
one handler call per message, N in flight (`serve_each`), each sleeping the
message's own `sleep` on its first delivery (else, and later, `--sleep`). It prints `start <n>` / `done <n>` lines
on stdout (flushed), so a test can act at a known point of the work; once connected it
creates $JET_READY_FILE (`jet.supervisor.mark_ready`), so a test knows SIGTERM now drains.
"""

from __future__ import annotations

import argparse
import logging

import anyio

from jet.keys import Keys
from jet.queues import codec
from jet.queues.consumer import Settings, consumer_name
from jet.queues.messages import Commit
from jet.queues.runtime import Runtime
from jet.supervisor import mark_ready, run_role


def say(*parts) -> None:
    print(*parts, flush=True)


def output(d, name: str) -> dict:
    return codec.encode("out", {"n": d.payload.meta["n"], "by": name, "deliveries": d.deliveries})


async def main(args, stop: anyio.Event) -> None:
    keys = Keys(args.run)
    cfg = Settings(lease_ms=args.lease_ms, block_ms=300, batch=args.batch, max_deliveries=args.max_deliveries)
    name, dst = consumer_name("hop", args.slot), keys.traj("dst")

    async def handle_batch(batch):
        say("start", *[d.payload.meta["n"] for d in batch])
        if args.sleep:
            await anyio.sleep(args.sleep)
        say("done", *[d.payload.meta["n"] for d in batch])
        return [[(dst, output(d, name))] for d in batch]

    async def handle_one(d):
        say("start", d.payload.meta["n"])
        await anyio.sleep(d.payload.meta.get("sleep", args.sleep) if d.deliveries == 1 else args.sleep)
        say("done", d.payload.meta["n"])
        return Commit([(dst, output(d, name))])

    async with Runtime(args.url, keys, keys.tasks("src"), "g", name, cfg, stop=stop) as rt:
        mark_ready()  # connected, signal handlers in place: a SIGTERM from now on drains
        if args.each:
            await rt.serve_each(handle_one, stop, concurrency=args.each, drain_timeout_s=args.drain_s)
        else:
            await rt.serve_batches(handle_batch, stop, drain_timeout_s=args.drain_s)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("run")
    p.add_argument("slot", type=int)
    p.add_argument("--lease-ms", type=int, default=1000)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=20)
    p.add_argument("--each", type=int, default=0)
    p.add_argument("--max-deliveries", type=int, default=50)
    p.add_argument("--drain-s", type=float, default=30.0)
    logging.basicConfig(level=logging.WARNING)
    parsed = p.parse_args()
    run_role(lambda stop: main(parsed, stop), "hop")
