"""The standard consume loop: fetch -> handle -> commit, with a reaper, lease
renewal, reconnect-with-backoff and a graceful drain on SIGTERM.

Workers that handle a batch at a time (inference, benchmarks, tests) call
`serve`; workers with their own concurrency (env worker episodes) use the same
parts (`Consumer`, `Reaper`, `lease_keeper`) directly.
"""

from __future__ import annotations

import logging
import signal
import traceback
from typing import Awaitable, Callable, Sequence

import anyio

from jet.errors import ConnectError, QueueError
from jet.queues.connect import retry_forever
from jet.queues.consumer import Consumer, Delivery, Output
from jet.queues.reaper import Reaper

log = logging.getLogger(__name__)

Result = Sequence[Output] | BaseException
Handler = Callable[[list[Delivery]], Awaitable[Sequence[Result]]]


async def watch_signals(stop: anyio.Event) -> None:
    """Set `stop` on SIGTERM/SIGINT (drain); a second signal exits at once."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for sig in signals:
            if stop.is_set():
                raise SystemExit(128 + sig)
            log.info("received %s: draining", signal.Signals(sig).name)
            stop.set()


async def lease_keeper(c: Consumer, stop: anyio.Event) -> None:
    """Renew in-flight leases every lease/3 until `stop`."""
    period = max(0.05, c.cfg.lease_ms / 3000)
    while not stop.is_set():
        with anyio.move_on_after(period):
            await stop.wait()
        if c.inflight and not stop.is_set():
            try:
                lost = await c.renew()
            except ConnectError:
                continue
            if lost:
                log.warning("lease lost on %d entries (taken over after a stall)", len(lost))


async def reaper_loop(reaper: Reaper, stop: anyio.Event, every_s: float) -> None:
    from jet.queues.producer import safe_trim

    while not stop.is_set():
        try:
            await reaper.reap()
            await safe_trim(reaper.c.r, reaper.c.stream, reaper.c.url)
        except ConnectError:
            pass  # the main loop logs and reconnects
        except QueueError as e:
            if "NOGROUP" not in str(e):
                raise
        with anyio.move_on_after(every_s):
            await stop.wait()


async def serve(c: Consumer, handle: Handler, stop: anyio.Event, *, drain_timeout_s: float = 30.0,
                reap_every_s: float | None = None) -> None:
    """Run until `stop` is set, then drain: finish the batch in hand or release it."""
    await retry_forever(c.ensure_group, url=c.url, what=f"create group {c.group}")
    reaper = Reaper(c)
    every = reap_every_s if reap_every_s is not None else min(5.0, max(0.1, c.cfg.lease_ms / 2000))
    inner = anyio.Event()  # stops helpers once the main loop is done
    async with anyio.create_task_group() as tg:
        tg.start_soon(lease_keeper, c, inner)
        tg.start_soon(reaper_loop, reaper, inner, every)
        try:
            await _loop(c, handle, stop, drain_timeout_s)
        finally:
            inner.set()
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await _release_all(c)


async def _loop(c: Consumer, handle: Handler, stop: anyio.Event, drain_timeout_s: float) -> None:
    """Run the pipeline until `stop`; reconnect with backoff when the server goes away."""
    while not stop.is_set():
        try:
            await _pipeline(c, handle, stop, drain_timeout_s)
        except* ConnectError as eg:
            log.warning("%s; reconnecting", eg.exceptions[0])
            await anyio.sleep(0.5)
            c.restarted()  # what was not committed is still pending to us: re-read first
            await retry_forever(c.ensure_group, url=c.url, what="reconnect")
        except* QueueError as eg:
            if not all("NOGROUP" in str(e) for e in eg.exceptions):
                raise
            await c.ensure_group()  # the server lost its data: start the group again


async def _pipeline(c: Consumer, handle: Handler, stop: anyio.Event, drain_timeout_s: float) -> None:
    """A fetcher task reads (and decodes) up to two batches ahead while this task handles
    and commits: the client and the server work at the same time. On `stop` the fetcher
    ends and what it already fetched is still handled (drain); what a drain deadline
    cuts short stays in flight and is released by `serve`."""
    send, recv = anyio.create_memory_object_stream[list[Delivery]](1)
    drain = _Drain(stop, drain_timeout_s)

    async def fetcher() -> None:
        async with send:
            while not stop.is_set():
                batch = await c.fetch()
                if batch:
                    try:
                        await send.send(batch)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        return  # the handler side stopped; the batch stays in flight

    async with anyio.create_task_group() as tg:
        tg.start_soon(fetcher)
        async with recv:
            async for batch in recv:
                results = await _run_handler(batch, handle, drain)
                if results is None:  # drain deadline hit mid-batch
                    break
                await _finish(c, batch, results)


class _Drain:
    """One deadline for the whole drain, counted from the moment `stop` is set."""

    def __init__(self, stop: anyio.Event, timeout_s: float):
        self.stop, self.timeout_s, self.at = stop, timeout_s, None

    async def expired(self) -> None:
        await self.stop.wait()
        if self.at is None:
            self.at = anyio.current_time() + self.timeout_s
        await anyio.sleep_until(self.at)


async def _run_handler(batch: list[Delivery], handle: Handler, drain: _Drain) -> Sequence[Result] | None:
    """The handler's results, or None when the drain deadline cut it short."""
    results: Sequence[Result] | None = None
    with anyio.CancelScope() as scope:
        async def deadline() -> None:
            await drain.expired()
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(deadline)
            results = await handle(batch)
            tg.cancel_scope.cancel()
    return results


async def _finish(c: Consumer, batch: list[Delivery], results: Sequence[Result]) -> None:
    """Commit the successes atomically; record and release the failures."""
    await c.commit([(d, r) for d, r in zip(batch, results) if not isinstance(r, BaseException)])
    for d, r in zip(batch, results):
        if isinstance(r, BaseException):
            err = "".join(traceback.format_exception(r))
            log.warning("handler failed on %s: %s", d.entry_id, r)
            await c.fail(d, err)


async def _release_all(c: Consumer) -> None:
    """Drain: in-flight and reclaimed-but-unstarted entries go back for others to take."""
    try:
        if c.inflight:
            await c.release()
        if c.claimed:
            ids = [Delivery(c.stream, i, f, None, n) for i, f, n in c.claimed]  # type: ignore[arg-type]
            c.claimed = []
            await c.release(ids)
    except ConnectError:
        pass  # unreachable server: the lease expires and the reaper recovers them
