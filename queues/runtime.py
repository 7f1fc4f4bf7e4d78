"""The consumer runtime: the one consume loop of Jet, which every consuming role runs.

What it is: `Runtime` owns a role's connections, its `Consumer`, the lease
keeper, the reaper (and safe trimming of the stream it reads), reconnects with
backoff, NOGROUP recovery, the drain on `stop` and, given a `role`, the worker's
heartbeat in the registry `jet dash` shows (jet.queues.registry). A role hands it a handler and
says how much concurrency it wants:

- `serve_each(handler, stop, concurrency=N)`: up to N handler calls in flight,
  each outcome committed as soon as it finishes (env worker episodes, the
  study worker's runs, continuous-batching inference);
- `serve_batches(handler, stop)`: a fetcher reads up to two batches ahead while
  the handler works on one (handlers that are cheap per message; the queue
  benchmark's hop);
- pull: `fetch()` and `settle()`, for a role that holds entries on its own
  terms (the trainer keeps trajectories until a checkpoint covers them).

Handler outcomes are values (`Commit`, `Release`, `Dead`, `Drop`: see
jet.queues.messages); an exception in a handler is a `Release` with its
traceback, which becomes the dead-letter reason if the entry dies. A committer
task settles what finished while the previous Lua call ran in the next one, so
each message is committed one round trip after it finishes and throughput grows
with load. A full output stream makes its commit wait, atomically (the SETTLE
script checks room before it acks), while the lease keeper keeps the entry.

Invariants: every delivery a handler gets is settled exactly once by the
runtime, or released when the serving call returns (drain deadline passed,
handler cancelled); entries in flight are renewed every lease/3 until then; the
connection may drop at any moment: every operation is retried with backoff, and
the Lua steps are safe to re-run. Connecting gives up only when `stop` is set
(`jet.errors.Stopped`), so a role that cannot reach its server still obeys SIGTERM.

What it is not: a process manager (`jet.supervisor`) or a producer (`jet.queues.producer`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import traceback
from typing import Any, Awaitable, Callable, Sequence

import anyio
import anyio.lowlevel

from jet.errors import ConnectError, QueueError, is_fatal
from jet.keys import BEST_EFFORT_GROUPS, Keys
from jet.queues.connect import connect, retry_forever
from jet.queues.consumer import Consumer, Settings
from jet.queues.messages import Commit, Dead, Delivery, Drop, Outcome, Release
from jet.queues.producer import safe_trim
from jet.queues.reaper import Reaper

__all__ = ["Runtime", "Commit", "Release", "Dead", "Drop", "Outcome", "Delivery", "Settings"]

log = logging.getLogger(__name__)

EachHandler = Callable[[Delivery], Awaitable[Outcome]]
BatchHandler = Callable[[list[Delivery]], Awaitable[Sequence[Any]]]


class Runtime:
    """`async with Runtime(url, keys, stream, group, name, settings) as rt:` then serve or pull."""

    def __init__(self, url: str, keys: Keys, stream: str, group: str, name: str,
                 settings: Settings | None = None, *, start: str = "0", stop: anyio.Event | None = None,
                 best_effort: tuple[str, ...] = BEST_EFFORT_GROUPS, role: str | None = None,
                 beat: Callable[[], dict] | None = None):
        self.url, self.keys, self.stream, self.group, self.name = url, keys, stream, group, name
        self.settings = settings or Settings()
        self.start, self.stop, self.best_effort = start, stop, best_effort
        self.role, self.beat = role, beat  # with `role`: heartbeats in the worker registry (jet dash)
        self.c: Consumer | None = None
        self.reaper: Reaper | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._done: anyio.Event | None = None  # set when the runtime closes: helpers end (made in its loop)
        self.failure: BaseException | None = None  # what killed a helper (lease keeper, reaper)
        self._room = lambda: self.settings.batch * 2  # entries the reaper may claim for us now

    @property
    def client(self):
        """The command client (wrap calls in `jet.queues.connect.translated`)."""
        return self.c.r

    @property
    def inflight(self) -> dict[str, Delivery]:
        return self.c.inflight

    def check(self) -> None:
        """Raise what stopped the helpers, if anything did (for callers outside the event loop);
        a fatal error as it is, so the role still exits with EXIT_FATAL."""
        if is_fatal(self.failure):
            raise self.failure
        if self.failure is not None:
            raise QueueError(f"the consumer runtime of {self.name} stopped: {self.failure}") from self.failure

    # -- lifecycle -------------------------------------------------------------

    async def __aenter__(self) -> "Runtime":
        self._done = anyio.Event()
        stack = contextlib.AsyncExitStack()
        await stack.__aenter__()
        try:
            r = await self._retry(lambda: connect(self.url, name=self.name), "connect", stoppable=True)
            stack.push_async_callback(r.aclose)
            rb = await self._retry(lambda: connect(self.url, block_ms=self.settings.block_ms, name=self.name),
                                   "connect", stoppable=True)
            stack.push_async_callback(rb.aclose)
            self.c = Consumer(r, rb, self.url, self.keys, self.stream, self.group, self.name, self.settings)
            self.reaper = Reaper(self.c, room=lambda: self._room())
            await self._retry(lambda: self.c.ensure_group(self.start), f"create group {self.group}", stoppable=True)
            tg = await stack.enter_async_context(anyio.create_task_group())
            stack.push_async_callback(self._close)
            tg.start_soon(self._lease_keeper)
            tg.start_soon(self._maintain)
            if self.role:
                tg.start_soon(self._heartbeat)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def __aexit__(self, *exc) -> bool | None:
        return await self._stack.__aexit__(*exc)

    async def _close(self) -> None:
        """Stop the helpers and give back whatever is still in flight (bounded, shielded)."""
        self._done.set()
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await self.release_all()

    async def release_all(self) -> None:
        """Release every entry in flight or claimed but not yet handed out (the drain's last step)."""
        try:
            if self.c.inflight:
                await self.c.release()
            if self.c.claimed:
                await self.c.release_claimed()
        except ConnectError:
            pass  # unreachable: the leases expire and a reaper hands them out again

    # -- pull ------------------------------------------------------------------

    async def fetch(self, count: int | None = None) -> list[Delivery]:
        """Up to `count` deliveries (own pending, reclaimed, new; blocks at most block_ms).

        A dropped connection or a lost group is handled here (backoff, reconnect,
        group recreated, own pending entries re-read first); the call then returns []."""
        try:
            return await self.c.fetch(count)
        except ConnectError as e:
            log.warning("%s; reconnecting", e)
        except QueueError as e:
            if "NOGROUP" not in str(e):
                raise
            log.warning("%s: the group %s is gone (server data lost?); creating it again",
                        self.keys.short(self.stream), self.group)
        await self._retry(lambda: self.c.ensure_group(self.start), "reconnect", stoppable=True)
        self.c.restarted()
        return []

    async def settle(self, items: Sequence[tuple[Delivery, Outcome]]) -> None:
        """Apply each outcome. Commits, dead letters and drops go in one Lua call; inputs whose output
        stream is full wait (trimming consumed entries first); releases record their error."""
        releases = [(d, o) for d, o in items if o.__class__ is Release]
        pending = [(d, o) for d, o in items if o.__class__ is not Release] if releases else items
        delay = 0.01
        while pending:
            res = await self._retry(lambda: self.c.settle(pending), "settle")
            pending = [item for item, r in zip(pending, res) if r == -1] if -1 in res else ()
            if pending and not await self._make_room(pending):
                await anyio.sleep(delay)
                delay = min(1.0, delay * 2)
        for d, o in releases:
            if o.error:
                log.warning("%s %s released: %s", self.keys.short(self.stream), d.entry_id,
                            o.error.strip().splitlines()[-1][:200])
                await self._retry(lambda: self.c.fail(d, o.error), "release")
            else:
                await self._retry(lambda: self.c.release([d]), "release")

    async def ack_known(self, refs: Sequence[tuple[str, str]]) -> None:
        """Commit (entry id, message id) pairs known from elsewhere (a checkpoint's ledger) with
        no outputs: acked with their markers; ones no longer pending are left alone."""
        for i in range(0, len(refs), 500):
            chunk = [(Delivery.known(self.stream, e, m), Commit()) for e, m in refs[i:i + 500]]
            await self.settle(chunk)

    async def _make_room(self, pending: Sequence[tuple[Delivery, Outcome]]) -> bool:
        """Trim what every group consumed from the full output streams; True if anything went."""
        full = {k for _, o in pending if isinstance(o, Commit) for k, _ in o.outputs if k != self.stream}
        removed = 0
        for key in full:
            removed += await self._retry(lambda: safe_trim(self.c.r, key, self.url, self.best_effort), "trim")
        return removed > 0

    # -- push: one handler call per message ---------------------------------------

    async def serve_each(self, handler: EachHandler, stop: anyio.Event, *, concurrency: int,
                         drain_timeout_s: float = 30.0) -> None:
        """Run `handler` on up to `concurrency` messages at once until `stop`, then drain: running
        calls get `drain_timeout_s` to finish (their commits included); the rest are released, and so
        is a call that finishes after the deadline anyway (in a shielded step): its outcome is dropped."""
        send, recv = anyio.create_memory_object_stream[tuple[Delivery, Outcome]](math.inf)
        running: set[str] = set()
        freed = anyio.Event()

        async def one(d: Delivery) -> None:
            try:
                outcome = await _outcome_of(handler, d)
                # A call that finishes in a shielded step after the drain deadline ended the committer
                # finds the stream closed: its outcome is not committed, and its entry, still in
                # flight, is released below (redelivered: nothing acknowledged is lost).
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    send.send_nowait((d, outcome))
            finally:
                running.discard(d.entry_id)
                freed.set()

        self._room = lambda: concurrency - len(running)  # a busy consumer leaves a dead one's work to others

        async def wait_freed() -> None:
            nonlocal freed
            with anyio.move_on_after(0.5):
                await freed.wait()
            freed = anyio.Event()

        with anyio.CancelScope() as outer:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_drain_deadline, stop, drain_timeout_s, outer)
                committed = anyio.Event()
                tg.start_soon(self._committer, recv, committed)
                async with send, anyio.create_task_group() as work:
                    while not stop.is_set():
                        if len(running) >= concurrency:
                            await wait_freed()
                            continue
                        for d in await self.fetch(concurrency - len(running)):
                            if d.entry_id not in running:
                                running.add(d.entry_id)
                                work.start_soon(one, d)
                    while running:  # the drain: running calls finish (or the deadline cancels them)
                        await wait_freed()
                await committed.wait()  # every finished call settled
                tg.cancel_scope.cancel()
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await self.release_all()

    async def _committer(self, recv, done: anyio.Event) -> None:
        """Settle finished messages: whatever finished during the last call goes in the next one."""
        async with recv:
            async for first in recv:
                batch = [first]
                with contextlib.suppress(anyio.WouldBlock, anyio.EndOfStream):  # nothing more now / ever
                    while len(batch) < 500:
                        batch.append(recv.receive_nowait())
                await self.settle(batch)
        done.set()

    # -- push: batches ------------------------------------------------------------

    async def serve_batches(self, handler: BatchHandler, stop: anyio.Event, *,
                            drain_timeout_s: float = 30.0) -> None:
        """Run `handler` on batches of up to `settings.batch` until `stop`, then drain. A fetcher task
        reads up to two batches ahead while this task handles and settles: the client and the server
        work at the same time. The handler returns one result per delivery: an Outcome, a list of
        outputs (= Commit) or an exception (= Release with its traceback)."""
        send, recv = anyio.create_memory_object_stream[list[Delivery]](1)

        async def fetcher() -> None:
            async with send:
                while not stop.is_set():
                    batch = await self.fetch()
                    if batch:
                        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                            await send.send(batch)

        with anyio.CancelScope() as outer:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_drain_deadline, stop, drain_timeout_s, outer)
                tg.start_soon(fetcher)
                async with recv:
                    async for batch in recv:
                        # Let the fetcher send its next read before this batch's work and commit:
                        # the server answers that read while the client handles, and the client
                        # decodes the answer while the server runs the commit (a fifth more
                        # throughput at 100 B in `jet bench queue`).
                        await anyio.lowlevel.checkpoint()
                        await self.settle(_batch_outcomes(batch, await handler(batch)))
                tg.cancel_scope.cancel()
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await self.release_all()

    # -- helpers --------------------------------------------------------------------

    async def _retry(self, fn, what: str, *, stoppable: bool = False):
        """`fn()` retried on ConnectError with backoff; with `stoppable`, gives up once `stop` is set."""
        return await retry_forever(fn, url=self.url, what=f"{self.name}: {what}",
                                   stop=self.stop if stoppable else None)

    async def _lease_keeper(self) -> None:
        """Renew in-flight leases every lease/3 until the runtime closes."""
        period = max(0.05, self.settings.lease_ms / 3000)
        while not self._done.is_set():
            with anyio.move_on_after(period):
                await self._done.wait()
            if (self.c.inflight or self.c.claimed) and not self._done.is_set():
                try:
                    lost = await self.c.renew()
                except ConnectError:
                    continue
                if lost:
                    log.warning("lease lost on %d entries (taken over after a stall)", len(lost))

    async def _heartbeat(self) -> None:
        """Beat in the worker registry (role, host, what `beat()` adds) until the runtime closes."""
        from jet.queues.registry import EVERY_S, beat

        while not self._done.is_set():
            try:
                await beat(self.c.r, self.keys, self.name, self.role, url=self.url,
                           stream=self.keys.short(self.stream), **(self.beat() if self.beat else {}))
            except QueueError as e:
                log.debug("heartbeat of %s skipped: %s", self.name, e)
            with anyio.move_on_after(EVERY_S):
                await self._done.wait()

    async def _maintain(self) -> None:
        """Reclaim idle entries of crashed consumers, and trim what every group consumed."""
        every = min(5.0, max(0.1, self.settings.lease_ms / 2000))
        while not self._done.is_set():
            try:
                await self.reaper.reap()
                await safe_trim(self.c.r, self.stream, self.url, self.best_effort)
            except ConnectError:
                pass  # fetch and settle reconnect; the next pass tries again
            except QueueError as e:
                if "NOGROUP" not in str(e):
                    self.failure = e
                    raise
            with anyio.move_on_after(every):
                await self._done.wait()


