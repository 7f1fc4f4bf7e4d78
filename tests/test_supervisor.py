"""jet.supervisor on real processes: restarts with backoff, the crash-loop limit and fatal exits
(both naming the child and its last log lines), required children, SIGTERM drains, rolling."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jet.supervisor import EXIT_FATAL, READY_ENV, Child, Supervisor

pytestmark = pytest.mark.slow  # every test here starts processes (tests/conftest.py: the process guard)
FAST = (0.05, 0.2)  # restart delays for tests (s)


def script(tmp_path: Path, name: str, body: str) -> list[str]:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def drive(sup: Supervisor, until, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "condition not reached"
        sup.poll()
        time.sleep(0.02)


SLEEPER = """
    import signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(0.05)
"""


def test_a_crashing_child_is_restarted_with_backoff(tmp_path):
    count = tmp_path / "count"
    argv = script(tmp_path, "flaky", f"""
        import pathlib, signal, sys, time
        p = pathlib.Path({str(count)!r})
        n = int(p.read_text()) if p.exists() else 0
        p.write_text(str(n + 1))
        if n < 2:
            sys.exit(3)  # crash the first two times
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            time.sleep(0.05)
    """)
    sup = Supervisor(lambda bank: [Child("flaky", argv)], restart_delay_s=FAST).start()
    started = time.monotonic()
    drive(sup, lambda: count.exists() and count.read_text() == "3" and sup.procs[0].alive)
    assert time.monotonic() - started >= FAST[0] + 2 * FAST[0]  # waited 0.05 then 0.1 s between starts
    assert sup.failure is None and sup.procs[0].crashes == 2
    sup.stop()
    sup.wait(10)
    assert sup.exit_code() == 0  # the last run exited cleanly on SIGTERM


def test_a_crash_loop_ends_supervision_naming_the_child_and_its_last_lines(tmp_path):
    argv = script(tmp_path, "broken", """
        import sys
        print("loading the thing", flush=True)
        print("ValueError: the thing is broken", file=sys.stderr, flush=True)
        sys.exit(3)
    """)
    other = Child("bystander", script(tmp_path, "sleeper", SLEEPER), log=tmp_path / "bystander.log")
    sup = Supervisor(lambda bank: [Child("broken", argv, log=tmp_path / "broken.log"), other], max_restarts=2,
                     restart_delay_s=FAST).start()
    drive(sup, lambda: sup.failure is not None)
    assert "broken crashed 3 times in a row (exit code 3)" in sup.failure
    assert "ValueError: the thing is broken" in sup.failure and str(tmp_path / "broken.log") in sup.failure
    sup.wait(10)
    assert not sup.procs[1].alive  # everything else was stopped
    assert sup.exit_code() == 1


def test_a_fatal_exit_is_not_restarted(tmp_path):
    argv = script(tmp_path, "fatal", f"""
        import sys
        print("jet worker env: error: authentication to Redis at redis://:***@h:1/0 failed", file=sys.stderr)
        sys.exit({EXIT_FATAL})
    """)
    sup = Supervisor(lambda bank: [Child("env", argv, log=tmp_path / "env.log")], restart_delay_s=FAST).start()
    drive(sup, lambda: sup.failure is not None)
    assert "env stopped with an error that restarting cannot fix" in sup.failure
    assert "authentication to Redis" in sup.failure
    assert sup.procs[0].crashes == 0 and len((tmp_path / "env.log").read_text().splitlines()) == 1  # ran once


def test_required_children_done_stop_the_others(tmp_path):
    ready = tmp_path / "ready"  # the worker's SIGTERM handler is installed (a loaded machine starts it late)
    done = Child("trainer", script(tmp_path, "quick", f"""
        import pathlib, time
        while not pathlib.Path({str(ready)!r}).exists():
            time.sleep(0.02)
        print('trained')
    """), required=True)
    worker = Child("worker", script(tmp_path, "sleeper", SLEEPER.replace(
        "while True:", f"open({str(ready)!r}, 'w').close()\n    while True:")))
    sup = Supervisor(lambda bank: [done, worker], restart_delay_s=FAST).start()
    drive(sup, lambda: not sup.poll())
    assert sup.stops == 1 and sup.failure is None and sup.exit_code() == 0
    assert [p.popen.returncode for p in sup.procs] == [0, 0]


def test_an_optional_child_that_fails_is_left_stopped_and_a_lingering_one_finishes_by_itself(tmp_path):
    """The evaluator's place under `jet up`: its fatal exit (or crash loop) is reported and the run goes on;
    once the required children are done, a lingering child is not stopped but exits by itself."""
    go = tmp_path / "go"
    trainer = Child("trainer", script(tmp_path, "quick", f"""
        import pathlib, time
        while not pathlib.Path({str(go)!r}).exists():
            time.sleep(0.02)
    """), required=True)
    broken = Child("eval-a", script(tmp_path, "fatal", f"import sys; sys.exit({EXIT_FATAL})"), optional=True)
    finishing = Child("eval-b", script(tmp_path, "finishing", f"""
        import pathlib, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(5))  # a SIGTERM would show as exit 5
        while not pathlib.Path({str(go)!r}).exists():
            time.sleep(0.02)
        time.sleep(0.5)  # the final evaluation, after the trainer is done
        print('evaluated the final version')
    """), optional=True, lingers=True)
    sup = Supervisor(lambda bank: [trainer, broken, finishing], restart_delay_s=FAST).start()
    drive(sup, lambda: sup.gave_up)
    assert "eval-a stopped with an error that restarting cannot fix" in sup.gave_up[0]
    assert sup.failure is None and sup.procs[0].alive, "the required child runs on"
    go.touch()
    drive(sup, lambda: sup.required_done)
    assert sup.lingering() == ["eval-b"], "not stopped with the others"
    drive(sup, lambda: not sup.poll())
    assert sup.failure is None
    assert [p.popen.returncode for p in sup.procs] == [0, EXIT_FATAL, 0]


def test_a_serving_child_drains_once_the_children_it_serves_have_exited(tmp_path):
    """`jet up`'s inference worker and env worker: the env worker's drain finishes its running episode,
    which needs replies, so the server gets its SIGTERM only once the client has exited."""
    log = tmp_path / "order"
    server = Child("infer", script(tmp_path, "server", f"""
        import signal, sys, time
        def drain(*_):
            open({str(log)!r}, "a").write("server drained\\n")
            sys.exit(0)
        signal.signal(signal.SIGTERM, drain)
        while True:
            time.sleep(0.02)
    """), serves=True)
    client = Child("env", script(tmp_path, "client", f"""
        import signal, sys, time
        def drain(*_):
            time.sleep(0.5)  # the running episode, answered by the server
            open({str(log)!r}, "a").write("client finished its episode\\n")
            sys.exit(0)
        signal.signal(signal.SIGTERM, drain)
        while True:
            time.sleep(0.02)
    """))
    sup = Supervisor(lambda bank: [server, client], restart_delay_s=FAST).start()
    time.sleep(0.5)  # both installed their handlers
    sup.stop()
    assert sup.procs[0].alive, "the server was not told to drain with the others"
    drive(sup, lambda: not sup.poll())
    assert log.read_text().splitlines() == ["client finished its episode", "server drained"]
    assert [p.popen.returncode for p in sup.procs] == [0, 0] and sup.exit_code() == 0
    # a second stop reaches every child at once, servers included
    sup = Supervisor(lambda bank: [server, client], restart_delay_s=FAST).start()
    time.sleep(0.5)
    sup.stop()
    sup.stop()
    drive(sup, lambda: not any(p.alive for p in sup.procs), timeout=2.0)
    assert log.read_text().splitlines()[2] == "server drained", "the second stop made the server drain at once"


def test_run_drains_every_child_on_sigterm(tmp_path):
    marker = tmp_path / "drained"
    child = script(tmp_path, "drainer", f"""
        import pathlib, signal, sys, time
        def drain(*_):
            pathlib.Path({str(marker)!r}).write_text("yes")
            sys.exit(0)
        signal.signal(signal.SIGTERM, drain)
        sys.stdout.write("up\\n")  # one write: both children share the pipe, and under
        sys.stdout.flush()  # PYTHONUNBUFFERED print's two writes interleave ("upup")
        while True:
            time.sleep(0.05)
    """)
    runner = script(tmp_path, "runner", f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from jet.supervisor import Child, Supervisor
        sys.exit(Supervisor(lambda bank: [Child("a", {child!r}), Child("b", {child!r})]).run())
    """)
    p = subprocess.Popen(runner, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up" and p.stdout.readline().strip() == "up"
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 0 and marker.read_text() == "yes"


def test_roll_starts_the_next_bank_and_drains_the_old_one_once_it_is_ready(tmp_path):
    argv = script(tmp_path, "banked", f"""
        import os, pathlib, signal, sys, time
        bank = sys.argv[1]
        log = pathlib.Path({str(tmp_path)!r}) / f"bank{{bank}}.log"
        signal.signal(signal.SIGTERM, lambda *_: (log.write_text("drained"), sys.exit(0)))
        time.sleep(0.3)  # loading the new code
        open(os.environ[{READY_ENV!r}], "w").close()
        while True:
            time.sleep(0.05)
    """)
    sup = Supervisor(lambda bank: [Child(f"w{bank}", argv + [str(bank)])], reload=True, restart_delay_s=FAST).start()
    drive(sup, lambda: sup.procs[0].ready)
    sup.roll()
    drive(sup, lambda: sup.bank == 1)
    assert not (tmp_path / "bank0.log").exists()  # the old one serves until the new one is ready
    drive(sup, lambda: (tmp_path / "bank0.log").exists() and not sup.draining)
    assert sup.procs[0].child.name == "w1" and sup.procs[0].alive
    sup.stop()
    sup.wait(10)
    assert sup.exit_code() == 0 and os.path.exists(tmp_path / "bank1.log")


def test_a_role_that_crashes_names_every_cause_on_its_last_line():
    code = """
import anyio
from jet.supervisor import run_role

async def main(stop):
    async def boom(msg):
        raise ValueError(msg)
    async with anyio.create_task_group() as tg:
        tg.start_soon(boom, "one")
        async with anyio.create_task_group() as inner:
            inner.start_soon(boom, "two")
            await anyio.sleep(5)

run_role(main, "jet worker x")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1, p.stderr
    assert "Traceback" in p.stderr  # the whole story is kept above
    assert lines[-1].startswith("jet worker x: crashed: ") and "ValueError: one" in lines[-1] \
        and "ValueError: two" in lines[-1], lines[-1]
