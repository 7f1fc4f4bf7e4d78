"""Running worker processes: `-n N` supervision, queue settings, the run-until-signal loop.

What it is: `supervise(argv_of, n)` starts N copies of a worker (slots
0..N-1, each a plain `python -m jet.workers.<role> ... --slot i` that also runs
alone, in its own session), turns SIGTERM / SIGINT into a SIGTERM for each of
them (drain), restarts one that dies on its own
(with backoff; it is disposable, its state lives in Redis) and returns once all
have exited after a signal. `run_until_signal` runs a worker's async main with a
stop event that SIGTERM sets (drain), as `jet.queues.serve.watch_signals` does.
`queue_settings` maps the config's queue section onto consumer settings.

What it is not: a process manager for several roles (`jet up` is).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from typing import Awaitable, Callable

import anyio

from jet.config import JetConfig
from jet.queues.consumer import Settings

log = logging.getLogger(__name__)

RESTART_DELAY_S = (1.0, 30.0)  # first and largest delay before restarting a crashed child
SUPERVISOR_ENV = "JET_SUPERVISOR_PID"  # set in children: the pid whose death makes them drain


def queue_settings(cfg: JetConfig, batch: int) -> Settings:
    """The consumer settings of `cfg.queues`, reading `batch` entries at a time."""
    q = cfg.queues
    return Settings(lease_ms=q.lease_ms, max_deliveries=q.max_deliveries, block_ms=q.block_ms, batch=batch,
                    marker_ttl_s=q.marker_ttl_s, max_entry_bytes=q.max_entry_bytes)


def _spawn(argv: list[str]) -> subprocess.Popen:
    # Own session: a terminal's Ctrl-C reaches only the supervisor, which forwards ONE
    # signal (a child told twice skips its drain and exits at once). The child drains
    # by itself if the supervisor dies (see watch_parent).
    env = {**os.environ, SUPERVISOR_ENV: str(os.getpid())}
    return subprocess.Popen(argv, start_new_session=True, env=env)


def supervise(argv_of: Callable[[int], list[str]], n: int) -> int:
    """Run `argv_of(slot)` for slots 0..n-1 until a signal; 0 if every child exited cleanly.

    SIGTERM or SIGINT to the supervisor sends SIGTERM to every child (drain); a
    second one is forwarded too, which makes the children exit at once.
    """
    stopping: list[int] = []
    procs = {slot: _spawn(argv_of(slot)) for slot in range(n)}
    delays = {slot: RESTART_DELAY_S[0] for slot in range(n)}
    restart_at: dict[int, float] = {}

    def forward(sig, _frame):
        stopping.append(sig)
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            alive = [p for p in procs.values() if p.poll() is None]
            if stopping and not alive:
                break
            for slot, p in procs.items():
                if not stopping and p.poll() is not None and slot not in restart_at:
                    log.warning("worker slot %d exited with %s; restarting in %.0fs", slot, p.returncode, delays[slot])
                    restart_at[slot] = time.monotonic() + delays[slot]
                    delays[slot] = min(RESTART_DELAY_S[1], delays[slot] * 2)
            for slot, when in list(restart_at.items()):
                if not stopping and time.monotonic() >= when:
                    procs[slot] = _spawn(argv_of(slot))
                    del restart_at[slot]
            time.sleep(0.2)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    codes = [p.returncode for p in procs.values()]
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
