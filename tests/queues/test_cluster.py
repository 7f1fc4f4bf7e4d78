"""Redis Cluster for real: runs spread over primaries, a run survives a primary restart, a plain URL
to a cluster node fails loudly, and NOSCRIPT can never loop.

The cluster is `jet.queues.cluster.EmbeddedCluster`: three real Valkey primaries (the session's, or
the test's own when a node is restarted). Which node holds a key is read from the servers
themselves (CLUSTER KEYSLOT, CLUSTER NODES), not from redis-py's slot table.
"""

from __future__ import annotations

import itertools
import signal

import anyio
import pytest
import redis

from jet.errors import ClusterError, ServerError, is_fatal
from jet.keys import Keys
from jet.queues.cluster import EmbeddedCluster
from jet.queues.connect import connect, is_cluster
from jet.queues.consumer import Consumer
from jet.queues.messages import Commit
from jet.queues.producer import Producer, safe_trim
from jet.queues.server import EmbeddedServer
from tests.queues.helpers import close, entry, eventually, make_consumer
from tests.queues.test_faults import assert_exactly_once, fill, spawn, wait_outputs, wait_ready

pytestmark = [pytest.mark.anyio, pytest.mark.cluster]


def primaries_by_nodes(c: EmbeddedCluster) -> dict[tuple[int, int], int]:
    """{(first slot, last slot): port of the primary serving it}, from CLUSTER NODES."""
    with c.client(0) as r:
        text = r.execute_command("CLUSTER", "NODES")
    text = text.decode() if isinstance(text, bytes) else text
    out = {}
    for line in text.splitlines():
        fields = line.split()
        if "master" not in fields[2]:
            continue
        port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
        for part in fields[8:]:
            lo, _, hi = part.partition("-")
            out[int(lo), int(hi or lo)] = port
    return out


def port_of(c: EmbeddedCluster, key: str) -> int:
    with c.client(0) as r:
        slot = int(r.execute_command("CLUSTER", "KEYSLOT", key))
    return next(port for (lo, hi), port in primaries_by_nodes(c).items() if lo <= slot <= hi)


def runs_on(c: EmbeddedCluster, nodes: list[int], prefix: str = "spread") -> list[Keys]:
    """One run name per wanted node index whose hash tag maps to that node's slots."""
    found: dict[int, Keys] = {}
    for i in itertools.count():
        k = Keys(f"{prefix}{i}")
        node = [n.port for n in c.nodes].index(port_of(c, k.prefix))
        if node in nodes and node not in found:
            found[node] = k
        if len(found) == len(nodes):
            return [found[n] for n in nodes]


async def hop(url: str, keys: Keys, n: int) -> None:
    """Produce n entries, consume and commit one output each, through `url`."""
    src, dst = keys.tasks("a"), keys.traj("b")
    c = await make_consumer(url, keys, src, batch=n)
    await Producer(c.r, url, keys, src).send([entry(i) for i in range(n)])
    got = await c.fetch()
    assert await c.commit([(d, [(dst, entry(d.payload.meta["n"]))]) for d in got]) == [True] * n
    await close(c)


async def test_two_runs_land_on_different_primaries(cluster):
    a, b = runs_on(cluster, [1, 2])
    for k in (a, b):
        await hop(cluster.url, k, 20)
    for k, owner in ((a, 1), (b, 2)):
        assert port_of(cluster, k.prefix) == cluster.nodes[owner].port
        with cluster.client(owner) as r:
            slot = int(r.execute_command("CLUSTER", "KEYSLOT", k.traj("b")))
            assert r.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) >= 4  # tasks, traj, markers, ...
            assert r.xlen(k.traj("b")) == 20 and r.xlen(k.tasks("a")) == 20
        for other in {0, 1, 2} - {owner}:  # every key of the run is on its owner, none elsewhere
            with cluster.client(other) as r:
                assert r.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    assert port_of(cluster, a.prefix) != port_of(cluster, b.prefix)


async def test_status_and_runs_see_every_primary(cluster):
    from jet.queues import admin

    ks = runs_on(cluster, [0, 1, 2], prefix="seen")
    for k in ks:
        await hop(cluster.url, k, 3)
    r = await connect(cluster.url)
    try:
        assert is_cluster(r)
        assert {k.run for k in ks} <= set(await admin.runs(r))  # SCAN went to all three primaries
        for k in ks:
            rep = await admin.report(r, k, cluster.url)
            assert {s["name"]: s["length"] for s in rep["streams"]} == {"tasks:a": 3, "traj:b": 3}
    finally:
        await r.aclose()


