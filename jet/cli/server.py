"""`jet server`: the embedded Valkey server, or a local Redis Cluster (`--cluster N`), in the foreground.

The classes are `jet.queues.server.EmbeddedServer` and `jet.queues.cluster.EmbeddedCluster`.

It prints the `JET_REDIS_URL` to use and records it in `<run-dir>/server.json`, so
other `jet` commands on this machine find it without being told. Ctrl-C or SIGTERM
stops it gracefully (AOF flushed).
"""

from __future__ import annotations

import signal
import time

import click

from jet.queues.server import DEFAULT_RUN_DIR, EmbeddedServer


@click.command("server")
@click.option("--run-dir", default=DEFAULT_RUN_DIR, show_default=True, help="Data (AOF) goes to RUN_DIR/redis.")
@click.option("--port", default=6390, show_default=True, help="0 picks a free port.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address (loopback unless told).")
@click.option("--password", envvar="JET_REDIS_PASSWORD", default=None, help="requirepass (or JET_REDIS_PASSWORD).")
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

    click.echo(f"JET_REDIS_URL={redact(server.url) if password else server.url}")
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
