"""`jet server`: the embedded Valkey server, or a local Redis Cluster (`--cluster N`), in the foreground.

The classes are `jet.queues.server.EmbeddedServer` and `jet.queues.cluster.EmbeddedCluster`.

It prints the `JET_REDIS_URL` to use, its password hidden, and records it in
`<run-dir>/server.json`, so other `jet` commands on this machine find it without
being told. Bound to every interface (`--host 0.0.0.0` or `::`), the printed URL
names this machine as other nodes reach it (`reachable_host`: its host name when that
resolves to a non-loopback address, else the address of its default route), not the
wildcard, which no other node can connect to. The password comes from `--password` or $JET_REDIS_PASSWORD (the
latter keeps it out of `ps`). Ctrl-C or SIGTERM stops it gracefully (AOF flushed).
"""

from __future__ import annotations

import ipaddress
import signal
import socket
import time
from urllib.parse import urlsplit

import click

from jet.queues.server import DEFAULT_RUN_DIR, EmbeddedServer

WILDCARDS = ("0.0.0.0", "::", "")


def reachable_host(bind: str) -> str:
    """The host other machines use to reach a server bound to `bind`: `bind` itself unless it is a
    wildcard; then this machine's host name if it resolves to an address other than loopback (Debian's
    /etc/hosts maps it to 127.0.1.1), else the address of its default route, else the host name."""
    if bind not in WILDCARDS:
        return bind
    name = socket.gethostname()
    try:
        if any(not ipaddress.ip_address(a[4][0].partition("%")[0]).is_loopback for a in socket.getaddrinfo(name, None)):
            return name
    except (OSError, ValueError):
        pass
    try:  # connecting a UDP socket sends nothing: it only picks the interface a packet would leave by
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1, never answered
            address = probe.getsockname()[0]
        if not ipaddress.ip_address(address).is_loopback:
            return address
    except OSError:
        pass
    return name


def public_url(url: str, bind: str) -> str:
    """`url` (a server's own, naming its bind address) with the host other nodes reach it at."""
    parts = urlsplit(url)
    host = reachable_host(bind)
    shown = f"[{host}]" if ":" in host else host
    auth = parts.netloc.rpartition("@")[0]
    return parts._replace(netloc=f"{auth}@{shown}:{parts.port}" if auth else f"{shown}:{parts.port}").geturl()


@click.command("server")
@click.option("--run-dir", default=DEFAULT_RUN_DIR, show_default=True, help="Data (AOF) goes to RUN_DIR/redis.")
@click.option("--port", default=6390, show_default=True, help="0 picks a free port.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address (loopback unless told).")
@click.option("--password", envvar="JET_REDIS_PASSWORD", default=None,
              help="requirepass (default: $JET_REDIS_PASSWORD, which keeps it out of `ps`).")
@click.option("--cluster", "primaries", type=click.IntRange(min=1), default=None, metavar="N",
              help="A local Redis Cluster of N primaries instead (data in RUN_DIR/node<i>/; ports PORT..PORT+N-1, "
                   "or free ones with --port 0); prints its redis+cluster:// URL.")
def cli(run_dir: str, port: int, host: str, password: str | None, primaries: int | None) -> None:
    """Run the embedded Valkey server (or a local cluster) in the foreground and print its URL."""
    if primaries:
        from jet.queues.cluster import EmbeddedCluster

        server = EmbeddedCluster(run_dir, primaries=primaries, host=host, password=password,
                                 ports=[port + i for i in range(primaries)] if port else None)
        where = f"{run_dir}/node0..{primaries - 1} (AOF, appendfsync everysec)"
    else:
        server = EmbeddedServer(run_dir, port=port, password=password, host=host)
        where = f"{server.data_dir} (AOF, appendfsync everysec)"
    server.start()
    procs = [n.proc for n in server.nodes] if primaries else [server.proc]
    from jet.queues.connect import redact

    url = public_url(server.url, host)
    click.echo(f"JET_REDIS_URL={redact(url) if password else url}")
    click.echo(f"data: {where}; Ctrl-C stops it", err=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop and all(p.poll() is None for p in procs):
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    codes = [p.returncode for p in procs]
    if any(c not in (0, None, -signal.SIGTERM) for c in codes):
        tail = server.nodes[0].log_tail() if primaries else server.log_tail()
        raise SystemExit(f"valkey-server exited with {codes}:\n{tail}")