async def test_multi_pipelines_and_scripts_of_one_run_work_on_a_cluster(cluster):
    """The gateway's MULTI (xadd+expire, xrange+delete), a plain pipeline, and Producer/safe_trim's
    registered scripts, all keys in the run's slot."""
    [k] = runs_on(cluster, [2], prefix="multi")
    r = await connect(cluster.url)
    calls = k.calls("ep1", "t")
    async with r.pipeline(transaction=True) as p:
        p.xadd(calls, entry(1))
        p.expire(calls, 60)
        assert (await p.execute())[1] is True
    async with r.pipeline(transaction=True) as p:
        p.xrange(calls)
        p.delete(calls)
        entries, deleted = await p.execute()
    assert len(entries) == 1 and deleted == 1
    async with r.pipeline(transaction=False) as p:
        p.exists(k.tasks("x"))
        p.xlen(k.tasks("x"))
        assert await p.execute() == [0, 0]
    await Producer(r, cluster.url, k, k.tasks("x"), maxlen=5, dedup=True).send([entry(i) for i in range(5)])
    assert await r.xlen(k.tasks("x")) == 5
    assert await safe_trim(r, k.tasks("x")) == 0  # no group has read it
    await r.aclose()


async def test_settle_reloads_a_flushed_script_on_the_slot_owner(cluster, embedded):
    """Scripts are cached per node, and a restarted node has none: NOSCRIPT loads it once and the
    commit goes through (cluster client path and the single-server fast path)."""
    [k] = runs_on(cluster, [1], prefix="flush")
    for url, flush in ((cluster.url, lambda: cluster.client(1)), (embedded.url, None)):
        keys = Keys(f"{k.run}x") if flush is None else k
        src = keys.tasks("a")
        c = await make_consumer(url, keys, src)
        for i in range(3):
            await c.r.xadd(src, entry(i))
        got = await c.fetch()
        assert await c.commit([(got[0], [])]) == [True]  # loads the script
        if flush is None:
            await c.r.script_flush()
        else:
            with flush() as node:
                node.script_flush()
        assert await c.commit([(d, []) for d in got[1:]]) == [True, True]
        if flush is None:
            await c.r.script_flush()
        else:
            with flush() as node:
                node.script_flush()
        # redis-py's registered scripts (Producer's PRODUCE, safe_trim's SAFE_TRIM) reload once too
        await Producer(c.r, url, keys, keys.tasks("b"), dedup=True).send([entry(i) for i in range(3)])
        assert await c.r.xlen(keys.tasks("b")) == 3
        assert await safe_trim(c.r, src) == 3  # the group read and acked all three
        await close(c)


async def test_plain_url_to_a_cluster_node_is_a_fatal_moved_error(cluster, caplog):
    """A redis:// URL of node 0: a run whose slot is on node 0 works (warned about); one on node 1
    gets MOVED, translated into a fatal ClusterError that says what to do, not a retry loop."""
    here, there = runs_on(cluster, [0, 1], prefix="plain")
    plain = cluster.node_url(0)
    await hop(plain, here, 3)
    assert "is a node of a Redis Cluster" in caplog.text
    with anyio.fail_after(20), pytest.raises(ClusterError) as e:
        await make_consumer(plain, there, there.tasks("a"))
    assert is_fatal(e.value)
    msg = str(e.value)
    assert "MOVED" in msg and "redis+cluster://" in msg and plain in msg


async def test_a_password_cluster_takes_its_password_from_the_url(tmp_path, keys):
    from jet.errors import AuthError

    with EmbeddedCluster(tmp_path / "pw", password="s3cret-9") as c:
        assert ":s3cret-9@" in c.url
        await hop(c.url, keys, 5)
        with anyio.fail_after(20), pytest.raises(AuthError) as e:
            await connect(c.url.replace("s3cret-9", "wrong-4"))
        assert is_fatal(e.value) and "redis+cluster://:***@" in str(e.value) and "wrong-4" not in str(e.value)


async def test_cluster_url_to_a_single_server_is_a_fatal_error(embedded):
    with anyio.fail_after(20), pytest.raises(ClusterError, match="is not a cluster") as e:
        await connect(embedded.url.replace("redis://", "redis+cluster://"))
    assert is_fatal(e.value)


# -- NOSCRIPT cannot loop ----------------------------------------------------------


async def round_robin_proxy(ports: list[int], task_status=anyio.TASK_STATUS_IGNORED) -> None:
    """A TCP load balancer over independent servers: each new connection goes to the next one."""
    from tests.queues.test_connect import pipe

    turn = itertools.cycle(ports)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")

    async def handle(client) -> None:
        async with client, await anyio.connect_tcp("127.0.0.1", next(turn)) as upstream:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pipe, client, upstream)
                tg.start_soon(pipe, upstream, client)

    task_status.started(listener.extra(anyio.abc.SocketAttribute.local_port))
    await listener.serve(handle)


