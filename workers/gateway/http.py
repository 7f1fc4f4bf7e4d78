"""The gateway's HTTP plumbing: admission limits, bodies, client disconnects, SSE, the uvicorn server.

What it is:
- `Limits` and `Limiter`, an ASGI middleware in front of the generating
  endpoints. It answers 413 for a body over `max_body` (Content-Length, or
  counted while it streams in) and 429 with Retry-After when `max_in_flight`
  requests are already being served or their bodies would hold more than
  `max_body_in_flight` bytes. The memory a gateway holds for requests is so
  bounded by the budgets, not by how many clients call at once: a burst is
  told to come back (the `openai` SDK honours Retry-After), never answered
  with a misleading 503 from an exhausted connection pool.
- `read_json`: the body, parsed (400 with the reason when it is not JSON).
- `watching`: run a block while watching the client's connection; the event
  it yields is set when the client disconnected (ASGI `http.disconnect`).
- `EventStream`: a server-sent-event response made of an opening (sent at
  once, before generation, so a client sees the stream begin), the rest (made
  once the completion exists), and a callback told whether every event went
  out with the client still connected. A disconnect after the last byte was
  handed to the socket is indistinguishable from delivery (TCP says no more).
- `serving`: the app on uvicorn, on a given or free port.

What it is not: OpenAI's formats (`gateway_openai`, `gateway_responses`) or the routes (`gateway`).
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

import anyio
import orjson

from jet.workers.gateway.chat import BadRequest, error_body

GRACE_S = 10.0  # on shutdown, seconds in-flight requests get to finish
DRAIN_MAX = 64 * 1024 * 1024  # bytes of a refused body read and dropped (so the client reads the answer)


@dataclass(frozen=True, slots=True)
class Limits:
    """What one gateway serves at once. Memory held for requests is about
    max_body_in_flight x (the parse and render blow-up) plus max_in_flight x the per-call state."""

    max_body: int = 16 * 1024 * 1024  # bytes of one request body (413 past it)
    max_in_flight: int = 256  # generating requests served at once (429 past it)
    max_body_in_flight: int = 64 * 1024 * 1024  # bytes of the bodies of those requests (429 past it)
    retry_after_s: int = 1  # what a 429 tells the client to wait

    def __post_init__(self):
        for name in ("max_body", "max_in_flight", "max_body_in_flight", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"gateway limits: {name} must be >= 1, got {getattr(self, name)}")

    @property
    def connections(self) -> int:
        """Redis connections a gateway's clients may need: one per request in flight, plus readers."""
        return self.max_in_flight + 16


async def _answer(send, status: int, message: str, kind: str, code: str | None, headers: dict | None = None):
    raw = orjson.dumps(error_body(message, kind, None, code))
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    head += [(k.lower().encode(), str(v).encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": raw, "more_body": False})


async def _drain(receive) -> None:
    """Read and drop what is left of a refused body (bounded), so the client gets to read the answer."""
    seen = 0
    while seen < DRAIN_MAX:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body"):
            return


class Limiter:
    """ASGI middleware: admission of the generating endpoints `paths` under `limits` (413 / 429)."""

    def __init__(self, app, limits: Limits, paths: Iterable[str]):
        self.app, self.limits, self.paths = app, limits, frozenset(paths)
        self.in_flight = self.body_bytes = 0
        self.refused = 0  # 429s answered (for logs and tests)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        lim = self.limits
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        size = int(length) if length is not None and length.isdigit() else None
        if size is not None and size > lim.max_body:
            await _drain(receive)
            return await _answer(send, 413, f"request body of {size} bytes is over the gateway's limit of "
                                 f"{lim.max_body} bytes", "invalid_request_error", "request_too_large")
        reserve = lim.max_body if size is None else size  # a body of unknown length may grow to max_body
        if self.in_flight >= lim.max_in_flight or self.body_bytes + reserve > lim.max_body_in_flight:
            self.refused += 1
            await _drain(receive)
            why = (f"{self.in_flight} requests in flight (limit {lim.max_in_flight})"
                   if self.in_flight >= lim.max_in_flight else
                   f"request bodies in flight would hold {self.body_bytes + reserve} bytes "
                   f"(limit {lim.max_body_in_flight})")
            return await _answer(send, 429, f"the gateway is busy: {why}; retry after {lim.retry_after_s}s",
                                 "rate_limit_error", "gateway_busy", {"Retry-After": lim.retry_after_s})
        self.in_flight += 1
        self.body_bytes += reserve
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            self.body_bytes -= reserve


async def read_json(request, max_body: int) -> Any:
    """The request body as JSON; a body streamed past `max_body` (no Content-Length) gets 413."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_body:
            raise TooLarge(f"request body over the gateway's limit of {max_body} bytes")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None


class TooLarge(BadRequest):
    """A body over the limit (HTTP 413)."""


@contextlib.asynccontextmanager
async def watching(receive) -> AsyncIterator[anyio.Event]:
    """Run the block while watching the client; the yielded event is set once it disconnected."""
    gone = anyio.Event()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()

    failure = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        try:
            yield gone
        except Exception as e:  # raised as itself below, not wrapped in the task group's ExceptionGroup
            failure = e
        finally:
            tg.cancel_scope.cancel()
    if failure is not None:
        raise failure


class EventStream:
    """An SSE response: `opening` at once, then `rest()` (awaited: it generates), then `done(delivered)`."""

    def __init__(self, opening: Iterable[bytes], rest: Callable[[], Awaitable[Iterable[bytes]]],
                 done: Callable[[bool], Awaitable[None]], headers: dict[str, str] | None = None):
        self.opening, self.rest, self.done, self.headers = opening, rest, done, headers or {}

    async def __call__(self, scope, receive, send) -> None:
        head = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                *((k.lower().encode(), v.encode()) for k, v in self.headers.items())]
        delivered = False
        async with watching(receive) as gone:
            await send({"type": "http.response.start", "status": 200, "headers": head})
            for event in self.opening:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            events = await self.rest()
            for event in events:
                if gone.is_set():
                    break
                await send({"type": "http.response.body", "body": event, "more_body": True})
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                delivered = not gone.is_set()
        await self.done(delivered)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # the process owns its signals: SIGTERM drains the whole worker
            yield

    return Server


@contextlib.asynccontextmanager
async def serving(app, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Serve `app` on host:port (0 = a free port) until the block exits; yields the base URL (.../v1)."""
    import uvicorn

    server = _server_class()(uvicorn.Config(app, lifespan="off", log_config=None, access_log=False,
                                            server_header=False, timeout_graceful_shutdown=GRACE_S,
                                            backlog=4096))
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)

    async def serve() -> None:
        with anyio.CancelScope(shield=True):  # shut down cleanly (bounded by GRACE_S) even when cancelled
            await server.serve(sockets=[sock])

    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        port = sock.getsockname()[1]
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve)
            with anyio.fail_after(30):
                while not server.started:
                    await anyio.sleep(0.01)
            try:
                yield f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
            finally:
                server.should_exit = True
    finally:
        sock.close()
