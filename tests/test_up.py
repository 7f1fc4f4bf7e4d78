"""`jet up` end to end: embedded server, real role processes, a short run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from jet.config import default_config_path
from jet.up import cli as up_cli

ROOT = Path(__file__).resolve().parents[1]


def write_config(tmp_path: Path, **trainer) -> Path:
    cfg = yaml.safe_load(default_config_path().read_text())
    cfg["run"] = "uptest"
    cfg["runs_dir"] = str(tmp_path / "runs")
    cfg["models"][0]["path"] = str(tmp_path / ".jet" / "models" / "tiny")
    cfg["tasks"][0]["concurrency"] = 4
    cfg["trainer"].update(trainer)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_dry_run_lists_the_roles(tmp_path):
    res = CliRunner().invoke(up_cli, ["--config", str(write_config(tmp_path)), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "infer-tiny: " in res.output and "jet.workers.infer" in res.output
    assert "env: " in res.output and "jet.workers.env" in res.output


def test_bad_config_names_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: {lr: fast}\n")
    res = CliRunner().invoke(up_cli, ["--config", str(bad), "--dry-run"])
    assert res.exit_code == 1 and "trainer.lr: expected float, got 'fast'" in res.output


@pytest.mark.slow
def test_short_up_runs_episodes_and_drains(tmp_path):
    config = write_config(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "JET_REDIS_URL"}
    res = subprocess.run([sys.executable, "-m", "jet.cli", "up", "--config", str(config), "--episodes", "8",
                          "--no-live", "--run-dir", str(tmp_path / ".jet")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "built tiny model" in res.stderr
    assert (tmp_path / ".jet" / "models" / "tiny" / "config.json").is_file()
    assert (tmp_path / "runs" / "uptest" / "config.resolved.yaml").is_file()
    import re

    seen = int(re.findall(r"trajectories (\d+)", res.stderr)[-1])
    assert seen >= 8
    assert "'env': 0" in res.stderr and "'infer-tiny': 0" in res.stderr  # every role drained cleanly
    logs = (tmp_path / "runs" / "uptest" / "logs" / "env.log").read_text()
    assert "env worker slot 0" in logs
