"""Starting `jet dash` as a child process of `jet up`, on a socket bound before it starts.

What it is: `start` binds the listening socket here (the preferred port on
loopback, or any free port when that one is taken), so the URL is known and
printed at once and no other process can take the port in between; the child
`python -m jet.dash.server --fd N` serves on the inherited socket. The Redis
URL travels in the environment ($JET_REDIS_URL), never in argv (`ps` shows argv).

What it is not: supervised. The dashboard is a viewer: if it dies, the run
goes on (its log says why), and `jet up` stops it at the end.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from jet.dash.server import DEFAULT_PORT, bind, url_of
from jet.supervisor import python_module


@dataclass
class Dashboard:
    url: str
    proc: subprocess.Popen
    log: Path

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start(run: str, runs_dir: str, redis_url: str, log: Path, *, port: int = DEFAULT_PORT,
          host: str = "127.0.0.1", env: dict | None = None) -> Dashboard:
    """Start the dashboard of a `jet up` run; its output goes to `log`. It finds the
    models' tokenizers in the run's resolved config, so write that first."""
    try:
        sock = bind(host, port)
    except OSError as e:
        if e.errno != errno.EADDRINUSE or port == 0:
            raise
        sock = bind(host, 0)  # another dashboard (another jet up) has the default port
    argv = [*python_module("jet.dash.server"), "--fd", str(sock.fileno()), "--host", host,
            "--run", run, "--runs-dir", runs_dir]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, env={**(env or os.environ), "JET_REDIS_URL": redis_url}, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, pass_fds=(sock.fileno(),),
                                start_new_session=True)
    url = url_of(host, sock.getsockname()[1], None)
    sock.close()  # the child holds its own copy
    return Dashboard(url, proc, log)
