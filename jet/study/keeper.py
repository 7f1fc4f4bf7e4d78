"""The run keeper: the one process that owns a study run's `jet up` and every process under it.

`python -m jet.study.keeper --redis-url U --study S --run R --log F -- jet up argv...`
is what a study worker starts for each run attempt. It exists because a
SIGKILLed study worker cannot clean up after itself, and a run must never
have two live attempts (two trainers on one run folder):

- it takes the run's lease (`Keys.study_run_lock(run)`, SET NX PX) before
  starting `jet up`, renews it while anything of the attempt lives, and
  releases it only after the last of its processes is gone. A reclaimed run's
  new keeper waits for the lease, so it starts only after the old attempt
  drained (checkpointed) or its machine vanished (the lease expired);
- it is a child subreaper (Linux): `jet up`'s roles run in sessions of their
  own, and if `jet up` dies they are reparented here, so none is left behind;
- its parent (the study worker) dying, or a first SIGTERM, makes `jet up`
  drain (SIGTERM: every role finishes or releases its work and the trainer
  checkpoints); a second SIGTERM, or the grace period running out, kills
  everything at once.

Exit code: `jet up`'s; EXIT_NO_LEASE if it was told to stop while still
waiting for the lease (nothing was started).

What it is not: a supervisor of roles (`jet up` restarts crashed roles).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio

log = logging.getLogger(__name__)

EXIT_NO_LEASE = 75  # EX_TEMPFAIL: told to stop before the previous attempt let go of the run
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children() -> list[int]:
    """Our live child pids (orphans reparented to us included), from /proc."""
    out: list[int] = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            out += [int(x) for x in task.read_text().split()]
    return out


def reap_all(grace_s: float) -> None:
    """SIGTERM every remaining child, wait up to `grace_s` for them, SIGKILL the rest; reap all."""
    deadline = time.monotonic() + grace_s
    signalled: set[int] = set()
    while True:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        alive = children()
        if not alive:
            return
        late = time.monotonic() > deadline
        for pid in alive:
            if late or pid not in signalled:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
                signalled.add(pid)
        time.sleep(0.2)


async def keep(url: str, study: str, run: str, argv: list[str], log_path: Path, lease_s: float,
               grace_s: float) -> int:
    from jet.keys import Keys
    from jet.queues.connect import connect
    from jet.study.ledger import Lease

    parent = os.getppid()
    keys = Keys.for_study(study)
    r = await connect(url)
    lease = Lease(r, url, keys.study_run_lock(run), lease_s)
    terms: list[float] = []

    def on_term(*_):
        terms.append(time.monotonic())

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    try:
        # 1. the run's lease: the previous attempt (if any) has let go of the run
        waited = 0.0
        while not await lease.take():
            if terms or os.getppid() != parent:
                return EXIT_NO_LEASE
            if waited % 10 < 0.5:
                log.info("run %s: waiting for its previous attempt to end (lease %s)", run, lease.key)
            await anyio.sleep(0.5)
            waited += 0.5
        # 2. jet up, in a session of its own so signals reach it alone
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        told_at = None
        last_renew = time.monotonic()
        while proc.poll() is None:
            now = time.monotonic()
            if told_at is None and (terms or os.getppid() != parent):
                told_at = now
                proc.send_signal(signal.SIGTERM)  # drain: roles finish or release, the trainer checkpoints
            elif told_at is not None and (len(terms) > 1 or now - told_at > grace_s):
                proc.kill()
                reap_all(0.0)
            if now - last_renew > lease.ttl_ms / 3000:
                with contextlib.suppress(Exception):  # a Redis blip: the next renewal may still make it
                    await lease.renew()
                last_renew = now
            await anyio.sleep(0.2)
        code = proc.returncode
        # 3. whatever jet up left behind (it was killed, or a role outlived it)
        await anyio.to_thread.run_sync(reap_all, 0.0 if len(terms) > 1 else min(grace_s, 30.0))
        return code
    finally:
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(Exception):
                await lease.release()
            await r.aclose()


def main(args: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m jet.study.keeper", description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--study", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--log", required=True, help="File that gets jet up's output (appended).")
    ap.add_argument("--lease-s", type=float, default=10.0)
    ap.add_argument("--grace-s", type=float, default=120.0)
    ap.add_argument("argv", nargs=argparse.REMAINDER)
    a = ap.parse_args(args)
    argv = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s keeper[%(process)d]: %(message)s")
    become_subreaper()
    code = anyio.run(keep, a.redis_url, a.study, a.run, argv, Path(a.log), a.lease_s, a.grace_s)
    raise SystemExit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
