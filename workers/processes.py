"""Running worker processes: `-n N` supervision, queue settings, the run-until-signal loop.

What it is: `supervise(argv_of, n)` starts N copies of a worker (slots
0..N-1, each a plain `python -m jet.workers.<role> ... --slot i` that also runs
alone, in its own session), turns SIGTERM / SIGINT into a SIGTERM for each of
them (drain), restarts one that dies on its own
(with backoff; it is disposable, its state lives in Redis) and returns once all
have exited after a signal. `supervise_children(children_of, reload=True)` is
the general form: each child has its own argv and working directory, and
SIGHUP rolls them (issue 6): it starts a new generation, `children_of(bank)`
with the other bank (0 <-> 1, so the new children can name themselves apart
from the old ones), and once every new child has called `mark_ready` (or
READY_TIMEOUT_S passed) SIGTERMs the old generation, which drains and exits.
Until then both generations serve, so the pause in output is not the new
code's start-up time, and new code that never gets ready (an import error)
leaves the old one serving for READY_TIMEOUT_S. Only the current generation
is restarted when it dies. A SIGHUP that arrives while an old generation is
still there waits for it (two old generations would share a bank). `run_until_signal` runs a worker's async main with a
stop event that SIGTERM sets (drain), as `jet.queues.serve.watch_signals` does.
`queue_settings` maps the config's queue section onto consumer settings.

What it is not: a process manager for several roles (`jet up` is).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import anyio

from jet.config import JetConfig
from jet.queues.consumer import Settings

log = logging.getLogger(__name__)

RESTART_DELAY_S = (1.0, 30.0)  # first and largest delay before restarting a crashed child
SUPERVISOR_ENV = "JET_SUPERVISOR_PID"  # set in children: the pid whose death makes them drain
READY_ENV = "JET_READY_FILE"  # set in children: the file `mark_ready` creates once serving
READY_TIMEOUT_S = 120.0  # on SIGHUP, longest wait for the new generation before the old one drains


def queue_settings(cfg: JetConfig, batch: int) -> Settings:
    """The consumer settings of `cfg.queues`, reading `batch` entries at a time."""
    q = cfg.queues
    return Settings(lease_ms=q.lease_ms, max_deliveries=q.max_deliveries, block_ms=q.block_ms, batch=batch,
                    marker_ttl_s=q.marker_ttl_s, max_entry_bytes=q.max_entry_bytes)


@dataclass(frozen=True)
class Child:
    """One supervised worker process: its command line and working directory (None: ours)."""

    argv: list[str]
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # added to the supervisor's environment


def _spawn(child: Child) -> subprocess.Popen:
    # Own session: a terminal's Ctrl-C reaches only the supervisor, which forwards ONE
    # signal (a child told twice skips its drain and exits at once). The child drains
    # by itself if the supervisor dies (see watch_parent).
    env = {**os.environ, **child.env, SUPERVISOR_ENV: str(os.getpid())}
    return subprocess.Popen(child.argv, start_new_session=True, env=env, cwd=child.cwd)


def supervise(argv_of: Callable[[int], list[str]], n: int) -> int:
    """Run `argv_of(slot)` for slots 0..n-1 until a signal; 0 if every child exited cleanly.

    SIGTERM or SIGINT to the supervisor sends SIGTERM to every child (drain); a
    second one is forwarded too, which makes the children exit at once.
    """
    return supervise_children(lambda bank: [Child(argv_of(slot)) for slot in range(n)])


def mark_ready() -> None:
    """Tell the supervisor (if any) that this child serves: a rolling reload may drain the old ones."""
    path = os.environ.get(READY_ENV)
    if path:
        with open(path, "w"):
            pass


def supervise_children(children_of: Callable[[int], list[Child]], *, reload: bool = False) -> int:
    """Run the children of bank 0 until SIGTERM / SIGINT; with `reload`, SIGHUP rolls them to the
    other bank. 0 if every child (old generations included) exited cleanly."""
    stopping: list[int] = []
    hups: list[int] = []
    bank = 0
    ready_dir = tempfile.mkdtemp(prefix="jet-ready-")

    def generation(bank: int) -> tuple[list[Child], dict[int, subprocess.Popen], list[str]]:
        spec = children_of(bank)
        flags = [os.path.join(ready_dir, f"{bank}-{i}") for i in range(len(spec))]
        for f in flags:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f)
        spec = [dataclasses.replace(c, env={**c.env, READY_ENV: f}) for c, f in zip(spec, flags)]
        return spec, {i: _spawn(c) for i, c in enumerate(spec)}, flags

    spec, procs, flags = generation(bank)
    waiting: list[subprocess.Popen] = []  # the old generation, serving until the new one is ready
    roll_deadline = 0.0
    draining: list[subprocess.Popen] = []  # old generations, told to drain
    codes: list[int] = []
    delays = {i: RESTART_DELAY_S[0] for i in procs}
    restart_at: dict[int, float] = {}

    def forward(sig, _frame):
        stopping.append(sig)
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        if len(stopping) > 1:  # told twice: the draining ones too exit at once
            for p in draining:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    if reload:
        old[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda _sig, _frame: hups.append(1))
    try:
        while True:
            for p in [p for p in draining if p.poll() is not None]:
                draining.remove(p)
                codes.append(p.returncode)
                log.info("old worker %d exited with %s", p.pid, p.returncode)
            alive = [p for p in procs.values() if p.poll() is None]
            if stopping and not alive and not draining and not waiting:
                break
            if hups and not stopping and not draining and not waiting:  # roll: start the new generation
                hups.clear()
                bank ^= 1
                waiting = [p for p in procs.values() if p.poll() is None]
                codes += [0] * (len(procs) - len(waiting))  # crashed ones waiting for a restart: replaced now
                spec, procs, flags = generation(bank)
                log.info("SIGHUP: started %d new worker(s) (bank %d)", len(spec), bank)
                delays, restart_at = {i: RESTART_DELAY_S[0] for i in procs}, {}
                roll_deadline = time.monotonic() + READY_TIMEOUT_S
                continue
            if waiting and (stopping or time.monotonic() > roll_deadline or all(map(os.path.exists, flags))):
                if not stopping and not all(map(os.path.exists, flags)):
                    log.warning("new workers not ready after %.0fs; draining the old ones anyway", READY_TIMEOUT_S)
                log.info("draining %d old worker(s)", len(waiting))
                for p in waiting:  # then drain the old one
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                draining += waiting
                waiting = []
            for i, p in procs.items():
                if not stopping and p.poll() is not None and i not in restart_at:
                    log.warning("worker %d exited with %s; restarting in %.0fs", i, p.returncode, delays[i])
                    restart_at[i] = time.monotonic() + delays[i]
                    delays[i] = min(RESTART_DELAY_S[1], delays[i] * 2)
            for i, when in list(restart_at.items()):
                if not stopping and time.monotonic() >= when:
                    procs[i] = _spawn(spec[i])
                    del restart_at[i]
            time.sleep(0.2)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        shutil.rmtree(ready_dir, ignore_errors=True)
    codes += [p.returncode for p in procs.values()]
    return 0 if all(c == 0 for c in codes) else 1


async def watch_parent(stop: anyio.Event, every_s: float = 1.0) -> None:
    """Set `stop` (drain) once the supervisor that started this process is gone."""
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if not supervisor:
        return
    while not stop.is_set():
        if os.getppid() != int(supervisor):
            log.warning("supervisor %s is gone: draining", supervisor)
            stop.set()
        with anyio.move_on_after(every_s):
            await stop.wait()


def run_until_signal(main: Callable[[anyio.Event], Awaitable[None]]) -> None:
    """`anyio.run` of `main(stop)`, with SIGTERM/SIGINT setting `stop` (a second one exits at once),
    as does the death of the `-n` supervisor that started this process."""
    from jet.queues.serve import watch_signals

    async def runner() -> None:
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_signals, stop)
            tg.start_soon(watch_parent, stop)
            await main(stop)
            tg.cancel_scope.cancel()

    anyio.run(runner)
