"""The study file: validation errors that name the path, --set overrides, grids; the Optuna journal; run
outcome classification (a pure function over the trainer's metrics lines)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jet.errors import ConfigError
from jet.study.execution import classify
from jet.study.messages import RunRequest
from jet.study.plan import Plan, repair_journal
from jet.study.studyfile import load_study, parse_study

BASE = {"name": "s", "question": "q", "base": "/x.yaml", "seeds": [0, 1],
        "space": {"trainer.objective": {"choices": ["ppo", "decoupled"]}, "trainer.batch_groups": {"low": 1, "high": 3}}}


@pytest.mark.parametrize("change, message", [
    ({"budget": {"max_runs": "x"}}, "budget.max_runs: expected int, got 'x'"),
    ({"budget": {"max_runz": 1}}, "budget.max_runz: unknown key"),
    ({"budget": {"max_runs": 0}}, "budget.max_runs: must be > 0, got 0"),
    ({"metric": {"mode": "up"}}, "metric.mode: expected one of 'max', 'min', got 'up'"),
    ({"seeds": [1, 1]}, "seeds: seeds must be a non-empty list of distinct"),
    ({"space": {"trainer.lr": {"low": 1e-3}}}, "space.trainer.lr: a range needs both low: and high:"),
    ({"space": {"trainer.lr": {"low": 0.0, "high": 1.0, "log": True}}}, "a log range needs low > 0"),
    ({"set": ["run=x"]}, "set: 'run' is set by the study worker for each run"),
    ({"planner": {"kind": "tpe"}}, "planner.trials: planner 'tpe' needs planner.trials"),
    ({"hypotheses": [{"name": "h", "statement": "s", "treatment": {"trainer.objective": "sgd", "trainer.batch_groups": 1},
                      "control": {"trainer.objective": "ppo", "trainer.batch_groups": 1}}]},
     "hypotheses[0].treatment.trainer.objective: 'sgd' is outside the space"),
    ({"hypotheses": [{"name": "h", "statement": "s", "treatment": {"trainer.objective": "ppo"},
                      "control": {"trainer.objective": "ppo", "trainer.batch_groups": 1}}]},
     "must set exactly trainer.objective, trainer.batch_groups"),
    ({"hypotheses": [{"name": "h", "statement": "s", "claim": "no_worse", "treatment": "best",
                      "control": {"trainer.objective": "ppo", "trainer.batch_groups": 1}}]},
     "claim 'no_worse' needs margin > 0"),
])
def test_errors_name_the_path(change, message):
    with pytest.raises(ConfigError) as e:
        parse_study({**BASE, **change})
    assert message in str(e.value)


def test_the_grid_and_membership():
    s = parse_study(BASE)
    assert len(s.grid()) == 6 and s.grid()[0] == {"trainer.objective": "ppo", "trainer.batch_groups": 1}
    assert s.contains({"trainer.objective": "ppo", "trainer.batch_groups": 3})
    assert not s.contains({"trainer.objective": "ppo", "trainer.batch_groups": 4})
    assert not s.contains({"trainer.objective": "ppo", "trainer.batch_groups": True})  # True is not 1
    assert not s.contains({"trainer.objective": "ppo"})


def test_file_overrides_and_relative_base(tmp_path):
    data = {**BASE, "base": "configs/base.yaml", "space": {"trainer.lr": {"low": 1e-4, "high": 1e-2, "log": True}},
            "planner": {"kind": "tpe", "trials": 4}}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    s = load_study(path, ["budget.max_runs=8", "space.trainer.lr.low=1e-3", "seeds=[3, 4, 5]"])
    assert s.budget.max_runs == 8 and s.space["trainer.lr"].low == 1e-3 and s.seeds == [3, 4, 5]
    assert s.base == str((tmp_path / "configs" / "base.yaml").resolve())
    with pytest.raises(ConfigError, match="s.yaml: budget.max_runs: expected int, got 'many'"):
        load_study(path, ["budget.max_runs=many"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_study(path, ["budget.max_runs"])
    path.write_text("name: [unclosed")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_study(path)


def test_a_torn_journal_line_is_cut_and_the_arms_survive(tmp_path):
    s = parse_study({**BASE, "space": {"trainer.objective": {"choices": ["ppo", "decoupled"]}}})
    plan = Plan(s, tmp_path)
    a = plan.ask({"trainer.objective": "ppo"})
    plan.tell(a.number, "complete", 0.5)
    journal = tmp_path / "optuna.jsonl"
    with open(journal, "ab") as f:
        f.write(b'{"op_code": 4, "worker_id"')  # a SIGKILL in the middle of an append
    repair_journal(journal)
    assert journal.read_bytes().endswith(b"\n")
    again = Plan(s, tmp_path)
    assert [(x.number, x.params, x.state) for x in again.arms()] == [(0, {"trainer.objective": "ppo"}, "complete")]
    assert again.ask({"trainer.objective": "ppo"}) is None  # asked before: never twice
    assert [x.number for x in again.arms()] == [0]
    assert b"pickle" not in journal.read_bytes()


def request(steps: int = 4) -> RunRequest:
    return RunRequest("s", "s-t0-s0", 0, 0, 0, {}, "/x.yaml", [], "rollout/reward_mean", None, steps, 60.0, 2, 10.0)


def rows(n: int, loss=True) -> list[dict]:
    return [{"step": i, "rollout/reward_mean": 0.1 * i, **({"train/loss": 1.0} if loss or i < 3 else {})}
            for i in range(1, n + 1)]


def test_outcomes_are_classified():
    req = request()
    assert classify(0, rows(4), req, None, False, "") == ("completed", "")
    assert classify(0, rows(4, loss=False), req, None, False, "")[0] == "diverged"  # a NaN loss is dropped
    assert classify(None, rows(2), req, "prune: rung 2", False, "") == ("pruned", "prune: rung 2")
    assert classify(0, rows(4), req, "prune: too late", False, "")[0] == "completed"  # it had finished
    assert classify(None, rows(2), req, None, True, "")[0] == "timeout"
    assert classify(1, rows(2), req, None, False, "")[0] == "retry"  # an infrastructure crash
    assert classify(1, [], req, None, False, "Error: trainer.lr: expected float")[0] == "bad_config"
    fatal = "jet up: env stopped with an error that restarting cannot fix (exit code 78); its last lines:"
    assert classify(1, [], req, None, False, fatal)[0] == "bad_config"
    status, why = classify(0, [{"step": i} for i in range(1, 5)], req, None, False, "")
    assert status == "bad_config" and "not in the trainer's metrics" in why


def test_a_held_out_metric_comes_from_the_evaluators_file(tmp_path):
    from jet.config import load
    from jet.study.execution import curve_of, source_path

    cfg = load({"runs_dir": str(tmp_path), "run": "r", "models": [{"name": "m", "path": "x"}]})
    assert source_path(cfg, None, "eval/add/reward_mean") == tmp_path / "r" / "trainer" / "m" / "eval.jsonl"
    assert source_path(cfg, None, "rollout/reward_mean") == tmp_path / "r" / "trainer" / "m" / "metrics.jsonl"
    req = RunRequest("s", "s-t0-s0", 0, 0, 0, {}, "/x.yaml", [], "eval/add/reward_mean", None, 4, 60.0, 2, 10.0)
    evals = [{"step": 2, "version": 2, "eval/add/reward_mean": 0.3}, {"step": 4, "version": 4,
                                                                      "eval/add/reward_mean": 0.5}]
    assert classify(0, rows(4), req, None, False, "", evals) == ("completed", ""), "no loss on the evaluator's lines"
    assert curve_of(evals, req.metric) == [(2, 0.3), (4, 0.5)]
    status, why = classify(0, rows(4), req, None, False, "", [])
    assert status == "bad_config" and "not in the evaluator's results (tasks[].eval)" in why


def test_the_builtin_studies_load():
    folder = Path(__file__).resolve().parents[2] / "jet" / "study" / "builtin"
    for path in folder.glob("*.yaml"):
        if "\nhypotheses:" in path.read_text():
            s = load_study(path)
            assert s.grid() and s.hypotheses
