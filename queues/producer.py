"""Producing to bounded streams: pipelined batches with backpressure, and safe trimming.

A stream is bounded by `maxlen`, but `PRODUCE` never drops: it adds what fits
and the producer waits (trimming consumed entries safely first) for the rest.
`safe_trim` never removes an entry still pending in, or not yet read by, any
group (docs/design.md, rule 4) except the best-effort ones
(`jet.keys.BEST_EFFORT_GROUPS`: shadow env workers, whose episodes are never
trained). With `dedup`, each message's id gets a
marker in the same Lua call, so a retried batch cannot add an entry twice; the
marker lives `marker_ttl_s` (default 10 minutes: a producer retries within
seconds), so memory stays at rate x TTL x ~90 B.
"""

from __future__ import annotations

import time
from typing import Mapping, Sequence

import anyio
import redis.asyncio as aioredis

from jet.errors import BackpressureTimeout
from jet.keys import BEST_EFFORT_GROUPS, Keys
from jet.queues import scripts
from jet.queues.connect import translated


async def safe_trim(r: aioredis.Redis, stream: str, url: str = "",
                    best_effort: tuple[str, ...] = BEST_EFFORT_GROUPS) -> int:
    """Trim entries every group has read and acked; returns how many were removed.

    Groups named in `best_effort` (shadow env workers) are not waited for: a
    stopped or SIGKILLed shadow worker must not hold the live pipeline back.
    """
    with translated(url):
        return int(await r.register_script(scripts.SAFE_TRIM)(keys=[stream], args=list(best_effort)))


class Producer:
    """Adds entries to one bounded stream. `send` returns once all are in."""

    def __init__(self, r: aioredis.Redis, url: str, keys: Keys, stream: str, *, maxlen: int = 100_000,
                 dedup: bool = False, marker_ttl_s: int = 600, batch: int = 100,
                 max_wait_s: float | None = None):
        self.r, self.url, self.keys, self.stream = r, url, keys, stream
        self.maxlen, self.batch, self.max_wait_s = maxlen, batch, max_wait_s
        self.ttl = marker_ttl_s if dedup else 0
        self._produce = r.register_script(scripts.PRODUCE)
        self.waited_s = 0.0  # total time spent blocked by backpressure

    async def send(self, entries: Sequence[Mapping[bytes, bytes]]) -> None:
        pending = list(entries)
        started_wait: float | None = None
        delay = 0.01
        while pending:
            chunk = pending[: self.batch]
            done = await self._send_chunk(chunk)
            pending = pending[done:]
            if done == len(chunk):
                started_wait, delay = None, 0.01
                continue
            # Full: make room by trimming what every group has consumed, else wait.
            if await safe_trim(self.r, self.stream, self.url):
                continue
            now = time.monotonic()
            started_wait = started_wait or now
            if self.max_wait_s is not None and now - started_wait > self.max_wait_s:
                raise BackpressureTimeout(
                    f"{self.keys.short(self.stream)} stayed full (maxlen {self.maxlen}) for {self.max_wait_s}s")
            await anyio.sleep(delay)
            self.waited_s += delay
            delay = min(1.0, delay * 2)

    async def _send_chunk(self, chunk: Sequence[Mapping[bytes, bytes]]) -> int:
        keys = [self.stream]
        argv: list = [self.maxlen, self.ttl, len(chunk)]
        for fields in chunk:
            if self.ttl:
                keys.append(self.keys.sent_marker(fields[b"i"].decode()))
            argv.append(len(fields))
            for kv in fields.items():
                argv += kv
        with translated(self.url):
            return int(await self._produce(keys=keys, args=argv))
