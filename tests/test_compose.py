"""docker-compose.yml is correct: its structure, and each service's command run locally.

No Docker engine runs on these machines, so each service's command is run as a
local process (cwd = a copy of the image's /app layout, JET_REDIS_URL = the
test server): one-shot services must exit 0, long-running roles must stay up
and drain on SIGTERM with exit 0. The redis service's arguments are given to
the embedded Valkey binary.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from jet.queues.server import binary, free_port

ROOT = Path(__file__).resolve().parents[1]
ROLES = {"feed", "infer", "env", "gateway", "trainer"}


def compose(name="docker-compose.yml") -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def test_structure():
    c = compose()
    assert set(c["services"]) == {"redis", "init"} | ROLES
    redis = c["services"]["redis"]
    args = redis["command"]
    assert args[args.index("--appendonly") + 1] == "yes" and "--requirepass" in args
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert "healthcheck" in redis and redis["volumes"]
    for name in ROLES | {"init"}:
        svc = c["services"][name]
        assert svc["build"] == "." and svc["command"][0] == "jet", name
        assert svc["environment"]["JET_REDIS_URL"].startswith("redis://:${REDIS_PASSWORD")
        assert "models:/app/.jet/models" in svc["volumes"] and "runs:/app/runs" in svc["volumes"]
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    # env scales with --scale env=N: no fixed name, no host ports.
    assert "container_name" not in c["services"]["env"] and "ports" not in c["services"]["env"]
    # The gateway is published on the host's loopback only.
    assert c["services"]["gateway"]["ports"] == ["127.0.0.1:8000:8000"]
    gpu = compose("docker-compose.gpu.yml")["services"]
    for name in ("infer", "trainer"):
        assert gpu[name]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    for folder in ("jet", "queues", "workers", "trainer", "configs"):
        assert f"COPY {folder} ./{folder}" in dockerfile


@contextlib.contextmanager
def redis_service(args: list[str], tmp_path: Path, password: str):
    """The compose file's redis command (`args`, variables resolved) run on the embedded Valkey binary,
    on a free loopback port: yields a client that has answered PING."""
    import redis

    port = free_port()
    p = subprocess.Popen([binary(), *args[1:], "--port", str(port), "--dir", str(tmp_path), "--bind", "127.0.0.1"],
                         stdout=subprocess.DEVNULL)
    try:
        r = redis.Redis(port=port, password=password)
        for _ in range(100):
            try:
                assert r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield r
    finally:
        p.terminate()
        p.wait(10)


def test_redis_service_arguments_start_a_real_server(tmp_path):
    import redis

    args = [a.replace("${REDIS_PASSWORD:?set REDIS_PASSWORD}", "pw") for a in compose()["services"]["redis"]["command"]]
    assert args[0] == "valkey-server"
    with redis_service(args, tmp_path, "pw") as r:
        assert r.config_get("appendonly") == {"appendonly": "yes"}
        assert r.config_get("appendfsync") == {"appendfsync": "everysec"}
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=r.connection_pool.connection_kwargs["port"]).ping()


@pytest.fixture
def app(tmp_path):
    """The image's /app layout: configs/ and a writable .jet/ and runs/."""
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    return tmp_path


def run_service(name: str, app: Path, url: str) -> subprocess.Popen:
    svc = compose()["services"][name]
    argv = [sys.executable, "-m", "jet.cli", *svc["command"][1:]]
    env = {k: v for k, v in os.environ.items() if k != "JET_CONFIG"}  # the service's config or the packaged one
    env.update({"JET_REDIS_URL": url, **{k: v for k, v in svc["environment"].items() if k == "JET_CONFIG"}})
    return subprocess.Popen(argv, cwd=app, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_every_service_command_runs(app, redis_url):
    init = run_service("init", app, redis_url)
    assert init.wait(120) == 0, init.stdout.read().decode()[-2000:]
    assert (app / ".jet" / "models" / "tiny" / "config.json").is_file()
    again = run_service("init", app, redis_url)  # a restart of the stack keeps the model
    assert again.wait(60) == 0 and b"left as it is" in again.stdout.read()
    procs = {name: run_service(name, app, redis_url) for name in sorted(ROLES)}
    try:
        time.sleep(20)  # every role starts: imports, model load, groups, gateway bind
        for name, p in procs.items():
            assert p.poll() is None, f"{name} exited early:\n{p.stdout.read().decode()[-3000:]}"
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        codes = {name: p.wait(90) for name, p in procs.items()}
    assert codes == {name: 0 for name in procs}, {n: procs[n].stdout.read().decode()[-1500:] for n in procs}
