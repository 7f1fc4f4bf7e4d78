"""Connections to Redis: URL handling, version check, error translation, backoff.

Every Redis client in Jet is made here, with pinned behaviour (RESP2 replies,
bytes not str, explicit socket timeouts) so reply shapes and timeouts never
depend on redis-py defaults. Blocking reads get their own client whose socket
timeout exceeds BLOCK (DESIGN.md delivery rule 7). Redis errors become
`jet.errors.QueueError`s here and nowhere else.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
from typing import Any, Awaitable, Callable, TypeVar
from urllib.parse import urlsplit, urlunsplit

import anyio
import redis.asyncio as aioredis
import redis.exceptions as rex
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from jet.errors import AuthError, ClusterError, ConnectError, QueueError, ServerVersionError, Stopped

log = logging.getLogger(__name__)

MIN_SERVER = (7, 0)
OP_TIMEOUT_S = 10.0  # socket timeout for ordinary (non-blocking) commands
ENV_URL = "JET_REDIS_URL"

T = TypeVar("T")


def redact(url: str) -> str:
    """`redis://user:secret@h:1/0` -> `redis://user:***@h:1/0` (safe to print)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    netloc = f"{user}:***@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def env_url() -> str | None:
    return os.environ.get(ENV_URL) or None


def make_client(url: str, *, block_ms: int | None = None, name: str | None = None,
                max_connections: int | None = None) -> aioredis.Redis:
    """A client for `url`. With `block_ms`, its socket timeout exceeds that BLOCK by 5 s.
    With `max_connections`, its pool holds that many connections and a command waits (up to the
    socket timeout) for a free one instead of failing with "Too many connections".

    TLS (`rediss://`), passwords and ACL users come from the URL; certificate
    options from the query string (`?ssl_ca_certs=...&ssl_cert_reqs=required`).
    """
    timeout = OP_TIMEOUT_S if block_ms is None else block_ms / 1000 + 5.0
    options: dict[str, Any] = dict(
        protocol=2,
        decode_responses=False,
        socket_timeout=timeout,
        socket_connect_timeout=5.0,
        # One quick retry for a dropped connection; longer outages are the
        # caller's backoff loop (`retry_forever`), which logs what happens.
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 1),
        client_name=name,
        health_check_interval=30,
    )
    try:
        if max_connections is None:
            return aioredis.Redis.from_url(url, **options)
        return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout, **options))
    except ValueError as e:
        raise ConnectError(f"bad Redis URL {redact(url)}: {e}") from None


def translate(e: BaseException, url: str) -> QueueError:
    """Map a redis-py exception onto Jet's tree, naming the (redacted) URL."""
    where = redact(url)
    if isinstance(e, rex.AuthenticationError) or "WRONGPASS" in str(e) or "NOAUTH" in str(e):
        return AuthError(f"authentication to Redis at {where} failed: {e}")
    text = str(e)
    if text.startswith(("MOVED ", "ASK ", "CROSSSLOT")) or isinstance(e, getattr(rex, "MovedError", ())):
        return ClusterError(f"Redis at {where} is a cluster node and answered {text[:80]!r}: use a "
                            f"redis+cluster:// URL so Jet talks to it with a cluster client")
    if isinstance(e, (rex.ConnectionError, rex.TimeoutError, OSError)):
        return ConnectError(f"cannot reach Redis at {where}: {e}")
    return QueueError(f"Redis at {where}: {e}")


@contextlib.contextmanager
def translated(url: str):
    """Translate redis errors raised inside the block."""
    try:
        yield
    except (rex.RedisError, OSError) as e:
        raise translate(e, url) from e


def parse_version(info: dict[Any, Any]) -> tuple[int, ...]:
    raw = info.get(b"redis_version") or info.get("redis_version") or b"0"
    if isinstance(raw, bytes):
        raw = raw.decode()
    return tuple(int(x) for x in str(raw).split(".")[:3] if x.isdigit())


async def connect(url: str, *, block_ms: int | None = None, name: str | None = None,
                  max_connections: int | None = None) -> aioredis.Redis:
    """Open a client, check that the server speaks the Redis >= 7.0 API, return it."""
    client = make_client(url, block_ms=block_ms, name=name, max_connections=max_connections)
    try:
        with translated(url):
            info = await client.info("server")
    except BaseException:
        await client.aclose()
        raise
    version = parse_version(info)
    if version < MIN_SERVER:
        await client.aclose()
        shown = ".".join(map(str, version)) or "unknown"
        raise ServerVersionError(
            f"Redis at {redact(url)} is version {shown}; Jet needs >= 7.0 "
            "(XAUTOCLAIM with deleted-id reporting)"
        )
    return client


async def retry_forever(
    fn: Callable[[], Awaitable[T]], *, url: str, what: str, max_delay: float = 30.0,
    stop: anyio.Event | None = None,
) -> T:
    """Run `fn` until it does not raise ConnectError, sleeping with jittered backoff.

    Long-running workers wrap their loop in this, so a Redis restart or network
    blip makes them wait and reconnect instead of dying. Refused credentials
    (`AuthError`) are not retried. With `stop`, the wait ends as soon as it is
    set: `Stopped` is raised, so a role stuck connecting still obeys SIGTERM.
    """
    delay = 0.2
    while True:
        if stop is not None and stop.is_set():
            raise Stopped(f"{what}: stopped before Redis at {redact(url)} answered")
        try:
            return await fn()
        except AuthError:
            raise
        except ConnectError as e:
            log.warning("%s: %s; retrying in %.1fs", what, e, delay)
            with anyio.move_on_after(delay * (0.5 + random.random())):
                if stop is not None:
                    await stop.wait()
                else:
                    await anyio.sleep(math.inf)
            delay = min(max_delay, delay * 2)
