"""Starting and watching processes: Jet's one supervisor, and the child side of it.

Parent side: `Supervisor(children_of)` runs a generation of `Child` processes
(`children_of(bank)` lists them), each in its own session, and
- restarts a child that exits non-zero, with backoff (1 s doubling to 30 s; a
  child that has run for a minute counts as healthy again), until it crashes
  `max_restarts` times in a row: that crash loop, or one exit with EXIT_FATAL
  (a bad config, refused credentials, the wrong server: `jet.errors.is_fatal`),
  ends the supervision: every child is stopped and `failure` names the child,
  its exit code and the last lines of its log;
- leaves a child that exits 0 on its own alone (it is done); once every
  `required` child is done (`jet up`'s trainers) the others are stopped, but
  a `lingers` child (`jet up`'s evaluator, which evaluates the final version)
  is left to finish by itself (`lingering()`; a second stop ends it too);
- an `optional` child (the evaluator) that crash-loops or exits with EXIT_FATAL
  is reported (`gave_up`) and left stopped: supervision goes on without it;
- `stop()` (SIGTERM/SIGINT in `run`) sends every child one SIGTERM (drain); a
  second stop forwards another, which makes the children exit at once. A
  `serves` child (`jet up`'s inference workers, which the env workers' episodes
  call) gets its SIGTERM only once the other children told to drain have
  exited: episodes still running when the drain began get their replies and
  finish, instead of waiting out their drain timeout on a server already gone;
- with `reload`, `roll()` (SIGHUP in `run`) starts the next generation on the
  other bank (0 <-> 1, so consumer names differ); once each new child called
  `mark_ready` (or READY_TIMEOUT_S passed) the old generation gets SIGTERM and
  drains. A roll asked for while an old generation still drains waits for it.
`run()` is the blocking loop of `jet worker ... -n N`; `jet up` calls `poll()`
from its own loop. What it is not: a restart policy for the whole machine
(systemd, docker compose `restart:` do that for the supervisor itself).

Child side: `run_role(main)` runs a role's `async main(stop)`; SIGTERM/SIGINT
or the supervisor's death set `stop` (a second signal exits at once). JetErrors
end the role with one line on stderr: exit 0 for `Stopped` (SIGTERM while still
connecting), EXIT_FATAL for fatal errors, 1 otherwise. A torch role on the CPU
calls `check_threads` once its torch thread count is set: it records the count
in a folder of this host's temporary directory (`jet-threads-<uid>/<pid>`) and
logs a warning when the live torch roles recorded there use more threads in all
than the host has cores (roles started by hand each take torch's default, every
core; `jet up` splits the cores, `jet.cli.up.thread_shares`). Roles in
containers with their own /tmp do not see each other.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

log = logging.getLogger(__name__)

EXIT_FATAL = 78  # EX_CONFIG: restarting cannot help; the supervisor stops and reports
RESTART_DELAY_S = (1.0, 30.0)  # first and largest delay before restarting a crashed child
HEALTHY_AFTER_S = 60.0  # a child up this long has its crash count reset
SUPERVISOR_ENV = "JET_SUPERVISOR_PID"  # set in children: the pid whose death makes them drain
READY_ENV = "JET_READY_FILE"  # set in children: the file `mark_ready` creates once serving
READY_TIMEOUT_S = 120.0  # on a roll, longest wait for the new generation before the old one drains
LOG_TAIL_LINES = 15


def python_module(module: str, python: str | None = None) -> list[str]:
    """The command line that runs `module` as a role: `python -P -m module` (this interpreter by default).

    `-P` (Python 3.11+, which jet requires) keeps the current folder off `sys.path`, so a folder
    named `jet/` where a role starts (a checkout, a project of the same name) cannot shadow the
    installed package. Agent code a task finds through its folder is put on `sys.path` by the env
    worker itself (`tasks[].runtime.cwd`)."""
    return [python or sys.executable, "-P", "-m", module]


@dataclass(frozen=True)
class Child:
    """One supervised process: a name (for messages), its command line, where it runs."""

    name: str
    argv: list[str]
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # added to the supervisor's environment
    log: Path | None = None  # stdout+stderr go here (appended); None: inherited
    required: bool = False  # supervision ends once every required child has exited 0
    optional: bool = False  # its failure is reported and it stays stopped; the others go on
    lingers: bool = False  # once the required children are done, it finishes by itself instead of being stopped
    serves: bool = False  # the others call it: a drain reaches it once the other drained children have exited


class _Proc:
    """A child and its process across restarts."""

    def __init__(self, child: Child, ready_file: str):
        self.child, self.ready_file = child, ready_file
        self.popen: subprocess.Popen | None = None
        self.started = 0.0
        self.crashes = 0
        self.restart_at: float | None = None
        self.done = False  # exited 0 (or after stop): not restarted

    def spawn(self, env: dict[str, str]) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.ready_file)
        out = open(self.child.log, "ab") if self.child.log else None
        # Own session: a terminal's Ctrl-C reaches only the supervisor, which forwards ONE signal.
        self.popen = subprocess.Popen(
            self.child.argv, cwd=self.child.cwd, start_new_session=True,
            env={**env, **self.child.env, SUPERVISOR_ENV: str(os.getpid()), READY_ENV: self.ready_file},
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT if out else None)
        if out:
            out.close()
        self.started, self.restart_at = time.monotonic(), None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def ready(self) -> bool:
        return os.path.exists(self.ready_file)

    def signal(self, sig: int) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)

    def tail(self) -> str:
        if not self.child.log or not self.child.log.exists():
            return "(its output went to this terminal)"
        lines = self.child.log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        return "\n".join("    " + line for line in lines) + f"\n  (log: {self.child.log})"


class Supervisor:
    def __init__(self, children_of: Callable[[int], list[Child]], *, reload: bool = False,
                 max_restarts: int = 5, env: dict[str, str] | None = None,
                 restart_delay_s: tuple[float, float] = RESTART_DELAY_S):
        self.children_of, self.reload, self.max_restarts = children_of, reload, max_restarts
        self.restart_delay_s = restart_delay_s
        self.env = dict(os.environ if env is None else env)
        self.bank = 0
        self.gen: list[_Proc] = []
        self.waiting: list[_Proc] = []  # an old generation serving until the new one is ready
        self.draining: list[_Proc] = []  # old generations told to drain
        self.codes: list[int] = []  # exit codes of old generations and replaced children
        self.stops = 0
        self.failure: str | None = None
        self.gave_up: list[str] = []  # optional children left stopped after failing, and why
        self.required_done = False  # every required child finished (the stop that spares lingering ones)
        self._serving_left: list[_Proc] = []  # `serves` children whose drain waits for the others to exit
        self._drained: list[_Proc] = []  # the other children the first stop told to drain
        self._roll_deadline = 0.0
        self._roll_asked = False
        self._ready_dir = tempfile.mkdtemp(prefix="jet-ready-")

    # -- control ---------------------------------------------------------------

    def start(self) -> "Supervisor":
        self.gen = self._generation(self.bank)
        return self

    def _generation(self, bank: int) -> list[_Proc]:
        procs = [_Proc(c, os.path.join(self._ready_dir, f"{bank}-{i}")) for i, c in enumerate(self.children_of(bank))]
        for p in procs:
            if p.child.log:
                p.child.log.parent.mkdir(parents=True, exist_ok=True)
            p.spawn(self.env)
        return procs

    def stop(self, *, spare_lingering: bool = False) -> None:
        """Drain every child (first call; `spare_lingering`: not the `lingers` ones, which finish by
        themselves; `serves` ones once the others drained, in `poll`); exit them at once (second call)."""
        self.stops += 1
        told = [p for p in self.gen + self.waiting + (self.draining if self.stops > 1 else [])
                if not (spare_lingering and p.child.lingers)]
        self._serving_left = [p for p in told if p.child.serves] if self.stops == 1 else []
        for p in told:
            if p not in self._serving_left:
                p.signal(signal.SIGTERM)
        self._drained = [p for p in told if not p.child.serves]

    def lingering(self) -> list[str]:
        """The `lingers` children still running after the required ones finished (none after any other stop)."""
        if not self.required_done or self.stops > 1:
            return []
        return [p.child.name for p in self.gen if p.child.lingers and p.alive]

    def roll(self) -> None:
        """Start the next generation (with `reload`); the current one drains once it is ready."""
        if self.reload:
            self._roll_asked = True

    @property
    def procs(self) -> list[_Proc]:
        return self.gen

    # -- the loop ---------------------------------------------------------------

    def poll(self) -> bool:
        """One step of supervision; False once everything has exited."""
        now = time.monotonic()
        if self._serving_left and not any(p.alive for p in self._drained):
            for p in self._serving_left:  # the roles they serve have exited: the servers drain now
                p.signal(signal.SIGTERM)
            self._serving_left = []
        for p in [p for p in self.draining if not p.alive]:
            self.draining.remove(p)
            self.codes.append(p.popen.returncode)
            log.info("old %s (pid %d) exited with %s", p.child.name, p.popen.pid, p.popen.returncode)
        self._advance_roll(now)
        for p in self.gen:
            self._check(p, now)
        if self.stops == 0 and self.failure is None:
            required = [p for p in self.gen if p.child.required]
            if required and all(p.done for p in required):
                log.info("every required role finished: stopping the others")
                self.required_done = True
                self.stop(spare_lingering=True)
        alive = any(p.alive for p in self.gen + self.waiting + self.draining)
        pending_restart = any(p.restart_at is not None for p in self.gen) and self.stops == 0
        return alive or pending_restart

    def _check(self, p: _Proc, now: float) -> None:
        if p.alive:
            if now - p.started > HEALTHY_AFTER_S:
                p.crashes = 0
            return
        if p.done or p.popen is None:
            return
        if p.restart_at is not None:
            if self.stops == 0 and now >= p.restart_at:
                p.spawn(self.env)
            return
        code = p.popen.returncode
        if code == 0 or self.stops:
            p.done = True
            return
        if code == EXIT_FATAL:
            return self._fail(p, "stopped with an error that restarting cannot fix")
        p.crashes += 1
        if p.crashes > self.max_restarts:
            return self._fail(p, f"crashed {p.crashes} times in a row")
        if p.child.optional and p.crashes == 1:
            log.warning("%s (optional) exited with %s; the other roles go on", p.child.name, code)
        first, largest = self.restart_delay_s
        delay = min(largest, first * 2 ** (p.crashes - 1))
        log.warning("%s exited with %s; restarting in %.0fs (crash %d of %d)", p.child.name, code, delay,
                    p.crashes, self.max_restarts)
        p.restart_at = now + delay

    def _fail(self, p: _Proc, why: str) -> None:
        p.done = True
        message = f"{p.child.name} {why} (exit code {p.popen.returncode}); its last lines:\n{p.tail()}"
        if p.child.optional:  # reported and left stopped; the others go on
            self.gave_up.append(message)
            log.error("%s\n  %s is optional: left stopped, the other roles go on", message, p.child.name)
            return
        self.failure = message
        log.error("%s", self.failure)
        self.stop()

    def _advance_roll(self, now: float) -> None:
        if self._roll_asked and self.stops == 0 and not self.waiting and not self.draining:
            self._roll_asked = False
            self.bank ^= 1
            self.waiting = [p for p in self.gen if p.alive]
            self.codes += [0 for p in self.gen if not p.alive]  # crashed ones waiting for a restart: replaced now
            self.gen = self._generation(self.bank)
            self._roll_deadline = now + READY_TIMEOUT_S
            log.info("rolling: started %d new process(es) (bank %d)", len(self.gen), self.bank)
        if self.waiting and (self.stops or now > self._roll_deadline or all(p.ready for p in self.gen)):
            if not self.stops and not all(p.ready for p in self.gen):
                log.warning("new processes not ready after %.0fs; draining the old ones anyway", READY_TIMEOUT_S)
            log.info("draining %d old process(es)", len(self.waiting))
            for p in self.waiting:
                p.signal(signal.SIGTERM)
            self.draining += self.waiting
            self.waiting = []

    def exit_code(self) -> int:
        """0 if every child (old generations included) exited cleanly and nothing failed."""
        if self.failure:
            return 1
        codes = self.codes + [p.popen.returncode for p in self.gen if p.popen is not None]
        return 0 if all(c == 0 for c in codes) else 1

    def wait(self, timeout: float) -> None:
        """After `stop()`: wait up to `timeout` for every child, then kill what is left."""
        deadline = time.monotonic() + timeout
        while self.poll() and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in self.gen + self.waiting + self.draining:
            if p.alive:
                log.warning("%s did not drain in %.0fs: killing it", p.child.name, timeout)
                p.popen.kill()
                p.popen.wait()
        self.close()

    def close(self) -> None:
        shutil.rmtree(self._ready_dir, ignore_errors=True)

    def run(self) -> int:
        """Supervise until everything exited (signals: TERM/INT stop, HUP rolls); the exit code."""
        handlers = {signal.SIGTERM: lambda *_: self.stop(), signal.SIGINT: lambda *_: self.stop()}
        if self.reload:
            handlers[signal.SIGHUP] = lambda *_: self.roll()
        old = {s: signal.signal(s, h) for s, h in handlers.items()}
        try:
            self.start()
            while self.poll():
                time.sleep(0.2)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.close()
        if self.failure:
            print(f"jet: {self.failure}", file=sys.stderr)
        return self.exit_code()


# -- the child side ---------------------------------------------------------------


def mark_ready() -> None:
    """Tell the supervisor (if any) that this process serves: a roll may drain the old generation."""
    path = os.environ.get(READY_ENV)
    if path:
        with open(path, "w"):
            pass


async def _watch_signals(stop) -> None:
    """Set `stop` on SIGTERM/SIGINT (drain); a second signal exits at once."""
    import anyio

    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for sig in signals:
            if stop.is_set():
                raise SystemExit(128 + sig)
            log.info("received %s: draining", signal.Signals(sig).name)
            stop.set()


async def _watch_parent(stop, every_s: float = 1.0) -> None:
    """Set `stop` (drain) once the supervisor that started this process is gone."""
    import anyio

    supervisor = os.environ.get(SUPERVISOR_ENV)
    if not supervisor:
        return
    while not stop.is_set():
        if os.getppid() != int(supervisor):
            log.warning("supervisor %s is gone: draining", supervisor)
            stop.set()
        with anyio.move_on_after(every_s):
            await stop.wait()


def run_role(main: Callable[..., Awaitable[None]], name: str = "jet") -> None:
    """Run `main(stop)` until it returns; SIGTERM/SIGINT or the supervisor's death set `stop`.

    Exits the process with one line on stderr for a JetError (EXIT_FATAL when fatal),
    and with 0 when stopped before the work could start (`Stopped`)."""
    import anyio

    from jet.errors import JetError, Stopped, is_fatal

    async def runner() -> None:
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_signals, stop)
            tg.start_soon(_watch_parent, stop)
            await main(stop)
            tg.cancel_scope.cancel()

    try:
        anyio.run(runner)
    except* Stopped as eg:
        print(f"{name}: {eg.exceptions[0]}", file=sys.stderr)
        raise SystemExit(0) from None
    except* JetError as eg:
        e = eg.exceptions[0]
        print(f"{name}: error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_FATAL if is_fatal(e) else 1) from None
    except* Exception as eg:  # a bug: the whole traceback, then what went wrong on the last line
        import traceback

        traceback.print_exception(eg)
        print(f"{name}: crashed: {'; '.join(_leaves(eg))}", file=sys.stderr)
        raise SystemExit(1) from None


def _leaves(e: BaseException) -> list[str]:
    """'Type: message' of each exception inside (nested) exception groups."""
    if isinstance(e, BaseExceptionGroup):
        return [leaf for sub in e.exceptions for leaf in _leaves(sub)]
    return [f"{type(e).__name__}: {e}"]


THREADS_DIR = "jet-threads"  # <tempdir>/jet-threads-<uid>/<pid>: the torch threads of each torch role of this host
_threads_warned = False


def host_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def torch_threads_on_host(threads: int, where: str | os.PathLike | None = None) -> dict[int, int]:
    """Record this process as a torch role using `threads` CPU threads; return every live one's {pid: threads}
    (the records of processes that are gone are deleted)."""
    folder = Path(where or tempfile.gettempdir()) / f"{THREADS_DIR}-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    mine = folder / str(os.getpid())
    if not mine.exists():
        atexit.register(mine.unlink, missing_ok=True)
    mine.write_text(str(threads))
    seen = {}
    for record in folder.iterdir():
        try:
            pid = int(record.name)
            os.kill(pid, 0)
            seen[pid] = int(record.read_text() or 0)
        except ProcessLookupError:
            record.unlink(missing_ok=True)
        except (ValueError, OSError):  # a record being written, or not one of ours
            continue
    return seen


def check_threads(role: str, threads: int, *, cores: int | None = None,
                  where: str | os.PathLike | None = None) -> str | None:
    """Record this torch role's `threads` and warn (once a process; the warning is returned too) when the
    torch roles of this host use more CPU threads in all than it has cores: they would slow each other down."""
    global _threads_warned
    seen = torch_threads_on_host(threads, where)
    cores = cores or host_cores()
    total = sum(seen.values())
    if total <= cores or _threads_warned:
        return None
    _threads_warned = True
    each = ", ".join(f"pid {pid}: {n}" for pid, n in sorted(seen.items()))
    message = (f"{role}: the {len(seen)} torch roles on this host use {total} CPU threads in all ({each}) on "
               f"{cores} cores, so they slow each other down; give each a share that sums to at most {cores} "
               f"(models[].threads, trainer.threads, or OMP_NUM_THREADS), as `jet up` does")
    log.warning("%s", message)
    return message
