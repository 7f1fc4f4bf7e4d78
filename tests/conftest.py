"""Shared fixtures: a real Redis for every test (never a mock).

A session-scoped embedded Valkey is always used; when JET_TEST_REDIS_URL is set
the fixtures are parametrized so the same tests also run against that server.
Each test gets its own run namespace (`Keys`), so tests never see each other's keys.
"""

from __future__ import annotations

import os
import uuid

import pytest

from jet.keys import Keys
from jet.queues.server import EmbeddedServer

SERVERS = ["valkey"] + (["external"] if os.environ.get("JET_TEST_REDIS_URL") else [])


@pytest.fixture(scope="session")
def embedded(tmp_path_factory):
    server = EmbeddedServer(tmp_path_factory.mktemp("valkey")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session", params=SERVERS)
def redis_url(request, embedded) -> str:
    if request.param == "external":
        return os.environ["JET_TEST_REDIS_URL"]
    return embedded.url


@pytest.fixture
def keys() -> Keys:
    return Keys(f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture
def anyio_backend():
    return "asyncio"
