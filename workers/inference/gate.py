"""The gate between generation requests and weight loads of one backend.

What it is: a readers-writer lock with the writer first. Any number of requests
hold `request()` at once; `exclusive()` (a weight load) closes the gate to new
requests, waits until the requests inside have finished, runs alone, and opens
the gate again, letting in every request that waited. Policy: pause admission,
drain, load, resume. Nothing is dropped or aborted; a load waits at most for the
longest request in flight (bounded by max_tokens).

What it is not: a limit on concurrency (the worker's `max_inflight` is), or
thread-safe: it belongs to one event loop.

Invariant: while `exclusive()` runs, no `request()` is inside, so every
request runs from start to end under one set of weights.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

import anyio


class WeightGate:
    def __init__(self) -> None:
        self.inside = 0  # requests holding the gate
        self.waiting = 0  # requests held back by a load
        self.loading = False
        self._opened = anyio.Event()
        self._opened.set()
        self._empty = anyio.Event()
        self._empty.set()

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        self.waiting += 1
        try:
            while self.loading:
                await self._opened.wait()
        finally:
            self.waiting -= 1
        self.inside += 1
        if self.inside == 1:
            self._empty = anyio.Event()
        try:
            yield
        finally:
            self.inside -= 1
            if self.inside == 0:
                self._empty.set()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        while self.loading:  # one load at a time
            await self._opened.wait()
        self.loading = True
        self._opened = anyio.Event()
        try:
            await self._empty.wait()
            yield
        finally:
            self.loading = False
            self._opened.set()
