"""`jet server`: the embedded Valkey server in the foreground (the class is `jet.queues.server.EmbeddedServer`).

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
def cli(run_dir: str, port: int, host: str, password: str | None) -> None:
    """Run the embedded Valkey server in the foreground and print its URL."""
    server = EmbeddedServer(run_dir, port=port, password=password, host=host)
    server.start()
    from jet.queues.connect import redact

    click.echo(f"JET_REDIS_URL={redact(server.url) if password else server.url}")
    click.echo(f"data: {server.data_dir} (AOF, appendfsync everysec); Ctrl-C stops it", err=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop and server.proc.poll() is None:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    if server.proc.returncode not in (0, None, -signal.SIGTERM):
        raise SystemExit(f"valkey-server exited with {server.proc.returncode}:\n{server.log_tail()}")
