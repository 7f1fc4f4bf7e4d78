"""docker-compose.yml is correct: its structure, and each service's command run locally.

Here each service's command is run as a local process (cwd = a copy of the
image's /app layout, JET_REDIS_URL = the test server): one-shot services must
exit 0, long-running roles must stay up and drain on SIGTERM with exit 0. The
redis service's arguments are given to the embedded Valkey binary. The stack
itself, under a real Docker engine with crashes, is scripts/compose-test.sh
(run by .ci/run after the suite).
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import pytest
import yaml

from jet.keys import Keys
from jet.queues import registry
from jet.queues.connect import connect
from jet.queues.server import binary, free_port
from tests.queues.helpers import eventually

ROOT = Path(__file__).resolve().parents[1]
ROLES = {"feed", "infer", "env", "gateway", "trainer"}
PASSWORD_VAR = "${REDIS_PASSWORD:?set REDIS_PASSWORD}"  # compose refuses to start without REDIS_PASSWORD


def compose(name="docker-compose.yml") -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def test_structure():
    c = compose()
    assert set(c["services"]) == {"redis", "init"} | ROLES
    redis = c["services"]["redis"]
    args = redis["command"]
    assert args[args.index("--appendonly") + 1] == "yes" and "--requirepass" in args
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert args[args.index("--requirepass") + 1] == redis["environment"]["REDIS_PASSWORD"] == PASSWORD_VAR
    assert "healthcheck" in redis and redis["volumes"]
    for name in ROLES | {"init"}:
        svc = c["services"][name]
        assert svc["build"] == "." and svc["command"][0] == "jet", name
        assert svc["environment"]["JET_REDIS_URL"] == f"redis://:{PASSWORD_VAR}@redis:6379/0", name
        assert "models:/app/.jet/models" in svc["volumes"] and "runs:/app/runs" in svc["volumes"]
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert name == "init" or svc["depends_on"]["init"]["condition"] == "service_completed_successfully"
    # compose stops dependents first: the clients of the inference worker drain while it still answers
    for name in ("env", "gateway"):
        assert c["services"][name]["depends_on"]["infer"] == {"condition": "service_started"}, name
    assert stop_waves(c["services"], ROLES) == [["env", "feed", "gateway", "trainer"], ["infer"]]
    # env scales with --scale env=N: no fixed name, no host ports.
    assert "container_name" not in c["services"]["env"] and "ports" not in c["services"]["env"]
    # The gateway is published on the host's loopback only.
    assert c["services"]["gateway"]["ports"] == ["127.0.0.1:8000:8000"]
    gpu = compose("docker-compose.gpu.yml")["services"]
    for name in ("infer", "trainer"):
        assert gpu[name]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    # Every volume a service mounts is declared; the image's WORKDIR is each role's working_dir.
    for name, svc in c["services"].items():
        assert {v.split(":")[0] for v in svc.get("volumes", [])} <= set(c["volumes"]), name
    steps = dockerfile()
    assert ("WORKDIR", ["/app"]) in steps and {c["services"][n]["working_dir"] for n in ROLES | {"init"}} == {"/app"}
    copied = [args for op, args in steps if op == "COPY"]
    for folder in ("jet", "queues", "workers", "trainer", "configs"):
        assert [folder, f"./{folder}"] in copied, copied
    # The CA bundle reaches pip only as a build secret, never through COPY/ADD/ENV (a layer).
    installs = [args for op, args in steps if op == "RUN" and args and args[0].startswith("--mount")]
    assert len(installs) == 2 and all("--mount=type=secret,id=ca" in args for args in installs), installs
    assert not [args for op, args in steps if op in ("COPY", "ADD", "ENV")
                and any("crt" in a or "CERT" in a for a in args)]
    assert ("ARG", ["BASE=python:3.11-slim"]) in steps and ("USER", ["jet"]) in steps


def dockerfile(name="Dockerfile") -> list[tuple[str, list[str]]]:
    """The Dockerfile's instructions as (INSTRUCTION, arguments): continuation lines joined, comments dropped."""
    text = (ROOT / name).read_text().replace("\\\n", " ")
    return [(line.split()[0].upper(), line.split()[1:]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_local_redis_override_changes_only_the_image_and_the_ping():
    """docker-compose.local-redis.yml: the redis service from the project image; the command (AOF,
    noeviction, password), the data volume and the health check's timing stay those of docker-compose.yml."""
    base, local = compose()["services"]["redis"], compose("docker-compose.local-redis.yml")["services"]
    assert set(local) == {"redis"}
    redis = local["redis"]
    assert redis["image"] == compose()["services"]["trainer"]["image"]
    assert set(redis) <= {"image", "pull_policy", "working_dir", "healthcheck"}, "command, volumes stay the base's"
    assert redis["working_dir"] == base["volumes"][0].split(":")[1], "valkey-server writes its AOF in the volume"
    assert set(redis["healthcheck"]) == {"test"} and "REDIS_PASSWORD" in redis["healthcheck"]["test"][1]


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


@pytest.mark.slow
def test_redis_service_arguments_start_a_real_server(tmp_path):
    import redis

    args = [a.replace(PASSWORD_VAR, "pw") for a in compose()["services"]["redis"]["command"]]
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


GATEWAY_PORT = "8000"  # the gateway's port in docker-compose.yml: in a container of its own, free


def run_service(name: str, app: Path, url: str, port: str = GATEWAY_PORT) -> subprocess.Popen:
    """The service's command as a local process; its `--port 8000` becomes `port` (on a shared machine, where
    8000 may be taken: test workers run in parallel, docker-compose.multinode.yml's gateway uses it too)."""
    svc = compose()["services"][name]
    argv = [sys.executable, "-m", "jet.cli", *[port if a == GATEWAY_PORT else a for a in svc["command"][1:]]]
    env = {k: v for k, v in os.environ.items() if k != "JET_CONFIG"}  # the service's config or the packaged one
    env.update({"JET_REDIS_URL": url, **{k: v for k, v in svc["environment"].items() if k == "JET_CONFIG"}})
    return subprocess.Popen(argv, cwd=app, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


async def roles_serving(url: str, procs: dict[str, subprocess.Popen], port: str, run: str = "demo",
                        logs: dict[str, Path] | None = None) -> set[str]:
    """The roles up in `run` (the packaged config's `demo`): the feed has topped up tasks:guess, env, infer
    and trainer beat in the worker registry, the gateway answers on its port (401: no key given); fails at
    once, with its output (or its log), when a role exits."""
    for name, p in procs.items():
        if p.poll() is not None:
            out = logs[name].read_text() if logs else p.stdout.read().decode()
            pytest.fail(f"{name} exited early:\n{out[-3000:]}")
    keys = Keys(run)
    r = await connect(url)
    try:
        up = {w["role"] for w in await registry.workers(r, keys, url=url) if w["alive"]} & ROLES
        if await r.xlen(keys.tasks("guess")):
            up.add("feed")
    finally:
        await r.aclose()
    async with httpx.AsyncClient() as client:
        with contextlib.suppress(httpx.HTTPError):
            if (await client.get(f"http://127.0.0.1:{port}/v1/models")).status_code == 401:
                up.add("gateway")
    return up


@pytest.mark.slow
def test_every_service_command_runs(app, redis_url):
    init = run_service("init", app, redis_url)
    assert init.wait(120) == 0, init.stdout.read().decode()[-2000:]
    assert (app / ".jet" / "models" / "tiny" / "config.json").is_file()
    again = run_service("init", app, redis_url)  # a restart of the stack keeps the model
    assert again.wait(60) == 0 and b"left as it is" in again.stdout.read()
    port = str(free_port())
    assert compose()["services"]["gateway"]["command"][-2:] == ["--port", GATEWAY_PORT]
    procs = {name: run_service(name, app, redis_url, port) for name in sorted(ROLES)}
    try:
        # imports, model load, groups, gateway bind: every role is up
        up: set[str] = set()

        async def all_up() -> bool:
            up.update(await roles_serving(redis_url, procs, port))
            return up == ROLES

        try:
            anyio.run(eventually, all_up, 180, 0.5)
        except TimeoutError:
            pytest.fail(f"after 180 s these roles were not up: {sorted(ROLES - up)}")
        for name, p in procs.items():
            assert p.poll() is None, f"{name} exited early:\n{p.stdout.read().decode()[-3000:]}"
    finally:
        codes = {}
        for wave in stop_waves(compose()["services"], set(procs)):  # as `docker compose stop` orders them
            for name in wave:
                procs[name].send_signal(signal.SIGTERM)
            codes.update({name: procs[name].wait(90) for name in wave})
    assert codes == {name: 0 for name in procs}, {n: procs[n].stdout.read().decode()[-1500:] for n in procs}


def stop_waves(services: dict, names: set[str]) -> list[list[str]]:
    """`names` in compose's stop order: each wave holds the services no service left running depends on."""
    left, waves = set(names), []
    while left:
        wave = sorted(n for n in left if not any(n in services[m].get("depends_on", {}) for m in left))
        assert wave, f"a dependency cycle among {sorted(left)}"
        waves.append(wave)
        left -= set(wave)
    return waves