async def test_noscript_after_loading_is_fatal_not_a_loop(tmp_path, keys):
    """Behind a round-robin proxy over two servers, the commit's SCRIPT LOAD lands on the other
    server than its EVALSHA: after one reload the commit raises a fatal ServerError that names
    the cause, within a bounded time, instead of loading and retrying forever."""
    with EmbeddedServer(tmp_path / "a") as a, EmbeddedServer(tmp_path / "b") as b:
        src = keys.tasks("a")
        direct = await make_consumer(a.url, keys, src)  # the stream, group and a pending entry on A
        await direct.r.xadd(src, entry(1))
        [d] = await direct.fetch()
        async with anyio.create_task_group() as tg:
            port = await tg.start(round_robin_proxy, [a.port, b.port])
            url = f"redis://127.0.0.1:{port}/0"
            r = await connect(url)  # its first connection: server A
            assert (await r.info("server"))["tcp_port"] == a.port
            c = Consumer(r, r, url, keys, src, "g", "c0", direct.cfg)
            c.inflight[d.entry_id] = d
            with anyio.fail_after(20), pytest.raises(ServerError, match="NOSCRIPT") as e:
                await c.settle([(d, Commit())])
            assert is_fatal(e.value)
            await r.aclose()
            tg.cancel_scope.cancel()
        assert (await direct.r.xpending(src, "g"))["pending"] == 1  # nothing half-done
        await close(direct)


# -- a primary restart -------------------------------------------------------------


@pytest.mark.slow
async def test_run_survives_a_restart_of_its_primary(tmp_path):
    """Three hop processes move 2,000 entries through the cluster client while the primary that owns
    the run's slot is stopped (SIGTERM: AOF fsynced) and started again: every acknowledged output
    survives, every input comes out exactly once, nothing stays pending."""
    with EmbeddedCluster(tmp_path / "cluster") as c:
        [keys] = runs_on(c, [1], prefix="restart")
        url, n = c.url, 2000
        await fill(url, keys, n)
        ready = [tmp_path / f"ready-{s}" for s in range(3)]
        logs = [tmp_path / f"hop-{s}.log" for s in range(3)]
        procs = [spawn(url, keys.run, s, "--lease-ms", "2000", "--sleep", "0.02", "--batch", "20",
                       ready=ready[s], log=logs[s]) for s in range(3)]
        try:
            await wait_ready(ready)
            probe = await connect(url)
            await eventually(lambda: _at_least(probe, keys.traj("dst"), n // 4), timeout=120)
            before = await probe.xlen(keys.traj("dst"))
            assert before < n  # the restart falls mid-run
            await probe.aclose()
            await anyio.to_thread.run_sync(lambda: c.restart_node(1, down_s=1.0))
            probe = await connect(url)
            assert await probe.xlen(keys.traj("dst")) >= before  # acknowledged work survived
            await probe.aclose()
            out, _ = await wait_outputs(url, keys, n, 180)
            for p in procs:
                p.send_signal(signal.SIGTERM)
            codes = [p.wait(30) for p in procs]
            assert codes == [0, 0, 0], "\n".join(f.read_text()[-3000:] for f in logs)
            out, pending = await wait_outputs(url, keys, n, 5)
        finally:
            for p in procs:
                p.kill()
        assert_exactly_once(out, n)
        assert pending == 0


async def _at_least(r, stream: str, n: int) -> bool:
    return await r.xlen(stream) >= n


def test_jet_server_cluster_prints_a_cluster_url_that_other_commands_find(tmp_path):
    import subprocess
    import sys

    import orjson

    jet = [sys.executable, "-m", "jet.cli"]
    p = subprocess.Popen(jet + ["server", "--cluster", "3", "--port", "0", "--run-dir", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline().strip()
        assert line.startswith("JET_REDIS_URL=redis+cluster://127.0.0.1:"), p.stderr.read()
        url = line.split("=", 1)[1]

        async def primaries() -> int:
            r = await connect(url)
            try:
                await r.xadd(Keys("srvcl").tasks("a"), entry(1))
                return len(r.get_primaries())
            finally:
                await r.aclose()

        assert anyio.run(primaries) == 3
        res = subprocess.run(jet + ["status", "--run-dir", str(tmp_path), "--json"],  # found via server.json
                             capture_output=True, text=True, check=True)
        assert [r["run"] for r in orjson.loads(res.stdout)] == ["srvcl"]
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0, p.stderr.read()
    assert not (tmp_path / "server.json").exists()


def test_ports_taken_between_picking_and_binding_are_picked_again(tmp_path):
    """Another process takes the ports a node picked (the race of `--port 0`): the node picks again;
    a port the user named and that is taken stays a loud error."""
    import socket

    from jet.errors import ConnectError

    squatters = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        squatters.append(s)
    taken = [s.getsockname()[1] for s in squatters]
    try:
        node = EmbeddedServer(tmp_path / "node", extra=["--cluster-enabled", "yes"], bus_port=0)
        node.port, node.bus_port = taken  # as if another process bound both right after the pick
        with node:
            assert node.port not in taken and node.bus_port not in taken
            with redis.Redis(port=node.port) as r:
                assert r.ping() and r.config_get("cluster-port")["cluster-port"] == str(node.bus_port)
        with pytest.raises(ConnectError, match="Address already in use"):
            EmbeddedServer(tmp_path / "named", port=taken[0]).start()
    finally:
        for s in squatters:
            s.close()
