"""Roles waiting for an unreachable server obey SIGTERM (exit 0 with one line, no traceback), and a
refused password ends a role at once with a one-line error and the fatal exit code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from jet.queues.server import EmbeddedServer, free_port
from jet.supervisor import EXIT_FATAL
from tests.workers.conftest import ROOT, write_config

pytestmark = pytest.mark.slow  # every test here starts processes (tests/conftest.py: the process guard)
ROLES = {
    "infer": ["-m", "jet.workers.inference.worker"],
    "env": ["-m", "jet.workers.rollout.worker"],
    "train": ["-m", "jet.trainer.cli"],
    "gateway": ["-m", "jet.workers.gateway.app", "--port", "0"],
}


def start(role: str, config, url: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JET_LOG_LEVEL": "INFO", "JET_REDIS_URL": url}
    return subprocess.Popen([sys.executable, *ROLES[role], "--config", str(config)], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_line(p: subprocess.Popen, needle: str, timeout: float = 120) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stderr.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"no {needle!r} in:\n{''.join(lines)}")


@pytest.mark.parametrize("role", sorted(ROLES))
def test_sigterm_while_connecting_exits_zero_with_one_line(role, tiny_model, tmp_path, keys):
    config = tmp_path / "c.yaml"
    write_config(config, keys.run, tiny_model, [{"name": "guess", "workflow": "jet.tasks.guess:workflow"}])
    url = f"redis://:secret-77@127.0.0.1:{free_port()}/0"  # nothing listens there
    p = start(role, config, url)
    try:
        wait_line(p, "retrying in")  # it is waiting for the server
        t = time.monotonic()
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        waited = time.monotonic() - t
        rest = p.stderr.read()
    finally:
        p.kill()
    assert "Traceback" not in rest and "secret-77" not in rest
    assert "stopped before Redis at redis://:***@127.0.0.1" in rest.strip().splitlines()[-1]
    assert waited < 30


@pytest.mark.parametrize("role", ["env", "infer", "train"])
def test_a_refused_password_is_one_line_and_fatal(role, tiny_model, tmp_path, keys):
    config = tmp_path / "c.yaml"
    write_config(config, keys.run, tiny_model, [{"name": "guess", "workflow": "jet.tasks.guess:workflow"}])
    with EmbeddedServer(tmp_path / "srv", password="right-pw-1") as server:
        p = start(role, config, server.url.replace("right-pw-1", "wrong-pw-2"))
        try:
            code, err = p.wait(120), p.stderr.read()
        finally:
            p.kill()
    assert code == EXIT_FATAL, err
    assert "Traceback" not in err and "wrong-pw-2" not in err
    last = err.strip().splitlines()[-1]
    assert "error: authentication to Redis at redis://:***@127.0.0.1" in last and "failed" in last
