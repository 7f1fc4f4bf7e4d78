"""A local Redis Cluster made of embedded Valkey servers: N primaries on one machine.

For tests, demos and `jet server --cluster N`: every node is an `EmbeddedServer`
(AOF on, `noeviction`) started with `cluster-enabled yes`; a fresh cluster gets
its slots split evenly (CLUSTER ADDSLOTSRANGE), a distinct config epoch per
node, and its nodes joined with CLUSTER MEET, all through redis-py. A cluster
restarted from the same folder keeps its layout (each node's `nodes.conf`) and
its data (AOF). `start()` and `restart_node()` return only once every node
reports `cluster_state:ok` and knows the slot of every other node.

What it is not: a production layout. There are no replicas, so while a primary
is down its slots answer nothing (and with the default full-coverage rule the
other primaries refuse too); it comes back with what its AOF acknowledged.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import redis

from jet.errors import ConnectError
from jet.queues.server import DEFAULT_RUN_DIR, EmbeddedServer

SLOTS = 16384
NODE_TIMEOUT_MS = 3000  # how long a silent node takes to be marked failing (the default is 15 s)


def cluster_info(r: redis.Redis) -> dict[str, str]:
    """CLUSTER INFO of one node as a dict of strings."""
    raw = r.execute_command("CLUSTER", "INFO")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.split(":", 1) for line in text.split() if ":" in line)


def slot_ranges(n: int) -> list[tuple[int, int]]:
    """Contiguous, inclusive slot ranges, one per primary, as even as they divide."""
    bounds = [SLOTS * i // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(n)]


class EmbeddedCluster:
    """`primaries` cluster-enabled Valkey processes under `run_dir/node<i>/`."""

    def __init__(self, run_dir: str | os.PathLike = DEFAULT_RUN_DIR, *, primaries: int = 3,
                 host: str = "127.0.0.1", ports: list[int] | None = None, password: str | None = None,
                 node_timeout_ms: int = NODE_TIMEOUT_MS):
        if primaries < 1:
            raise ValueError("a cluster needs at least one primary")
        self.run_dir, self.host, self.password = Path(run_dir), host, password
        ports = ports or [0] * primaries  # 0: each node picks free ones (and again if one is taken first)
        self.nodes = []
        for i, port in enumerate(ports):
            extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", str(node_timeout_ms)]
            if password:
                extra += ["--masterauth", password]
            self.nodes.append(EmbeddedServer(self.run_dir / f"node{i}", port=port, password=password, host=host,
                                             extra=extra, bus_port=0))

    # -- addresses ---------------------------------------------------------------

    @property
    def url(self) -> str:
        """The URL Jet takes for the cluster: its first node, with the cluster scheme."""
        return self.nodes[0].url.replace("redis://", "redis+cluster://", 1)

    def node_url(self, i: int) -> str:
        """A plain single-server URL of node `i` (what a user might paste by mistake)."""
        return self.nodes[i].url

    def client(self, i: int) -> redis.Redis:
        """A plain synchronous client of node `i` (the caller closes it)."""
        n = self.nodes[i]
        return redis.Redis(host=n.host, port=n.port, password=self.password, socket_timeout=5)

    def node_of_slot(self, slot: int) -> int:
        """Index of the primary that serves `slot`, as node 0 sees the cluster (CLUSTER SLOTS)."""
        with self.client(0) as r:
            for start, end, primary, *_ in r.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = int(primary[1])
                    return next(i for i, n in enumerate(self.nodes) if n.port == port)
        raise LookupError(f"slot {slot} is served by no node")

    def node_of_key(self, key: str) -> int:
        with self.client(0) as r:
            return self.node_of_slot(int(r.execute_command("CLUSTER", "KEYSLOT", key)))

    # -- life cycle --------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> "EmbeddedCluster":
        try:
            for n in self.nodes:
                n.start(timeout)
            if not self._formed():
                self._form()
            self.wait_ok(timeout)
        except BaseException:
            self.kill()
            raise
        self.write_info()
        return self

    def _formed(self) -> bool:
        """True when the nodes came back from an earlier run with every slot assigned."""
        with self.client(0) as r:
            return int(cluster_info(r).get("cluster_slots_assigned", 0)) == SLOTS

    def _form(self) -> None:
        for i, ((start, end), n) in enumerate(zip(slot_ranges(len(self.nodes)), self.nodes)):
            with self.client(i) as r:
                # Distinct epochs up front, as a fresh cluster otherwise settles collisions by gossip.
                r.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                r.execute_command("CLUSTER", "ADDSLOTSRANGE", start, end)
        with self.client(0) as r:
            for n in self.nodes[1:]:
                r.execute_command("CLUSTER", "MEET", n.host, n.port, n.bus_port)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every node says cluster_state:ok, knows every node and maps every slot the same."""
        deadline, last = time.monotonic() + timeout, "no answer yet"
        while time.monotonic() < deadline:
            try:
                views = []
                for i in range(len(self.nodes)):
                    with self.client(i) as r:
                        info = cluster_info(r)
                        views.append(sorted((s[0], s[1], int(s[2][1])) for s in r.execute_command("CLUSTER", "SLOTS")))
                    last = f"node {i}: {info.get('cluster_state')}, knows {info.get('cluster_known_nodes')} nodes"
                    if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) != len(self.nodes):
                        break
                else:
                    if all(v == views[0] for v in views) and sum(e - s + 1 for s, e, _ in views[0]) == SLOTS:
                        return
                    last = "the nodes do not agree on the slot map yet"
            except (redis.RedisError, OSError) as e:
                last = str(e)
            time.sleep(0.1)
        raise ConnectError(f"local cluster not ready within {timeout}s: {last}")

    def restart_node(self, i: int, *, hard: bool = False, down_s: float = 0.0, timeout: float = 30.0) -> None:
        """Stop node `i` (SIGTERM: AOF fsynced; `hard`: SIGKILL), wait `down_s`, start it again on
        the same port and folder, and wait until the cluster is whole again."""
        node = self.nodes[i]
        node.kill() if hard else node.stop()
        time.sleep(down_s)
        node.start(timeout)
        self.wait_ok(timeout)

    def write_info(self) -> None:
        """`run_dir/server.json` names the cluster URL, so other `jet` commands find it (as for one server)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        info = {"url": self.url, "pid": self.nodes[0].proc.pid, "port": self.nodes[0].port,
                "nodes": [n.port for n in self.nodes]}
        path = self.run_dir / "server.json"
        path.write_text(json.dumps(info))
        os.chmod(path, 0o600)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        (self.run_dir / "server.json").unlink(missing_ok=True)

    def kill(self) -> None:
        for n in self.nodes:
            n.kill()

    def __enter__(self) -> "EmbeddedCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
