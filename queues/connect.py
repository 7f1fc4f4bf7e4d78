"""Connections to Redis: URL handling, version check, error translation, backoff.

Every Redis client in Jet is made here, with pinned behaviour (RESP2 replies,
bytes not str, explicit socket timeouts) so reply shapes and timeouts never
depend on redis-py defaults. Blocking reads get their own client whose socket
timeout exceeds BLOCK (docs/design.md, rule 7). Redis errors become
`jet.errors.QueueError`s here and nowhere else.

URLs: `redis://` and `rediss://` (TLS) name one server; `redis+cluster://` and
`rediss+cluster://` name any node of a Redis Cluster and get redis-py's
`RedisCluster` client, which follows MOVED/ASK and sends each command to the
primary of its key's slot (every key of a run shares its hash tag, so a run
lives on one primary). A plain URL that reaches a cluster node works only while
the run's slot is on that node: `connect` warns, and the MOVED a command then
gets is a fatal `ClusterError` naming the fix, never a retry loop.
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
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from jet.errors import (
    AuthError,
    ClusterError,
    ConfigError,
    ConnectError,
    QueueError,
    ServerError,
    ServerVersionError,
    Stopped,
)

log = logging.getLogger(__name__)

MIN_SERVER = (7, 0)
OP_TIMEOUT_S = 10.0  # socket timeout for ordinary (non-blocking) commands
ENV_URL = "JET_REDIS_URL"
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}  # -> the scheme of one node

T = TypeVar("T")
Client = aioredis.Redis | RedisCluster


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


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme.lower() in CLUSTER_SCHEMES


def is_cluster(client: Any) -> bool:
    """True for a `RedisCluster` client (commands are routed by key slot; no raw connections)."""
    return isinstance(client, RedisCluster)


def node_url(url: str) -> str:
    """The same URL with the scheme of one node: `redis+cluster://h:1` -> `redis://h:1`."""
    parts = urlsplit(url)
    scheme = CLUSTER_SCHEMES.get(parts.scheme.lower(), parts.scheme)
    return urlunsplit((scheme, parts.netloc, parts.path, parts.query, parts.fragment))


def make_client(url: str, *, block_ms: int | None = None, name: str | None = None,
                max_connections: int | None = None) -> Client:
    """A client for `url`. With `block_ms`, its socket timeout exceeds that BLOCK by 5 s.
    With `max_connections`, its pool holds that many connections and a command waits (up to the
    socket timeout) for a free one instead of failing with "Too many connections" (on a cluster:
    that many per node).

    TLS (`rediss://`), passwords and ACL users come from the URL; certificate
    options from the query string (`?ssl_ca_certs=...&ssl_cert_reqs=required`).
    A `+cluster` scheme gives a `RedisCluster` with the same options on every node.
    A malformed URL is a `ConfigError`: no retry can fix it.
    """
    timeout = OP_TIMEOUT_S if block_ms is None else block_ms / 1000 + 5.0
    opts = dict(
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
        if is_cluster_url(url):
            extra = {"max_connections": max_connections} if max_connections else {}
            return RedisCluster.from_url(node_url(url), **opts, **extra)
        if max_connections is None:
            return aioredis.Redis.from_url(url, **opts)
        return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout, **opts))
    except (ValueError, rex.RedisClusterException) as e:
        raise ConfigError(f"bad Redis URL {redact(url)}: {e} (schemes: redis://, rediss://, unix://, "
                          "redis+cluster://, rediss+cluster://)") from None


def translate(e: BaseException, url: str) -> QueueError:
    """Map a redis-py exception onto Jet's tree, naming the (redacted) URL.

    Fatal (`jet.errors.is_fatal`: the role stops and `jet up` says why) for what no retry can
    fix: refused credentials or ACL permissions, MOVED/ASK to a client that cannot follow them,
    keys of one step in several slots, a script lost right after loading it, a server that does
    not speak RESP. Retried (`ConnectError`) for what passes: a node down, a cluster failing over."""
    where = redact(url)
    text = str(e)
    if isinstance(e, rex.RedisClusterException):  # raised by the cluster client itself, not a server
        return _cluster_exception(e, text, url, where)
    if isinstance(e, rex.AuthenticationError) or "WRONGPASS" in text or "NOAUTH" in text:
        return AuthError(f"authentication to Redis at {where} failed: {e}")
    if isinstance(e, rex.NoPermissionError) or text.startswith("NOPERM"):
        return AuthError(f"Redis at {where} refused a command for this ACL user: {e}")
    if isinstance(e, rex.AskError):  # MovedError is one too
        kind = "MOVED" if isinstance(e, rex.MovedError) else "ASK"
        return ClusterError(f"Redis at {where} is a node of a Redis Cluster and answered {kind} {text[:60]}: "
                            f"the run's hash slot lives on another node. Use "
                            f"{node_url(url).split('://')[0]}+cluster://... so Jet uses a cluster client")
    if isinstance(e, rex.ClusterCrossSlotError) or text.startswith("CROSSSLOT"):
        return ClusterError(f"Redis at {where}: keys of one atomic step span several hash slots: {e}")
    if isinstance(e, (rex.ClusterDownError, rex.TryAgainError)):
        return ConnectError(f"Redis Cluster at {where} is not serving every slot right now: {e}")
    if isinstance(e, rex.NoScriptError):
        return ServerError(f"Redis at {where} answered NOSCRIPT right after loading the script: it is not "
                           "one server (a load balancer over several?); point Jet at the server itself")
    if isinstance(e, rex.InvalidResponse) or "Protocol error" in text or "protocol error" in text:
        return ServerError(f"{where} does not answer like a Redis server: {e}")
    if isinstance(e, (rex.ConnectionError, rex.TimeoutError, OSError)):
        return ConnectError(f"cannot reach Redis at {where}: {e}")
    return QueueError(f"Redis at {where}: {e}")


def _cluster_exception(e: BaseException, text: str, url: str, where: str) -> QueueError:
    """The cluster client's own exceptions: judged by what they say, or by the error behind them."""
    if "not enabled" in text:
        return ClusterError(f"Redis at {where} is not a cluster (cluster mode is off): use a plain "
                            f"{node_url(url).split('://')[0]}:// URL for it")
    if isinstance(e, rex.CrossSlotTransactionError) or "same key slot" in text or "same slot" in text:
        return ClusterError(f"Redis at {where}: keys of one atomic step span several hash slots: {e}")
    cause = e.__cause__
    if isinstance(cause, (rex.RedisError, rex.RedisClusterException, OSError)):
        judged = translate(cause, url)  # "cannot be connected: <why>": the why decides
        if type(judged) is not QueueError:
            return judged
    if isinstance(e, rex.SlotNotCoveredError) or "cannot be connected" in text or "not covered" in text:
        return ConnectError(f"Redis Cluster at {where} is not serving every slot right now: {e}")
    return QueueError(f"Redis Cluster at {where}: {e}")


