"""Errors no restart can fix end the swarm with the error on the terminal, from every role.

Each role (env worker, inference worker, trainer, gateway, feeder) runs as a real process under a
real `jet.supervisor.Supervisor` against a real server that refuses it: a plain redis:// URL of a
cluster node whose run lives on another primary (MOVED), or a wrong password. Each must exit at
once with EXIT_FATAL (no restart, no quiet retry), and the supervisor's report must carry the
explanation. Then `jet up` itself, which must end non-zero saying why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from jet.config import default_config_path
from jet.keys import Keys
from jet.supervisor import EXIT_FATAL, Child, Supervisor

ROOT = Path(__file__).resolve().parents[2]
PY = [sys.executable, "-m"]
ROLES = {  # the command of each role, before its --config
    "env": ["jet.workers.rollout.worker"],
    "infer": ["jet.workers.inference.worker", "--model", "tiny"],
    "trainer": ["jet.trainer.cli", "--model", "tiny"],
    "gateway": ["jet.workers.gateway.app", "--port", "0"],
    "feed": ["jet.cli", "feed"],
}
PASSWORD = "right-horse-41"


def run_on_other_node(cluster, prefix: str = "loud") -> str:
    """A run name whose hash slot is not served by node 0."""
    for i in range(1000):
        if cluster.node_of_key(Keys(f"{prefix}{i}").prefix) != 0:
            return f"{prefix}{i}"
    raise AssertionError("no run name maps off node 0")


def write_config(tmp_path: Path, run: str, model: Path) -> Path:
    cfg = yaml.safe_load(default_config_path().read_text())
    cfg.update(run=run, runs_dir=str(tmp_path / "runs"))
    cfg["models"][0]["path"] = str(model)
    cfg["tasks"][0]["concurrency"] = 2
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def supervise(role: str, config: Path, url: str, log: Path, timeout: float = 180) -> tuple[Supervisor, int]:
    """Run one role under a Supervisor until it stops; (supervisor, the role's exit code)."""
    child = Child(role, PY + ROLES[role] + ["--config", str(config)], cwd=str(ROOT),
                  env={"JET_REDIS_URL": url}, log=log)
    sup = Supervisor(lambda bank: [child]).start()
    deadline = time.monotonic() + timeout
    while sup.poll():
        if time.monotonic() > deadline:
            sup.stop()
            sup.wait(10)
            pytest.fail(f"{role} still running after {timeout}s against a refusing server:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    sup.close()
    [p] = sup.procs
    return sup, p.popen.returncode


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("role", list(ROLES))
def test_every_role_stops_on_moved_from_a_plain_url_to_a_cluster_node(role, cluster, tiny_model, tmp_path):
    config = write_config(tmp_path, run_on_other_node(cluster), tiny_model)
    sup, code = supervise(role, config, cluster.node_url(0), tmp_path / f"{role}.log")
    assert code == EXIT_FATAL, sup.failure
    assert sup.procs[0].crashes == 0  # stopped at the first fatal exit, never restarted
    assert f"{role} stopped with an error that restarting cannot fix" in sup.failure
    assert "MOVED" in sup.failure and "redis+cluster://" in sup.failure
    assert sup.exit_code() == 1


@pytest.mark.slow
@pytest.mark.parametrize("role", list(ROLES))
def test_every_role_stops_on_a_wrong_password(role, tiny_model, tmp_path):
    from jet.queues.server import EmbeddedServer

    with EmbeddedServer(tmp_path / "srv", password=PASSWORD) as server:
        config = write_config(tmp_path, "loudauth", tiny_model)
        bad = server.url.replace(PASSWORD, "wrong-pony-7")
        sup, code = supervise(role, config, bad, tmp_path / f"{role}.log")
    assert code == EXIT_FATAL, sup.failure
    assert sup.procs[0].crashes == 0
    assert "authentication to Redis at" in sup.failure and "failed" in sup.failure
    assert "wrong-pony-7" not in sup.failure  # the password is redacted


def jet_up(tmp_path: Path, config: Path, url: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "JET_REDIS_URL"}
    return subprocess.run(PY + ["jet.cli", "up", "--config", str(config), "--redis-url", url, "--episodes", "4",
                                "--no-live", "--run-dir", str(tmp_path / ".jet")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.cluster
@pytest.mark.slow
def test_up_with_a_plain_url_to_a_cluster_node_ends_with_the_moved_explanation(cluster, tiny_model, tmp_path):
    res = jet_up(tmp_path, write_config(tmp_path, run_on_other_node(cluster), tiny_model), cluster.node_url(0))
    assert res.returncode != 0
    assert "MOVED" in res.stderr and "redis+cluster://" in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_up_with_a_wrong_password_ends_with_the_auth_error(tiny_model, tmp_path):
    from jet.queues.server import EmbeddedServer

    with EmbeddedServer(tmp_path / "srv", password=PASSWORD) as server:
        res = jet_up(tmp_path, write_config(tmp_path, "upauth", tiny_model), server.url.replace(PASSWORD, "nope-3"))
    assert res.returncode != 0
    assert "authentication to Redis at" in res.stderr and "failed" in res.stderr, res.stderr[-3000:]
    assert "nope-3" not in res.stderr and "Traceback" not in res.stderr
