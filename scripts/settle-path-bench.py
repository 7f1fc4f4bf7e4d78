"""What committing a batch costs the client, Redis left out: a batch of 200 decoded 100 B entries,
each forwarded to one output stream, settled 2,000 times with the Lua call replaced by a stub
that answers "done" for every input (so packing into RESP is not counted either), best of 3.

It times the path a batch hop takes from handler results to the script's arguments: the
runtime's outcome values and `Runtime.settle` + `Consumer.settle` in this checkout, or
`Consumer.commit` in a checkout from before the consumer runtime (314f424 and older). Run it
with two checkouts' interpreters back to back to compare them (the README's Queue throughput
section does):

    .venv/bin/python scripts/settle-path-bench.py LABEL
"""

import sys
import time

import anyio
import redis.asyncio as redis

from jet.bench.queue import entries
from jet.keys import Keys
from jet.queues import codec
from jet.queues.consumer import Consumer, Settings

try:
    from jet.queues.messages import Delivery
    from jet.queues.runtime import Runtime, _batch_outcomes
except ImportError:  # before the consumer runtime: results went to Consumer.commit as they were
    from jet.queues.consumer import Delivery

    Runtime = None

BATCH, LOOPS = 200, 2_000


async def main(label: str) -> None:
    keys = Keys("settle-bench")
    client = redis.Redis()  # never connected: the one call that would reach Redis is replaced
    c = Consumer(client, client, "redis://stub", keys, keys.tasks("bench"), "g", "c", Settings(batch=BATCH))
    ds = [Delivery(c.stream, f"1-{i}", f, codec.decode(f)) for i, f in enumerate(entries("100B", BATCH))]
    out = keys.traj("bench")

    async def stub(script, keys, args):
        return [1] * len(ds)

    c._evalsha = stub
    if Runtime is not None:
        rt = Runtime("redis://stub", keys, c.stream, "g", "c")
        rt.c = c
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(LOOPS):
            results = [[(out, d.fields)] for d in ds]  # what a batch handler returns
            c.inflight.update((d.entry_id, d) for d in ds)
            if Runtime is not None:  # exactly what Runtime.serve_batches does with them
                await rt.settle(_batch_outcomes(ds, results))
            else:
                await c.commit(list(zip(ds, results)))
        best = min(best, time.perf_counter() - t)
    print(f"{label}: {best / LOOPS / BATCH * 1e6:.2f} us per message from handler results to settle arguments "
          f"(batch {BATCH}, Lua call stubbed)")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else "this checkout")
