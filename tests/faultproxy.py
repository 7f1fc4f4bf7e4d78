"""A TCP fault proxy for tests: sits between Jet's roles and Redis and breaks the network for real.

What it is: `FaultProxy(upstream_host, upstream_port)` (or `FaultProxy.to(url)`)
listens on a local port (`url_for(server_url)` is the Redis URL the roles get)
and forwards every connection to the server, on an event loop of its own (an anyio blocking portal, so a
synchronous test drives it). Faults, each applied to every connection at once:

- `cut()`: every open connection is reset (RST, both sides) at once, whatever
  it carries: a blocking read, a commit half sent, a reply half received;
  new connections are accepted as before;
- `latency(s)`: every chunk, both ways, is delivered `s` seconds after it
  arrived (order kept; `latency(0)` ends the spike);
- `blackhole()`: connections stay open and new ones are accepted, but no byte
  goes anywhere: what arrives is dropped, so a command sent now never runs or
  its reply never comes back. `heal()` ends it and resets every connection
  that dropped a byte, as TCP does to a connection whose retransmissions
  ran out (a stream with a hole in it is never delivered);
- the server going away (a restart): a connection whose upstream closes is
  closed, and one that cannot reach the server is refused (closed at once).

`heal()` also ends a latency spike. `stats` counts connections accepted,
connections reset by `cut` and by `heal`, and chunks dropped.

What it is not: a traffic shaper (no bandwidth limits, no partial loss) or a
Redis-aware proxy: it moves bytes and never parses them.
Why not a maintained tool: Toxiproxy, the usual one, is a server binary outside
the package index; its Python package is only a client for it.
"""

from __future__ import annotations

import contextlib
import math
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Self

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel

CHUNK = 65536
_GONE = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


@dataclass(eq=False)
class _Conn:
    client: anyio.abc.SocketStream
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    upstream: anyio.abc.SocketStream | None = None
    dropped: bool = False  # a byte was dropped in a blackhole: the stream has a hole, it must die


