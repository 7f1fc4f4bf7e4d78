"""`jet init DIR`: the starter project it writes loads, refuses to be overwritten, and trains as it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from jet.cli.init import cli as init_cli
from jet.cli.init import run_name
from jet.config import load_file


def test_init_writes_a_project_whose_config_loads(tmp_path):
    res = CliRunner().invoke(init_cli, [str(tmp_path / "My Project")])
    assert res.exit_code == 0, res.output
    folder = tmp_path / "My Project"
    assert f"train it: jet up --config {folder / 'config.yaml'}" in res.output
    cfg = load_file(folder / "config.yaml")
    assert cfg.run == "My-Project" == run_name(folder)
    [task] = cfg.tasks
    assert (task.workflow, task.model, task.reward) == ("agent:workflow", "policy", None)
    # every path resolves against the project folder, not the folder jet runs in
    assert task.dataset == str(folder / "rows.jsonl") and task.runtime.cwd == str(folder)
    assert cfg.models[0].path == str(folder / ".jet" / "models" / "tiny")
    rows = [json.loads(line) for line in (folder / "rows.jsonl").read_text().splitlines()]
    assert len(rows) >= 32 and all(set(r) == {"question", "answer"} for r in rows)
    source = (folder / "agent.py").read_text()
    assert "openai.AsyncOpenAI(base_url=llm.openai_base_url, api_key=llm.openai_api_key)" in source


def test_init_never_overwrites_unless_forced(tmp_path):
    (tmp_path / "agent.py").write_text("mine\n")
    res = CliRunner().invoke(init_cli, [str(tmp_path)])
    assert res.exit_code == 1 and "agent.py already exist" in res.output
    assert (tmp_path / "agent.py").read_text() == "mine\n" and not (tmp_path / "config.yaml").exists()
    assert CliRunner().invoke(init_cli, [str(tmp_path), "--force"]).exit_code == 0
    assert "openai" in (tmp_path / "agent.py").read_text()


def test_the_starter_reward_gives_partial_credit(tmp_path):
    CliRunner().invoke(init_cli, [str(tmp_path)])
    sys.path.insert(0, str(tmp_path))
    try:
        import agent
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("agent", None)
    assert agent.reward(" 7.", 7) == 1.0 and agent.reward("It is 7, or 9", 7) == 1.0  # the first number counts
    assert agent.reward("5", 7) == pytest.approx(0.5 * (1 - 2 / 20))
    assert agent.reward("5", 7) > agent.reward("17", 7) > 0
    assert agent.reward("no idea", 7) == 0.0 and agent.reward("99", 7) == 0.0


@pytest.mark.slow
def test_jet_up_trains_the_starter_project_as_it_is(tmp_path):
    project, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("JET_REDIS_URL", "JET_CONFIG")}
    jet = [sys.executable, "-m", "jet.cli"]
    subprocess.run(jet + ["init", str(project)], cwd=elsewhere, env=env, check=True, capture_output=True)
    res = subprocess.run(jet + ["up", "--config", str(project / "config.yaml"), "--steps", "2", "--no-live"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=500)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"built tiny model at {project / '.jet' / 'models' / 'tiny'}" in res.stderr
    metrics = elsewhere / "runs" / "proj" / "trainer" / "policy" / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    # trained on episodes of the starter task, played by agent.py through the OpenAI SDK and the gateway
    assert all(s["counts/groups_trained/add"] > 0 and 0 <= s["rollout/reward_mean"] <= 1 for s in steps)
