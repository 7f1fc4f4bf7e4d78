"""`jet up` end to end: embedded server, real role processes, a short run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from jet.cli.up import cli as up_cli
from jet.config import default_config_path

ROOT = Path(__file__).resolve().parents[2]


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
    assert "infer-tiny: " in res.output and "jet.workers.inference.worker" in res.output
    assert "env: " in res.output and "jet.workers.rollout.worker" in res.output


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


@pytest.mark.slow
def test_a_jet_folder_where_jet_up_runs_shadows_nothing(tmp_path):
    """A `jet/` package in the folder `jet up` runs in (a checkout, a project of the same name) is not
    what the roles import: they start with `python -P` (jet.supervisor.python_module)."""
    shadow = tmp_path / "jet"
    (shadow / "configs").mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the folder jet/ shadowed the installed package')\n")
    (shadow / "configs" / "default.yaml").write_text("run: shadowed\n")
    env = {k: v for k, v in os.environ.items() if k not in ("JET_REDIS_URL", "JET_CONFIG", "PYTHONPATH")}
    jet = Path(sys.executable).parent / "jet"  # the console script, as a user runs it
    res = subprocess.run([str(jet), "up", "--steps", "2", "--set", "trainer.batch_groups=2", "--no-live",
                          "--no-dash"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = tmp_path / "runs" / "demo" / "trainer" / "tiny" / "metrics.jsonl"
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
    assert not (shadow / "configs" / ".jet").exists()  # the model was built where jet up ran
    assert (tmp_path / ".jet" / "models" / "tiny" / "config.json").is_file()


def test_each_cpu_role_gets_its_share_of_the_cores(tmp_path, monkeypatch):
    from jet.cli.up import roles_for, thread_shares
    from jet.config import load

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    data = yaml.safe_load(write_config(tmp_path).read_text())
    cfg = load(data)
    assert thread_shares(cfg, cores=2) == {"infer-tiny": 1, "train-tiny": 1}
    assert thread_shares(cfg, cores=16) == {"infer-tiny": 8, "train-tiny": 8}
    data["trainer"]["threads"] = 12
    assert thread_shares(load(data), cores=16) == {"infer-tiny": 4, "train-tiny": 12}
    data["models"][0]["device"] = "cuda"  # a GPU role needs no CPU threads: the trainer gets its 12
    assert thread_shares(load(data), cores=16) == {"train-tiny": 12}
    roles = {c.name: c for c in roles_for(cfg, "c.yaml", (), 1)}
    assert roles["infer-tiny"].env["OMP_NUM_THREADS"] == str(thread_shares(cfg)["infer-tiny"])
    assert "OMP_NUM_THREADS" not in roles["env"].env
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the caller's choice (a study's runs) wins over the share
    assert thread_shares(cfg, cores=16) == {}