def _reset(stream: anyio.abc.SocketStream | None) -> None:
    """Make the coming close an RST instead of a FIN (SO_LINGER 0): the peer sees 'connection reset'."""
    if stream is None:
        return
    with contextlib.suppress(OSError, anyio.TypedAttributeLookupError):
        sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class FaultProxy:
    """`with FaultProxy(host, port) as proxy:` roles connect to `proxy.url`; the test calls the faults."""

    def __init__(self, upstream_host: str, upstream_port: int, *, host: str = "127.0.0.1", port: int = 0):
        self.upstream = (upstream_host, upstream_port)
        self.host, self.port = host, port
        self.conns: set[_Conn] = set()
        self.delay = 0.0  # seconds added to every chunk
        self.holed = False  # in a blackhole
        self.stats: Counter[str] = Counter()
        self._portal_cm = None

    @classmethod
    def to(cls, url: str, **kw) -> FaultProxy:
        """A proxy in front of the server of a `redis://host:port/...` URL."""
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or 6379, **kw)

    def url_for(self, url: str) -> str:
        """`url` (the server's) with the proxy's address in place of the server's: password and db kept."""
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(url)
        auth = parts.netloc.rpartition("@")[0]
        netloc = f"{auth}@{self.host}:{self.port}" if auth else f"{self.host}:{self.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))

    # -- lifecycle (sync) ---------------------------------------------------------------------------

    def __enter__(self) -> Self:
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        portal = self._portal_cm.__enter__()
        try:
            self._listener = portal.call(self._listen)
            self.port = self._listener.extra(anyio.abc.SocketAttribute.local_port)
            self._serving = portal.start_task_soon(self._serve)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self.portal = portal
        return self

    def __exit__(self, *exc) -> None:
        if self._portal_cm is None:
            return
        try:
            self._serving.cancel()
            self.portal.call(self._close_all)
        finally:
            cm, self._portal_cm = self._portal_cm, None
            cm.__exit__(None, None, None)

    # -- faults (sync, from the test's thread) ------------------------------------------------------

    @property
    def open_connections(self) -> int:
        """Connections open now (a cut right after the server restarted may find none yet)."""
        return len(self.conns)

    def cut(self) -> int:
        """Reset every open connection now; returns how many there were."""
        return self.portal.call(self._cut)

    def latency(self, seconds: float) -> None:
        """Deliver every chunk `seconds` after it arrives, from now on (0: no added delay)."""
        self.portal.call(setattr, self, "delay", float(seconds))

    def blackhole(self) -> None:
        """From now on, drop every byte both ways (connections stay open, new ones are accepted)."""
        self.portal.call(setattr, self, "holed", True)

    def heal(self) -> int:
        """End a blackhole and a latency spike; reset the connections that dropped a byte (how many)."""
        return self.portal.call(self._heal)

    def hold(self, seconds: float) -> None:
        """A blackhole of `seconds`, then `heal()` (blocks the calling thread meanwhile)."""
        self.blackhole()
        time.sleep(seconds)
        self.heal()

    # -- the loop's side ----------------------------------------------------------------------------

    async def _listen(self):
        return await anyio.create_tcp_listener(local_host=self.host, local_port=self.port, reuse_port=False)

    async def _serve(self) -> None:
        async with self._listener:
            await self._listener.serve(self._handle)

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        conn = _Conn(client)
        self.conns.add(conn)
        self.stats["accepted"] += 1
        try:
            with conn.scope:
                try:
                    conn.upstream = await anyio.connect_tcp(*self.upstream)
                except OSError:
                    self.stats["refused"] += 1  # the server is down: the client sees its connection closed
                    return
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._pump, conn, client, conn.upstream)
                    tg.start_soon(self._pump, conn, conn.upstream, client)
        except Exception:  # noqa: BLE001 - one connection's end must never stop the listener
            self.stats["errors"] += 1
        finally:
            self.conns.discard(conn)
            with anyio.CancelScope(shield=True):
                for s in (conn.upstream, client):
                    if s is not None:
                        with contextlib.suppress(Exception):
                            await s.aclose()

    async def _pump(self, conn: _Conn, src: anyio.abc.SocketStream, dst: anyio.abc.SocketStream) -> None:
        """Bytes from `src` to `dst`, each chunk held for the delay in force when it arrived (order kept).
        Either side ending or failing ends the whole connection."""
        send, recv = anyio.create_memory_object_stream[tuple[float, bytes]](math.inf)

        async def writer() -> None:
            with contextlib.suppress(*_GONE):
                async with recv:
                    async for due, data in recv:
                        wait = due - anyio.current_time()
                        if wait > 0:
                            await anyio.sleep(wait)
                        if self.holed:  # it fell into a blackhole while it waited
                            conn.dropped = True
                            self.stats["dropped"] += 1
                            continue
                        await dst.send(data)
            conn.scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(writer)
            with contextlib.suppress(*_GONE):
                async with send:
                    while True:
                        data = await src.receive(CHUNK)
                        if self.holed:
                            conn.dropped = True
                            self.stats["dropped"] += 1
                            continue
                        send.send_nowait((anyio.current_time() + self.delay, data))
            conn.scope.cancel()

    async def _reset_all(self, conns: list, counter: str) -> int:
        """Reset both sides of each of `conns` (an RST to client and server) and count them in `counter`."""
        for conn in conns:
            _reset(conn.client)
            _reset(conn.upstream)
            conn.scope.cancel()
        self.stats[counter] += len(conns)
        await anyio.lowlevel.checkpoint()
        return len(conns)

    async def _cut(self) -> int:
        return await self._reset_all(list(self.conns), "cut")

    async def _heal(self) -> int:
        self.holed, self.delay = False, 0.0
        return await self._reset_all([c for c in self.conns if c.dropped], "reset_after_blackhole")

    async def _close_all(self) -> None:
        for conn in list(self.conns):
            conn.scope.cancel()
        await anyio.lowlevel.checkpoint()
