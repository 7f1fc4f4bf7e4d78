"""The confirmation stage: inconclusive verdicts with budget left rerun the leading arms on new seeds.

The runner is the real `jet study run` (no local workers); the study worker
is scripted: it consumes the run requests and commits results with the
values this test chooses, through the same consumer commit (ack + marker +
result in one Lua call) as `jet study worker`, so the runner's staging is
tested in seconds rather than hours of runs.

Three arms on four screening seeds; arm lr=2e-3 beats lr=1e-3 by 1.0 on every
seed. Four seeds cannot decide (the smallest two-sided Wilcoxon p is 2/16), so:
- stage 1 reruns arms 2e-3 and 1e-3 on seeds 4-7: "fixed" (judged on all
  eight seeds) is supported; "best" (the leading arm of screening, judged on
  confirmation seeds only) has four and stays inconclusive;
- stage 2 reruns the two arms of "best" on seeds 8-11: supported on eight.
"""

from __future__ import annotations

import json
import uuid

import anyio
import pytest

from jet.keys import GROUP_STUDY, Keys
from jet.queues.connect import connect
from jet.queues.consumer import Consumer, Settings
from jet.study.messages import RunRequest, RunResult
from tests.study.conftest import StudyProcs, base_config, study_state, write_study

pytestmark = pytest.mark.slow  # every test here starts processes (tests/conftest.py: the process guard)


def value(req: RunRequest) -> float:
    return {2e-3: 2.0, 1e-3: 1.0, 5e-4: 0.5}[req.params["trainer.lr"]] + 0.01 * req.seed


async def scripted_worker(url: str, study: str, done: anyio.Event) -> int:
    keys = Keys.for_study(study)
    r, rb = await connect(url), await connect(url, block_ms=200)
    c = Consumer(r, rb, url, keys, keys.study_runs, GROUP_STUDY, "scripted", Settings(block_ms=200, batch=8))
    await c.ensure_group()
    handled = 0
    try:
        while not done.is_set():
            for d in await c.fetch():
                req = RunRequest.from_payload(d.payload)
                res = RunResult(run=req.run, trial=req.trial, seed=req.seed, stage=req.stage, status="completed",
                                curve=[(1, value(req) - 1), (2, value(req))], steps=2, duration_s=0.1)
                await c.commit([(d, [(keys.study_results, res.to_fields())])])
                handled += 1
    finally:
        await r.aclose()
        await rb.aclose()
    return handled


def test_inconclusive_verdicts_start_confirmation_rounds_until_decided(tmp_path, redis_url, tiny_model):
    base_config(tmp_path, tiny_model)
    name = f"confirm-{uuid.uuid4().hex[:6]}"
    fast, slow = {"trainer.lr": 2e-3}, {"trainer.lr": 1e-3}
    path = write_study(tmp_path, {
        "name": name, "space": {"trainer.lr": {"choices": [2e-3, 1e-3, 5e-4]}}, "seeds": [0, 1, 2, 3],
        "metric": {"name": "train/lr", "window": 1},
        "hypotheses": [
            {"name": "fixed", "statement": "2e-3 beats 1e-3", "treatment": fast, "control": slow},
            {"name": "best", "statement": "the best arm beats 1e-3", "treatment": "best", "control": slow}],
        "budget": {"max_runs": 40, "max_concurrent_runs": 6}, "confirm": {"max_rounds": 3, "seeds": 4}})
    procs = StudyProcs(tmp_path, redis_url)
    runner = procs.start("runner", "run", str(path), "--workers", "0", "--redis-url", redis_url)

    async def drive() -> int:
        done = anyio.Event()
        async with anyio.create_task_group() as tg:
            async def watch():
                with anyio.fail_after(180):
                    while runner.poll() is None:
                        await anyio.sleep(0.2)
                done.set()
            tg.start_soon(watch)
            return await scripted_worker(redis_url, name, done)

    try:
        handled = anyio.run(drive)
    finally:
        procs.stop_all()
    assert runner.returncode == 0, procs.dump()
    folder = tmp_path / "studies" / name
    decisions = [json.loads(x) for x in (folder / "decisions.jsonl").read_text().splitlines()]
    stages = {d["stage"]: d for d in decisions if d["kind"] == "stage"}
    assert sorted(stages) == [1, 2]
    assert stages[1]["seeds"] == [4, 5, 6, 7] and sorted(stages[1]["arms"]) == [0, 1]
    assert stages[1]["verdicts"] == {"fixed": "inconclusive", "best": "inconclusive"}
    assert stages[1]["best"] == {"best": 0}  # the leading arm of screening, chosen once
    assert stages[2]["seeds"] == [8, 9, 10, 11] and sorted(stages[2]["arms"]) == [0, 1]
    assert stages[2]["verdicts"] == {"fixed": "supported", "best": "inconclusive"}
    assert decisions[-1]["kind"] == "end" and decisions[-1]["why"] == "every hypothesis is decided"
    st = study_state(redis_url, name)
    assert handled == len(st["launched"]) == 3 * 4 + 2 * 4 + 2 * 4
    report = (folder / "report.md").read_text()
    fixed = next(ln for ln in report.splitlines() if ln.startswith("| fixed |")).split("|")
    best = next(ln for ln in report.splitlines() if ln.startswith("| best |")).split("|")
    # fixed: 12 seeds (4 screening + 8 confirmation); best: the 8 confirmation seeds only
    assert fixed[5].strip() == "12" and "supported" in fixed[-2]
    assert best[5].strip() == "8" and "supported" in best[-2] and "judged on confirmation seeds only" in report
    assert float(fixed[6]) == pytest.approx(1.0)  # every paired difference is (2.0 + s/100) - (1.0 + s/100)
