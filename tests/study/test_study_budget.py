"""Budgets are enforced in code: the runner refuses launches past them and says why in the report."""

from __future__ import annotations

import csv
import json
import uuid

import pytest

from tests.study.conftest import base_config, study_state, wait_until, write_study
from tests.study.test_study_faults import run_processes

pytestmark = pytest.mark.slow


def grid_study(tmp_path, tiny_model, name: str, budget: dict, steps: int = 3) -> tuple:
    base_config(tmp_path, tiny_model, steps=steps)
    path = write_study(tmp_path, {
        "name": name, "space": {"trainer.lr": {"choices": [2e-3, 1e-3]}}, "seeds": [0, 1],
        "metric": {"name": "train/lr", "window": 1},
        "hypotheses": [{"name": "h", "statement": "s", "treatment": {"trainer.lr": 2e-3},
                        "control": {"trainer.lr": 1e-3}}],
        "budget": budget, "confirm": {"max_rounds": 2}})
    return path, tmp_path / "studies" / name


def test_max_runs_and_the_run_timeout_stop_the_study_with_the_reason(tmp_path, redis_url, tiny_model, study_procs):
    name = f"budget-{uuid.uuid4().hex[:6]}"
    # Two runs allowed, each stopped 12 s after it started: 400 steps cannot be done by then on any
    # machine (3 steps can: a fast trainer finished one within 12 s).
    path, folder = grid_study(tmp_path, tiny_model, name, {"max_runs": 2, "run_timeout_s": 12}, steps=400)
    p = study_procs.start("run", "run", str(path), "--workers", "2", "--redis-url", redis_url)
    assert p.wait(300) == 0
    st = study_state(redis_url, name)
    assert len(st["launched"]) == 2 and st["runs_added"] == 2  # the seed-0 pair, and nothing past the budget
    assert sorted(r.status for r in st["results"]) == ["timeout", "timeout"]
    assert all("timeout of 12 s" in r.reason for r in st["results"])
    assert all(12 <= r.duration_s < 12 + 90 for r in st["results"])
    report = (folder / "report.md").read_text()
    assert "refused: max_runs: 2 of 2 runs launched" in report
    assert "runs launched: 2 of 2" in report
    decisions = [json.loads(x) for x in (folder / "decisions.jsonl").read_text().splitlines()]
    assert any(d["kind"] == "refuse" and "max_runs" in d["why"] for d in decisions)
    assert "out of budget" in decisions[-1]["why"] or "max_runs" in report
    rows = list(csv.DictReader(open(folder / "results.csv")))
    assert [r["status"] for r in rows] == ["timeout", "timeout"]
    wait_until(lambda: not run_processes(name), 60, what="the timed-out runs' processes to end")


def test_the_wall_clock_budget_refuses_every_launch(tmp_path, redis_url, tiny_model, study_procs):
    name = f"wall-{uuid.uuid4().hex[:6]}"
    path, folder = grid_study(tmp_path, tiny_model, name, {"max_wall_hours": 1e-6})  # 3.6 ms
    p = study_procs.start("run", "run", str(path), "--workers", "0", "--redis-url", redis_url)
    assert p.wait(120) == 0
    assert study_state(redis_url, name)["launched"] == {}
    report = (folder / "report.md").read_text()
    assert "refused: max_wall_hours" in report and "ended: max_wall_hours" in report