def _closed_under_a_command(e: BaseException) -> bool:
    """redis-py 8.1 lets a connection closed while a command used it (a peer reset, or the cluster
    client closing every connection on CLUSTERDOWN while other tasks run commands) surface as an
    AttributeError/TypeError from its own connection code, not a ConnectionError
    (redis/redis-py#4287). Only those count: the same errors anywhere else are bugs, raised as is."""
    if not isinstance(e, (AttributeError, TypeError)):
        return False
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(os.path.join("redis", "asyncio", "connection.py")):
            return True
        tb = tb.tb_next
    return False


@contextlib.contextmanager
def translated(url: str):
    """Translate redis errors raised inside the block."""
    try:
        yield
    except (rex.RedisError, rex.RedisClusterException, OSError) as e:
        raise translate(e, url) from e
    except (AttributeError, TypeError) as e:
        if not _closed_under_a_command(e):
            raise
        raise ConnectError(f"connection to Redis at {redact(url)} closed under a command: {e!r}") from e


def parse_version(info: dict[Any, Any]) -> tuple[int, ...]:
    raw = info.get(b"redis_version") or info.get("redis_version") or b"0"
    if isinstance(raw, bytes):
        raw = raw.decode()
    return tuple(int(x) for x in str(raw).split(".")[:3] if x.isdigit())


def _mode(info: dict[Any, Any]) -> str:
    raw = next((info.get(k) for k in (b"server_mode", "server_mode", b"redis_mode", "redis_mode") if info.get(k)), b"")
    return raw.decode() if isinstance(raw, bytes) else str(raw)


async def connect(url: str, *, block_ms: int | None = None, name: str | None = None,
                  max_connections: int | None = None) -> Client:
    """Open a client, check that the server (every primary of a cluster) speaks the Redis >= 7.0
    API, return it. A plain URL to a cluster node works while the run's slot is on that node:
    warned about here; the MOVED a command gets otherwise is a fatal ClusterError."""
    client = make_client(url, block_ms=block_ms, name=name, max_connections=max_connections)
    try:
        with translated(url):
            if is_cluster(client):
                infos = list((await client.info("server", target_nodes=RedisCluster.PRIMARIES)).values())
            else:
                infos = [await client.info("server")]
    except BaseException:
        await client.aclose()
        raise
    version = min(parse_version(info) for info in infos)
    if version < MIN_SERVER:
        await client.aclose()
        shown = ".".join(map(str, version)) or "unknown"
        raise ServerVersionError(
            f"Redis at {redact(url)} is version {shown}; Jet needs >= 7.0 "
            "(XAUTOCLAIM with deleted-id reporting)"
        )
    if not is_cluster(client) and _mode(infos[0]) == "cluster":
        log.warning("Redis at %s is a node of a Redis Cluster: with a plain URL only runs whose slot lives on "
                    "that node work; use %s+cluster://... for a cluster client", redact(url),
                    urlsplit(url).scheme)
    return client


async def retry_forever(
    fn: Callable[[], Awaitable[T]], *, url: str, what: str, max_delay: float = 30.0,
    stop: anyio.Event | None = None,
) -> T:
    """Run `fn` until it does not raise ConnectError, sleeping with jittered backoff.

    Long-running workers wrap their loop in this, so a Redis restart or network
    blip makes them wait and reconnect instead of dying. Nothing else is retried:
    refused credentials, a cluster's MOVED to a plain client and the other fatal
    errors of `translate` end the role. With `stop`, the wait ends as soon as it is
    set: `Stopped` is raised, so a role stuck connecting still obeys SIGTERM.
    """
    delay = 0.2
    while True:
        if stop is not None and stop.is_set():
            raise Stopped(f"{what}: stopped before Redis at {redact(url)} answered")
        try:
            return await fn()
        except ConnectError as e:
            log.warning("%s: %s; retrying in %.1fs", what, e, delay)
            with anyio.move_on_after(delay * (0.5 + random.random())):
                if stop is not None:
                    await stop.wait()
                else:
                    await anyio.sleep(math.inf)
            delay = min(max_delay, delay * 2)
