"""Real faults in a running study: SIGKILL a study worker mid-run, then SIGKILL the runner mid-study.

The study (two arms, two paired seeds, 12-step runs) is driven by a runner
with no local workers and two study workers started here. Worker A is
SIGKILLed while its run is at step >= 4: its keeper drains that run's `jet up`
(the trainer checkpoints) and holds the run's lease until everything is gone;
another worker (C, started then, or B once free) reclaims the request after
the lease and resumes the run from its checkpoint. Then the runner is SIGKILLed while runs are in flight,
and `jet study resume` carries the study to its end. Every run has exactly one
request and one result, the resumed run's metrics hold each step once, no arm
was asked twice, and no process of any run is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

import pytest

from tests.study.conftest import base_config, study_state, wait_until, write_study

pytestmark = pytest.mark.slow

STEPS = 12


def keeper_runs(worker_pid: int) -> list[str]:
    """Runs whose keeper is a child of `worker_pid` (from /proc)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == worker_pid and b"jet.study.keeper" in argv:
            out.append(argv[argv.index(b"--run") + 1].decode())
    return out


def run_processes(study: str) -> list[int]:
    """Pids of any process still working for one of the study's runs."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                argv = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if f"run={study}-t".encode() in argv or f"--run\0{study}-t".encode() in argv:
                pids.append(int(proc.name))
    return pids


def test_sigkilled_worker_and_runner_lose_nothing_and_run_nothing_twice(tmp_path, redis_url, tiny_model,
                                                                       study_procs):
    base_config(tmp_path, tiny_model, steps=STEPS)
    name = f"faults-{uuid.uuid4().hex[:6]}"
    fast, slow = {"trainer.lr": 2e-3}, {"trainer.lr": 1e-3}
    path = write_study(tmp_path, {
        "name": name, "space": {"trainer.lr": {"choices": [2e-3, 1e-3, 5e-4]}}, "seeds": [0, 1],
        "planner": {"kind": "random", "trials": 2, "seed": 1},
        "metric": {"name": "train/lr", "window": 1},
        "hypotheses": [{"name": "faster", "statement": "2e-3 logs a higher lr", "treatment": fast, "control": slow}],
        "budget": {"max_runs": 10, "max_concurrent_runs": 2}, "confirm": {"max_rounds": 0}})
    folder = tmp_path / "studies" / name
    url = ["--redis-url", redis_url]
    runner = study_procs.start("runner", "run", str(path), "--workers", "0", *url)
    worker = lambda slot: study_procs.start(f"worker{slot}", "worker", name, "--slot", str(slot),  # noqa: E731
                                            "--dir", str(folder), *url)
    a, b = worker(0), worker(1)

    # 1. SIGKILL worker A while its run is past step 4
    def a_run_past_step_4():
        runs = keeper_runs(a.pid)
        steps = study_state(redis_url, name)["progress"]
        return runs and max(steps.get(runs[0], [0])) >= 4 and runs[0]
    victim = wait_until(a_run_past_step_4, 240, what="worker A's run to pass step 4")
    a.send_signal(signal.SIGKILL)
    a.wait()
    c = worker(2)  # reclaims the request once its lease (6 s) has expired

    # 2. SIGKILL the runner once a result is in and runs are still to come
    def some_done():
        st = study_state(redis_url, name)
        return st["results"] and len(st["results"]) < 4 and len(st["launched"]) > len(st["results"])
    wait_until(some_done, 300, what="a first result")
    runner.send_signal(signal.SIGKILL)
    runner.wait()
    resumed = study_procs.start("resume", "resume", name, "--workers", "0", "--studies-dir",
                                str(tmp_path / "studies"), *url)
    assert resumed.wait(480) == 0

    # Every run: one request, one result; all completed, on both seeds of both arms.
    st = study_state(redis_url, name)
    runs = sorted(st["launched"])
    assert runs == sorted(f"{name}-t{t}-s{s}" for t in (0, 1) for s in (0, 1))
    assert st["runs_added"] == 4
    assert sorted(r.run for r in st["results"]) == runs
    assert all(r.status == "completed" and r.steps == STEPS for r in st["results"]), st["results"]
    # The killed worker's run was reclaimed by another worker (B or C, whichever was free first) and
    # resumed from its checkpoint, not from the start.
    [again] = [r for r in st["results"] if r.run == victim]
    assert not again.worker.endswith("-study-0") and again.attempts >= 2 and again.resumed_from >= 3, again
    rows = [json.loads(x) for x in (folder / "runs" / victim / "trainer" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step once, in one lineage
    # No arm was asked twice: the journal holds two trials; each ask was decided once.
    journal = [json.loads(x) for x in (folder / "optuna.jsonl").read_text().splitlines()]
    assert sum(1 for op in journal if op["op_code"] == 4) == 2  # CREATE_TRIAL
    decisions = [json.loads(x) for x in (folder / "decisions.jsonl").read_text().splitlines()]
    assert sorted(d["arm"] for d in decisions if d["kind"] == "ask") == [0, 1]
    assert "every hypothesis" in decisions[-1]["why"] or "inconclusive" in decisions[-1]["why"]
    # Nothing of any run is left running.
    for p in (b, c):
        p.send_signal(signal.SIGTERM)
        assert p.wait(120) == 0
    wait_until(lambda: not run_processes(name), 60, what="every run process to end")
