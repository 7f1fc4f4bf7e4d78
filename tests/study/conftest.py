"""Fixtures of the study tests: a fast base Jet config (on tests/conftest.py's tiny_model), study files,
and `jet study` processes.

Runs are real `jet up` runs of a few trainer steps on the tiny model against
the session's Valkey (each study has its own namespace), so a study test
takes a minute or two; the metric is often `train/lr`, which the trainer logs
exactly, so verdicts and pruning have values known in advance.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
import yaml

from jet.keys import Keys
from jet.queues.connect import connect
from jet.study import ledger

ROOT = Path(__file__).resolve().parents[2]


def base_config(folder: Path, model: Path, steps: int = 3) -> Path:
    """A fast run: groups of 2 one-token-budget episodes, a checkpoint every step, short drains."""
    data = {"run": "base", "queues": {"lease_ms": 5000, "block_ms": 200},
            "models": [{"name": "tiny", "path": str(model), "max_batch": 8}],
            "tasks": [{"name": "guess", "workflow": "jet.tasks.guess:workflow", "dataset": "guess", "group_size": 2,
                       "concurrency": 4, "episode_timeout_s": 5, "max_retries": 1}],
            "trainer": {"lr": 2e-3, "batch_groups": 1, "micro_batch_tokens": 1024, "steps": steps,
                        "checkpoint_every": 1, "min_group_size": 2, "group_timeout_s": 20}}
    path = folder / "base.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def write_study(folder: Path, data: dict) -> Path:
    data = {"question": "a test study", "base": "base.yaml", "studies_dir": str(folder / "studies"),
            "worker": {"lease_s": 6, "stop_grace_s": 60}, **data}
    path = folder / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


class StudyProcs:
    """`jet study ...` processes of one test; their output goes to files shown when the test fails."""

    def __init__(self, folder: Path, url: str):
        self.folder, self.url, self.all = folder, url, []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        env = {**os.environ, "JET_REDIS_URL": self.url, "JET_LOG_LEVEL": "INFO", "OMP_NUM_THREADS": "1"}
        if not self.url:  # the study's own embedded server
            env.pop("JET_REDIS_URL")
        out = open(self.folder / f"{name}-{len(self.all)}.out", "w")
        p = subprocess.Popen([sys.executable, "-m", "jet.cli", "study", *args], cwd=self.folder, env=env,
                             stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.all.append(p)
        return p

    def stop_all(self) -> None:
        for p in self.all:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.all:
            try:
                p.wait(90)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def dump(self) -> str:
        parts = [f"--- {f.name}\n{f.read_text()[-4000:]}" for f in sorted(self.folder.glob("*.out"))]
        for f in sorted(self.folder.glob("studies/*/logs/*.log")):
            parts.append(f"--- {f.relative_to(self.folder)}\n{f.read_text(errors='replace')[-2500:]}")
        return "\n".join(parts)


@pytest.fixture
def study_procs(tmp_path, redis_url):
    p = StudyProcs(tmp_path, redis_url)
    yield p
    p.stop_all()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    procs = getattr(item, "funcargs", {}).get("study_procs")
    if report.when == "call" and report.failed and isinstance(procs, StudyProcs):
        report.sections.append(("study logs", procs.dump()))


def wait_until(predicate, timeout: float, every: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def study_state(url: str, study: str) -> dict:
    """What Redis holds for a study: launched runs, results, progress per run, stop requests."""
    async def read():
        r = await connect(url)
        keys = Keys.for_study(study)
        try:
            progress: dict[str, list] = {}
            for _, p in await ledger.progress(r, url, keys):
                progress.setdefault(p.run, []).append(p.step)
            return {"launched": await ledger.launched(r, url, keys),
                    "results": [x for _, x in await ledger.results(r, url, keys)],
                    "runs_added": int((await r.xinfo_stream(keys.study_runs))["entries-added"])
                    if await r.exists(keys.study_runs) else 0,
                    "progress": progress, "stops": await ledger.stops(r, url, keys)}
        finally:
            await r.aclose()
    return anyio.run(read)
