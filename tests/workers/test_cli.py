"""`jet worker env|infer`: the click commands answer help and refuse bad input with a message."""

import subprocess
import sys

import pytest
from click.testing import CliRunner

from jet.workers.cli import worker
from tests.workers.conftest import write_config


def test_worker_group_lists_env_and_infer():
    result = CliRunner().invoke(worker, ["--help"])
    assert result.exit_code == 0 and "env" in result.output and "infer" in result.output
    assert "-n INTEGER" in CliRunner().invoke(worker, ["infer", "--help"]).output
    assert "--drain-timeout" in CliRunner().invoke(worker, ["env", "--help"]).output


@pytest.mark.slow
def test_worker_modules_import_no_torch():
    code = ("import sys, jet.workers.cli, jet.workers.rollout.worker, jet.workers.inference.worker, jet.llm, jet.tasks.guess; "
            "heavy = sorted({'torch', 'transformers', 'vllm'} & set(sys.modules)); "
            "sys.exit(str(heavy) if heavy else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_bad_config_and_names_are_reported(tmp_path, keys):
    result = CliRunner().invoke(worker, ["env", "--config", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 1 and "no such config file" in result.output
    write_config(tmp_path / "c.yaml", keys.run, tmp_path, [{"name": "t", "workflow": "a.b:c"}])
    result = CliRunner().invoke(worker, ["env", "--config", str(tmp_path / "c.yaml"), "--task", "nope",
                                         "--redis-url", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 2 and "unknown task(s) ['nope']" in result.output
    result = CliRunner().invoke(worker, ["infer", "--config", str(tmp_path / "c.yaml"), "--model", "nope",
                                         "--redis-url", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 2 and "unknown model 'nope'" in result.output
