"""Shared fixtures: a real Redis for every test (never a mock).

`redis_url` is parametrized per test by `pytest_generate_tests`:
- "valkey": a session-scoped embedded Valkey, for every test;
- "cluster": a session-scoped local Redis Cluster of three embedded Valkey
  primaries (`jet.queues.cluster`, reached by a `redis+cluster://` URL), for
  every test under tests/queues/ and every test marked `cluster`; started only
  when such a test runs. `-m "not cluster"` or JET_TEST_CLUSTER=0 skips those runs;
- "external": the server at JET_TEST_REDIS_URL, when that is set.
Each test gets its own run namespace (`Keys`), so tests never see each other's
keys; on the cluster, runs hash to different primaries, so a session's tests
spread over all three.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from jet.keys import Keys
from jet.queues.server import EmbeddedServer

QUEUE_TESTS = Path(__file__).parent / "queues"


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster: also run this test against a local Redis Cluster")


def servers_for(definition) -> list[str]:
    servers = ["valkey"]
    on_cluster = definition.get_closest_marker("cluster") or QUEUE_TESTS in Path(definition.path).parents
    if on_cluster and os.environ.get("JET_TEST_CLUSTER", "1") != "0":
        servers.append("cluster")
    if os.environ.get("JET_TEST_REDIS_URL"):
        servers.append("external")
    return servers


def pytest_generate_tests(metafunc):
    if "redis_url" in metafunc.fixturenames:
        metafunc.parametrize("redis_url", servers_for(metafunc.definition), indirect=True, scope="session")


def pytest_collection_modifyitems(items):
    """The cluster runs carry the `cluster` mark too, so `-m "not cluster"` leaves them out."""
    for item in items:
        if getattr(item, "callspec", None) and item.callspec.params.get("redis_url") == "cluster":
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def embedded(tmp_path_factory):
    server = EmbeddedServer(tmp_path_factory.mktemp("valkey")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """Three primaries, slots split evenly; tests that restart a node use their own cluster."""
    from jet.queues.cluster import EmbeddedCluster

    c = EmbeddedCluster(tmp_path_factory.mktemp("cluster")).start()
    yield c
    c.stop()


@pytest.fixture(scope="session")
def redis_url(request) -> str:
    if request.param == "external":
        return os.environ["JET_TEST_REDIS_URL"]
    if request.param == "cluster":
        return request.getfixturevalue("cluster").url
    return request.getfixturevalue("embedded").url


@pytest.fixture
def keys() -> Keys:
    return Keys(f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture
def anyio_backend():
    return "asyncio"
