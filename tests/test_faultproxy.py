"""The fault proxy (tests/faultproxy.py) against the real embedded Valkey: each fault does what it says.

In process and fast: the proxy runs on its own event loop thread, the client is plain redis-py with
short timeouts, so every fault shows as the error (or the wait) a role would see.
"""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.faultproxy import FaultProxy


@pytest.fixture
def proxy(redis_url):
    if "+cluster" in redis_url:
        pytest.skip("one server behind the proxy")
    with FaultProxy.to(redis_url) as p:
        yield p


def client(proxy, redis_url, timeout=2.0) -> redis.Redis:
    return redis.Redis.from_url(proxy.url_for(redis_url), socket_timeout=timeout, socket_connect_timeout=timeout,
                                retry=Retry(NoBackoff(), 0))  # no silent retry: each fault shows


def test_pass_through_forwards_commands_and_big_values(proxy, redis_url):
    r = client(proxy, redis_url)
    key, value = f"fp:{uuid.uuid4().hex}", b"x" * 300_000  # several chunks each way
    assert r.set(key, value)
    assert r.get(key) == value
    r.delete(key)
    assert proxy.stats["accepted"] == 1


def test_cut_resets_open_connections_and_the_next_one_works(proxy, redis_url):
    r = client(proxy, redis_url)
    assert r.ping()
    assert proxy.cut() == 1
    try:  # the pooled connection was reset under it: redis-py raises, or sees the reset first and reconnects
        r.ping()
    except redis.ConnectionError:
        pass
    assert r.ping()  # a new connection goes through
    assert proxy.stats["cut"] == 1 and proxy.stats["accepted"] == 2  # the old one is gone: a second was opened


def test_a_cut_mid_command_ends_a_blocking_read(proxy, redis_url):
    import threading

    r = client(proxy, redis_url, timeout=10)
    stream = f"fp:{uuid.uuid4().hex}"
    result: list = []

    def blocked():
        try:
            result.append(r.xread({stream: "$"}, block=8000))
        except redis.ConnectionError as e:
            result.append(e)

    t = threading.Thread(target=blocked)
    t0 = time.monotonic()
    t.start()
    time.sleep(0.3)
    proxy.cut()
    t.join(5)
    assert isinstance(result[0], redis.ConnectionError), result
    assert time.monotonic() - t0 < 3, "the cut ended the read, not its timeout"


def test_latency_delays_every_reply_then_ends(proxy, redis_url):
    r = client(proxy, redis_url)
    r.ping()
    proxy.latency(0.4)
    t0 = time.monotonic()
    r.ping()
    assert time.monotonic() - t0 >= 0.75, "the request and the reply each waited 0.4 s"
    proxy.latency(0)
    t0 = time.monotonic()
    r.ping()
    assert time.monotonic() - t0 < 0.3


def test_a_blackhole_drops_commands_and_heal_resets_the_connections_that_lost_bytes(proxy, redis_url):
    r = client(proxy, redis_url, timeout=0.5)
    direct = redis.Redis.from_url(redis_url)
    key = f"fp:{uuid.uuid4().hex}"
    assert r.ping()
    proxy.blackhole()
    with pytest.raises(redis.TimeoutError):
        r.set(key, 1)  # dropped on the way: it never ran
    with pytest.raises(redis.TimeoutError):
        client(proxy, redis_url, timeout=0.5).ping()  # a new connection is accepted, then nothing answers
    assert direct.get(key) is None, "a command sent into the blackhole never reached the server"
    assert proxy.stats["dropped"] >= 2
    proxy.heal()
    assert r.set(key, 2) and direct.get(key) == b"2"
    direct.delete(key)


def test_a_server_that_is_down_is_a_refused_connection(redis_url):
    with FaultProxy("127.0.0.1", _closed_port()) as p:
        with pytest.raises(redis.ConnectionError):
            client(p, redis_url).ping()
        assert p.stats["refused"] == 1


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there