async def _outcome_of(handler: EachHandler, d: Delivery) -> Outcome:
    try:
        return _as_outcome(await handler(d))
    except Exception as e:  # noqa: BLE001 - a handler failure is the message's, not the worker's
        return _as_outcome(e)


_OUTCOMES = (Commit, Release, Dead, Drop)


def _batch_outcomes(batch: list[Delivery], results: Sequence[Any]) -> list[tuple[Delivery, Outcome]]:
    """A batch handler's results, one per delivery, paired with their deliveries as outcomes."""
    if len(results) != len(batch):
        raise QueueError(f"batch handler returned {len(results)} results for {len(batch)}")
    return [(d, _as_outcome(r)) for d, r in zip(batch, results)]


def _as_outcome(result: Any) -> Outcome:
    cls = result.__class__  # exact classes first: this runs once per message of a batch hop
    if cls is list or cls is tuple:
        return Commit(result)
    if cls in _OUTCOMES or isinstance(result, _OUTCOMES):
        return result
    if isinstance(result, BaseException):
        return Release("".join(traceback.format_exception(result)))
    if isinstance(result, (list, tuple)):
        return Commit(result)
    return Release(f"handler returned {result!r}, not an outcome")


async def _drain_deadline(stop: anyio.Event, timeout_s: float, scope: anyio.CancelScope) -> None:
    """One deadline for the whole drain, counted from the moment `stop` is set."""
    await stop.wait()
    await anyio.sleep(timeout_s)
    log.warning("drain deadline of %.0fs passed: releasing what is still in flight", timeout_s)
    scope.cancel()
