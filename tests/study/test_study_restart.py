"""A hard crash of the study's machine: the runner and its embedded Redis are SIGKILLed; resuming loses nothing.

`jet study run` (no --redis-url) starts its Valkey in the study folder (AOF,
fsync every second). A scripted study worker (the same consumer commit as
`jet study worker`: ack + marker + result in one Lua call) finishes the first
two runs; once the AOF is fsynced past them (WAITAOF), the runner and the
server are SIGKILLed. `jet study resume NAME` starts a new server on the same
data: both results are there, unchanged, the runs in flight are still pending
(their requests were never acked), and the study ends with every run counted
once and no run launched twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid

import anyio
import pytest

from jet.keys import GROUP_STUDY, Keys
from jet.queues.connect import connect
from jet.queues.consumer import Consumer, Settings
from jet.queues.server import EmbeddedServer
from jet.study.messages import RunRequest, RunResult
from tests.study.conftest import StudyProcs, base_config, study_state, wait_until, write_study

pytestmark = pytest.mark.slow


async def finish(url: str, study: str, n: int, name: str) -> list[str]:
    """Commit results for up to `n` requests, as a study worker would; returns their run names."""
    keys = Keys.for_study(study)
    r, rb = await connect(url), await connect(url, block_ms=200)
    c = Consumer(r, rb, url, keys, keys.study_runs, GROUP_STUDY, name, Settings(block_ms=200, batch=1))
    await c.ensure_group()
    done: list[str] = []
    try:
        with anyio.fail_after(120):
            while len(done) < n:
                for d in await c.fetch(1):
                    req = RunRequest.from_payload(d.payload)
                    v = 2.0 if req.params["trainer.lr"] == 2e-3 else 1.0
                    res = RunResult(run=req.run, trial=req.trial, seed=req.seed, stage=req.stage, status="completed",
                                    curve=[(1, v)], steps=1, duration_s=0.1, finished_at=time.time())
                    await c.commit([(d, [(keys.study_results, res.to_fields())])])
                    done.append(req.run)
    finally:
        await r.aclose()
        await rb.aclose()
    return done


async def fsynced(url: str) -> None:
    """Until the server has fsynced its AOF past every write so far: WAITAOF after a write of our own, which
    the AOF holds after every earlier write (the server fsyncs once a second)."""
    r = await connect(url)
    try:
        await r.set("test:fsync-fence", 1)
        assert (await r.execute_command("WAITAOF", 1, 0, 10_000))[0] == 1, "the AOF was not fsynced in 10 s"
    finally:
        await r.aclose()


def test_a_crash_of_runner_and_redis_loses_nothing(tmp_path, tiny_model):
    base_config(tmp_path, tiny_model)
    name = f"crash-{uuid.uuid4().hex[:6]}"
    path = write_study(tmp_path, {
        "name": name, "space": {"trainer.lr": {"choices": [2e-3, 1e-3]}}, "seeds": [0, 1],
        "metric": {"name": "train/lr", "window": 1}, "budget": {"max_runs": 8, "max_concurrent_runs": 2}})
    folder = tmp_path / "studies" / name
    procs = StudyProcs(tmp_path, "")
    try:
        runner = procs.start("runner", "run", str(path), "--workers", "0")
        info = wait_until(lambda: (folder / "server.json").is_file() and json.loads((folder / "server.json").read_text()),
                          60, what="the embedded server")
        first = anyio.run(finish, info["url"], name, 2, "scripted-a")
        wait_until(lambda: len(study_state(info["url"], name)["launched"]) == 4, 60, what="the next two launches")
        before = {r.run: r for r in study_state(info["url"], name)["results"]}
        anyio.run(fsynced, info["url"])  # everything the runner wrote is in the AOF on disk
        runner.send_signal(signal.SIGKILL)
        runner.wait()
        os.kill(info["pid"], signal.SIGKILL)
        wait_until(lambda: not os.path.exists(f"/proc/{info['pid']}") or
                   open(f"/proc/{info['pid']}/stat").read().split()[2] == "Z", 30, what="the server to die")

        resumed = procs.start("resume", "resume", name, "--workers", "0", "--studies-dir", str(tmp_path / "studies"))
        url = wait_until(lambda: (folder / "server.json").is_file()
                         and json.loads((folder / "server.json").read_text())["pid"] != info["pid"]
                         and json.loads((folder / "server.json").read_text())["url"], 60, what="the new server")
        after = {r.run: r for r in study_state(url, name)["results"]}
        assert after == before and sorted(after) == sorted(first)  # both results survived, unchanged
        rest = anyio.run(finish, url, name, 2, "scripted-b")  # the two in flight were still pending
        assert resumed.wait(120) == 0, procs.dump()
        with EmbeddedServer(folder) as server:  # the runner stopped its server: read its data once more
            st = study_state(server.url, name)
        assert sorted(first + rest) == sorted(st["launched"]) == sorted(r.run for r in st["results"])
        assert len(st["launched"]) == 4 and st["runs_added"] == 4
        decisions = [json.loads(x) for x in (folder / "decisions.jsonl").read_text().splitlines()]
        assert sorted(d["arm"] for d in decisions if d["kind"] == "ask") == [0, 1]
    finally:
        procs.stop_all()
        live = folder / "server.json"
        if live.is_file():
            pid = json.loads(live.read_text())["pid"]
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)


def test_stop_pauses_the_study_and_resume_continues_it(tmp_path, redis_url, tiny_model):
    base_config(tmp_path, tiny_model)
    name = f"pause-{uuid.uuid4().hex[:6]}"
    path = write_study(tmp_path, {
        "name": name, "space": {"trainer.lr": {"choices": [2e-3, 1e-3]}}, "seeds": [0, 1],
        "metric": {"name": "train/lr", "window": 1}, "budget": {"max_runs": 8, "max_concurrent_runs": 2}})
    folder, where = tmp_path / "studies" / name, ["--redis-url", redis_url, "--studies-dir", str(tmp_path / "studies")]
    procs = StudyProcs(tmp_path, redis_url)
    try:
        runner = procs.start("runner", "run", str(path), "--workers", "0", "--redis-url", redis_url)
        anyio.run(finish, redis_url, name, 1, "scripted-a")
        assert procs.start("stop", "stop", name, *where).wait(60) == 0
        assert runner.wait(60) == 0
        assert "ended: paused" in (folder / "report.md").read_text()
        launched = len(study_state(redis_url, name)["launched"])
        time.sleep(2)  # a window to watch for launches (an absence: no condition to await)
        assert len(study_state(redis_url, name)["launched"]) == launched  # nothing launches while paused
        resumed = procs.start("resume", "resume", name, "--workers", "0", *where)
        rest = anyio.run(finish, redis_url, name, 3, "scripted-b")
        assert resumed.wait(60) == 0
        st = study_state(redis_url, name)
        assert len(rest) == 3 and sorted(r.run for r in st["results"]) == sorted(st["launched"])
        assert "ended: paused" not in (folder / "report.md").read_text()
    finally:
        procs.stop_all()
