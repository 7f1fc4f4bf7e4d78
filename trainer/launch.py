"""Starting N trainer processes for the deepspeed backend (`jet train --backend deepspeed --nproc N`).

What it is: `spawn(argv, nproc)` runs `argv` nproc times with the
environment torch.distributed expects (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT on a free local port), forwards SIGTERM/SIGINT to
every rank (rank 0 decides when to stop and the others follow its plan), and
when one rank dies, terminates the rest: a rank waiting on a collective of
a dead peer would otherwise hang until the process group's timeout. Returns
0 only if every rank exited 0.

What it is not: multi-node. For several machines, start the ranks with
torchrun or the deepspeed launcher; `jet train` runs as a rank whenever
RANK is set in its environment.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time

log = logging.getLogger(__name__)

KILL_AFTER_S = 15.0  # grace between SIGTERM and SIGKILL for ranks left behind by a dead peer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv: list[str], nproc: int) -> int:
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(argv, env=env))

    def forward(sig, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        failed_at = None
        while any(p.poll() is None for p in procs):
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                log.error("a trainer rank exited with %s; stopping the others",
                          [p.returncode for p in procs])
                failed_at = time.monotonic()
                forward(signal.SIGTERM, None)
            if failed_at is not None and time.monotonic() - failed_at > KILL_AFTER_S:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.2)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    codes = [p.returncode for p in procs]
    return 0 if all(c == 0 for c in codes) else next(c for c in codes if c) or 1
