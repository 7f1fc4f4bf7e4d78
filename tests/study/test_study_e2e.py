"""A small study end to end, on real `jet up` runs: a verdict, a failing arm, an arm pruned at a rung.

One study (run once for the module) has four arms on two paired seeds, the
metric `train/lr` (logged exactly by the trainer, so every number is known):
- arms 0 (lr 2e-3) and 1 (lr 1e-3) are the hypothesis's treatment and control;
- arm 2 (lr 1e-5) is clearly worse: the halving pruner stops it at rung 2 while
  its first run is in flight (it would run 400 steps), and its second seed is never launched;
- arm 3 points at a model directory that does not exist: a bad config, so the
  arm fails with the reason and its runs never start, while the others finish.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import uuid

import pytest

from tests.study.conftest import ROOT, StudyProcs, base_config, study_state, write_study

pytestmark = pytest.mark.slow

STEPS = 8
LONG_STEPS = 400


@pytest.fixture(scope="module")
def finished(tmp_path_factory, redis_url, tiny_model):
    folder = tmp_path_factory.mktemp("e2e")
    base_config(folder, tiny_model, steps=STEPS)
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    good = str(tiny_model)
    arm = lambda lr, path=good, steps=STEPS: {"trainer.lr": lr, "trainer.steps": steps, "models.0.path": path}  # noqa
    # arm 2 would run LONG_STEPS steps: it cannot finish before the prune at rung 2 lands, however fast it runs
    arms = [arm(2e-3), arm(1e-3), arm(1e-5, steps=LONG_STEPS), arm(2e-3, path="/nonexistent/tiny")]
    path = write_study(folder, {
        "name": name, "arms": arms, "seeds": [0, 1],
        "metric": {"name": "train/lr", "summary": "final", "window": 1},
        "hypotheses": [{"name": "faster", "statement": "lr 2e-3 logs a higher train/lr than lr 1e-3",
                        "treatment": arms[0], "control": arms[1]}],
        "pruner": {"kind": "halving", "rungs": [2], "eta": 2, "min_seeds": 1},
        "budget": {"max_runs": 20, "max_concurrent_runs": 2}, "confirm": {"max_rounds": 0}})
    procs = StudyProcs(folder, redis_url)
    p = procs.start("run", "run", str(path), "--workers", "2", "--redis-url", redis_url)
    try:
        code = p.wait(600)
    except subprocess.TimeoutExpired:
        procs.stop_all()
        pytest.fail("the study did not finish in 600 s\n" + procs.dump())
    assert code == 0, procs.dump()
    study_dir = folder / "studies" / name
    rows = list(csv.DictReader(open(study_dir / "results.csv")))
    decisions = [json.loads(line) for line in (study_dir / "decisions.jsonl").read_text().splitlines()]
    return {"name": name, "dir": study_dir, "rows": rows, "decisions": decisions,
            "state": study_state(redis_url, name), "report": (study_dir / "report.md").read_text(),
            "dump": procs.dump()}


def by_arm(rows):
    out = {}
    for r in rows:
        out.setdefault(int(r["arm"]), {})[int(r["seed"])] = r
    return out


def test_two_arms_on_paired_seeds_reach_a_verdict(finished):
    arms = by_arm(finished["rows"])
    for arm in (0, 1):
        assert sorted(arms[arm]) == [0, 1], finished["dump"]  # both seeds: the comparison is paired
        for row in arms[arm].values():
            assert row["status"] == "completed" and int(row["steps"]) == STEPS, row
    assert float(arms[0][0]["summary"]) == pytest.approx(2e-3) and float(arms[1][1]["summary"]) == pytest.approx(1e-3)
    # Two paired differences of exactly 1e-3: the smallest two-sided Wilcoxon p with two seeds is 0.5,
    # so the honest verdict is inconclusive, and the report says so with the effect and its interval.
    line = next(ln for ln in finished["report"].splitlines() if ln.startswith("| faster |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4] == "2" and float(cells[5]) == pytest.approx(1e-3) and cells[-1] == "**inconclusive**"
    assert float(cells[8]) == pytest.approx(0.5)
    assert any(d["kind"] == "end" and "inconclusive" in d["why"] for d in finished["decisions"])
    for png in ("curves.png", "forest.png", "pruning.png"):
        assert (finished["dir"] / png).stat().st_size > 5000


def test_every_run_is_launched_and_counted_once(finished):
    state = finished["state"]
    names = [r["run"] for r in finished["rows"]]
    assert len(names) == len(set(names)) == len(state["launched"])
    assert state["runs_added"] == len(state["launched"])  # one request per run was ever added to the stream
    results = [r.run for r in state["results"]]
    assert len(results) == len(set(results)) == len(state["launched"])  # and one result each


def test_a_failing_arm_is_classified_and_reported_while_the_others_finish(finished):
    arms = by_arm(finished["rows"])
    bad = arms[3]
    assert bad[0]["status"] == "bad_config" and "no model directory" in bad[0]["reason"]
    assert all(r["status"] in ("bad_config", "cancelled") for r in bad.values())
    assert any(d["kind"] == "arm_failed" and d["arm"] == 3 for d in finished["decisions"])
    assert "arm 3 failed" in finished["report"] and "| 3 |" in finished["report"]
    assert all(r["status"] == "completed" for a in (0, 1) for r in arms[a].values())


def test_pruning_stops_a_clearly_worse_arm_at_a_rung(finished):
    arms = by_arm(finished["rows"])
    [prune] = [d for d in finished["decisions"] if d["kind"] == "prune"]
    assert prune["arm"] == 2 and prune["rung"] == 2 and prune["leader"] == 0
    assert list(arms[2]) == [0]  # its second seed was never launched: the slot went to other arms
    row = arms[2][0]
    assert row["status"] == "pruned" and 2 <= int(row["steps"]) < LONG_STEPS, row  # stopped mid-run
    [res] = [r for r in finished["state"]["results"] if r.trial == 2]
    assert res.curve and res.curve[-1][0] == int(row["steps"])  # its partial curve is kept
    assert "arm 2: rung 2" in finished["report"]


def test_no_more_runs_than_allowed_run_at_once(finished):
    spans = [(r.finished_at - r.duration_s, r.finished_at) for r in finished["state"]["results"] if r.duration_s]
    for t0, _ in spans:
        assert sum(1 for a, b in spans if a <= t0 < b) <= 2


def test_status_and_report_commands_read_the_finished_study(finished, redis_url):
    env_cmd = [sys.executable, "-m", "jet.cli", "study"]
    where = ["--redis-url", redis_url, "--studies-dir", str(finished["dir"].parent)]
    out = subprocess.run(env_cmd + ["status", finished["name"], *where], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "best so far: arm 0" in out.stdout and "budget left" in out.stdout
    (finished["dir"] / "report.md").unlink()
    out = subprocess.run(env_cmd + ["report", finished["name"], *where], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "**inconclusive**" in (finished["dir"] / "report.md").read_text()


def test_finished_runs_keep_their_outcome_metrics_and_newest_weights_only(finished):
    from jet.runs import RunDir, read_metrics
    from jet.study.execution import RESULT_FILE

    # worker.keep_files is left at its default (final_weights); every run checkpointed at every step
    ran = [r for r in finished["rows"] if r["status"] in ("completed", "pruned")]
    assert len(ran) == 5, finished["rows"]
    for row in ran:
        run = RunDir(finished["dir"] / "runs", row["run"])
        kept = json.loads((run.root / RESULT_FILE).read_text())
        assert kept["result"]["status"] == row["status"] and kept["request"]["run"] == row["run"]
        assert read_metrics(run.metrics("tiny"))[-1]["step"] == int(row["steps"])  # what the report reads
        assert not run.trainer_files("tiny").checkpoints.exists(), row["run"]
        assert len(run.versions("tiny")) == 1, row["run"]  # the newest only
        assert (run.trainer_files("tiny").ledger).is_dir()
