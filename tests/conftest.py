"""Shared fixtures: a real Redis for every test (never a mock).

`redis_url` is parametrized per test by `pytest_generate_tests`:
- "valkey": a session-scoped embedded Valkey, for every test;
- "cluster": a session-scoped local Redis Cluster of three embedded Valkey
  primaries (`jet.queues.cluster`, reached by a `redis+cluster://` URL), for
  every test under tests/queues/ and every test marked `cluster`; started only
  when such a test runs. These runs carry the `cluster` mark; JET_TEST_CLUSTER=0
  leaves them out of collection;
- "external": the server at JET_TEST_REDIS_URL, when that is set, for the tests
  whose subject is the server's behaviour or that cost little: every fast-tier
  test (in process), every test under tests/queues/ (the queue contract) and
  every test marked `every_server`. A slow test elsewhere (it starts processes:
  `jet up`, a study, a killed trainer) checks Jet's roles, not the server, and
  runs on the embedded Valkey alone: on both it cost CI ten minutes for nothing
  the queue contract does not check. These runs carry the `external` mark.
Each test gets its own run namespace (`Keys`), so tests never see each other's
keys; on the cluster, runs hash to different primaries, so a session's tests
spread over all three.

Tiers (pyproject's addopts): plain `pytest` is the fast tier, which leaves out
every test marked `slow`, `cluster` or `external`; `pytest -m ""` (CI's
`.ci/run`) runs them all. A fast-tier test may not start a process: the
process guard below fails it, naming the mark to add. Session fixtures (the
embedded Valkey, the cluster) are shared by the whole suite and may.

`tiny_model` is the suite's one tiny model (built once per session); a test
that needs another shape builds its own with `jet.models.init_model`.
"""

from __future__ import annotations

import multiprocessing.process
import os
import platform
import subprocess
import uuid
from pathlib import Path

import pytest

from jet.keys import Keys
from jet.queues.server import EmbeddedServer

pytest_plugins = ["pytester"]  # tests/test_tiers.py runs the process guard on tests of its own

QUEUE_TESTS = Path(__file__).parent / "queues"
# A test carrying one of these marks is out of the fast tier (pyproject's addopts), so it may start processes.
OUT_OF_FAST_TIER = ("slow", "cluster", "external")


def servers_for(definition) -> list[str]:
    servers = ["valkey"]
    on_cluster = definition.get_closest_marker("cluster") or QUEUE_TESTS in Path(definition.path).parents
    if on_cluster and os.environ.get("JET_TEST_CLUSTER", "1") != "0":
        servers.append("cluster")
    in_process = not definition.get_closest_marker("slow")
    on_every_server = definition.get_closest_marker("every_server") or QUEUE_TESTS in Path(definition.path).parents
    if os.environ.get("JET_TEST_REDIS_URL") and (in_process or on_every_server):
        servers.append("external")
    return servers


def pytest_generate_tests(metafunc):
    if "redis_url" in metafunc.fixturenames:
        metafunc.parametrize("redis_url", servers_for(metafunc.definition), indirect=True, scope="session")


def pytest_collection_modifyitems(items):
    """The cluster and external runs carry the `cluster` / `external` mark, so the fast tier leaves them out.
    Files that hold slow tests come first (each file's tests keep their order): with pytest-xdist
    (`-n 2 --dist loadfile`, CI's full tier) the long files start early and the short ones fill the gaps,
    instead of one worker finishing a long file alone at the end."""
    for item in items:
        server = item.callspec.params.get("redis_url") if getattr(item, "callspec", None) else None
        if server == "cluster":
            item.add_marker(pytest.mark.cluster)
        elif server == "external":
            item.add_marker(pytest.mark.external)
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: collection order within each half


class ProcessGuard:
    """Fails a fast-tier test that starts a process (subprocess.Popen, which subprocess.run and asyncio's
    subprocesses use, or a multiprocessing start) from its body or its own fixtures. Session fixtures
    (the embedded Valkey) are set up on the first test that needs them and are the suite's, so allowed.
    A plugin, not conftest hooks: a session fixture's setup hook is the session's, outside tests/."""

    def __init__(self):
        self.item: pytest.Item | None = None
        self.in_session_fixture = 0
        self.violations: dict[str, list[str]] = {}

    def check(self, what: str) -> None:
        item = self.item
        if item is None or self.in_session_fixture or any(item.get_closest_marker(m) for m in OUT_OF_FAST_TIER):
            return
        message = (f"{item.nodeid} started a process ({what}) but is in the fast tier: mark it "
                   f"@pytest.mark.slow (tests/conftest.py, OUT_OF_FAST_TIER)")
        self.violations.setdefault(item.nodeid, []).append(message)
        pytest.fail(message, pytrace=False)

    def install(self) -> None:
        guard, popen_init, process_start = self, subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

        def guarded_popen_init(popen, args, *a, **kw):
            guard.check(f"subprocess {args if isinstance(args, str) else ' '.join(map(str, args))[:120]!r}")
            popen_init(popen, args, *a, **kw)

        def guarded_process_start(process):
            guard.check(f"multiprocessing {process.name}")
            process_start(process)

        subprocess.Popen.__init__ = guarded_popen_init
        multiprocessing.process.BaseProcess.start = guarded_process_start
        self.originals = popen_init, process_start

    def pytest_unconfigure(self, config):
        subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = self.originals

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.item = item
        try:
            return (yield)
        finally:
            self.item = None

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        session = fixturedef.scope == "session"
        self.in_session_fixture += session
        try:
            return (yield)
        finally:
            self.in_session_fixture -= session

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        """A process started where the test caught the guard's failure (or in a thread) still fails it."""
        report = yield
        if report.when == "call" and report.passed and self.violations.get(item.nodeid):
            report.outcome, report.longrepr = "failed", "\n".join(self.violations[item.nodeid])
        return report


def pytest_configure(config):
    # Libraries probe the machine with `uname -p` (platform.processor(), cached after its first call:
    # DeepSpeed's accelerator detection does, when transformers imports it); probe once here, before the
    # guard, so whichever fast-tier test happens to import them first is not charged with a process.
    platform.processor()
    # matplotlib builds its font cache on its first import on a machine, running `fc-list`: build it here.
    try:
        import matplotlib.font_manager  # noqa: F401
    except ImportError:
        pass
    guard = ProcessGuard()
    guard.install()
    config.pluginmanager.register(guard, "jet-process-guard")


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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The suite's tiny model (a 2-layer Llama-shaped model, 512-token vocabulary), built once."""
    from jet.models import init_model

    return init_model(tmp_path_factory.mktemp("model") / "tiny", vocab_size=512, hidden_size=32, layers=2,
                      heads=4, kv_heads=2, max_position=256, seed=0)


@pytest.fixture
def keys() -> Keys:
    return Keys(f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="session")
def smollm2() -> tuple[Path, Path]:
    """(the GGUF file, its float32 conversion), fetched and converted once per machine (jet.convert.smollm2)."""
    pytest.importorskip("gguf", reason="needs the convert extra: pip install 'jet-rl[convert]'")
    from jet.convert import FetchError
    from jet.convert import smollm2 as fetch

    try:
        return fetch(Path(os.environ.get("JET_TEST_CACHE", "~/.cache/jet-test")) / "smollm2")
    except FetchError as e:
        pytest.skip(f"realmodel: {e}")
