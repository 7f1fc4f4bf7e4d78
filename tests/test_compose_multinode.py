"""docker-compose.multinode.yml is correct: one profile per kind of node, and each service's command
run locally (as tests/test_compose.py does for docker-compose.yml: no Docker engine here).

Variables take the test's values (${VAR:-default} and ${VAR:?message} resolved like compose does),
`cuda` becomes `cpu`, and the trainer's torchrun line runs as a one-node, one-rank job.
"""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import yaml

from jet.config import default_config_path
from jet.queues.server import free_port
from tests.queues.helpers import eventually
from tests.test_compose import ROLES, redis_service, roles_serving
from tests.test_compose import compose as compose_file

ROOT = Path(__file__).resolve().parents[1]
FILE = ROOT / "docker-compose.multinode.yml"
PROFILES = {"redis": {"redis", "feed"}, "env": {"env", "gateway"}, "infer": {"infer"}, "trainer": {"trainer"}}
VAR = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def compose() -> dict:
    return compose_file(FILE.name)


def resolve(value: str, env: dict[str, str]) -> str:
    """What compose makes of ${VAR}, ${VAR:-default} and ${VAR:?error} with `env`."""
    def one(m: re.Match) -> str:
        name, op, arg = m.groups()
        if env.get(name):
            return env[name]
        if op == "?":
            raise KeyError(f"{name}: {arg}")
        return arg or ""
    return VAR.sub(one, value)


def test_structure():
    services = compose()["services"]
    by_profile = {}
    for name, svc in services.items():
        [profile] = svc["profiles"]
        by_profile.setdefault(profile, set()).add(name)
    assert by_profile == PROFILES
    args = services["redis"]["command"]
    assert args[args.index("--appendonly") + 1] == "yes" and "--requirepass" in args
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    for name, svc in services.items():
        if name == "redis":
            continue
        assert svc["environment"]["JET_REDIS_URL"].startswith("${JET_REDIS_URL:?"), name
        assert any(v.endswith(":/app/runs") for v in svc["volumes"]) and any(
            v.endswith(":/app/.jet/models") for v in svc["volumes"]), name
        assert "depends_on" not in svc  # Redis is on another machine: the roles wait for it themselves
    for name in ("infer", "trainer"):
        assert services[name]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    trainer = services["trainer"]["command"]
    assert trainer[0] == "torchrun" and trainer[trainer.index("--module") + 1] == "jet.trainer.cli"
    assert trainer[trainer.index("--backend") + 1] == "deepspeed" and "--node-rank" in trainer
    assert services["trainer"]["network_mode"] == "host"
    with pytest.raises(KeyError, match="JET_REDIS_URL"):  # a node without the URL refuses to start
        resolve(services["env"]["environment"]["JET_REDIS_URL"], {})


@pytest.mark.slow
def test_redis_service_arguments_start_a_real_server(tmp_path):
    args = [resolve(a, {"REDIS_PASSWORD": "pw"}) for a in compose()["services"]["redis"]["command"]]
    with redis_service(args, tmp_path, "pw") as r:
        assert r.config_get("appendonly") == {"appendonly": "yes"}
        assert r.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}


def local_argv(name: str, env: dict[str, str]) -> list[str]:
    """The service's command as a local process: on the CPU, and the gateway on $GATEWAY_PORT instead of
    8000 (parallel test workers share this machine; docker-compose.yml's gateway uses 8000 too)."""
    argv = [resolve(a, env) for a in compose()["services"][name]["command"]]
    argv = ["cpu" if a == "cuda" else env["GATEWAY_PORT"] if a == "8000" else a for a in argv]
    if argv[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    return [sys.executable, "-m", "jet.cli", *argv[1:]]


@pytest.mark.slow
def test_every_service_command_runs(tmp_path, redis_url):
    from jet.models import init_model

    run = f"multinode{os.getpid()}"  # its own keys on the session's server
    cfg = yaml.safe_load(default_config_path().read_text())
    cfg["models"][0]["path"] = str(tmp_path / ".jet" / "models" / "tiny")  # the volume's place in /app
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "default.yaml").write_text(yaml.safe_dump({**cfg, "run": run}))
    init_model(tmp_path / ".jet" / "models" / "tiny", seed=0)
    env = {"JET_REDIS_URL": redis_url, "ENV_PROCS": "2", "TRAINER_PORT": str(free_port()),
           "GATEWAY_PORT": str(free_port()),
           "TRAINER_MASTER": "127.0.0.1", "JET_CONFIG": "configs/default.yaml"}
    procs, logs = {}, {}
    for name in sorted(set().union(*PROFILES.values()) - {"redis"}):
        logs[name] = tmp_path / f"{name}.log"
        with open(logs[name], "wb") as out:
            procs[name] = subprocess.Popen(local_argv(name, env), cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                           env={**os.environ, **env}, start_new_session=True)
    try:
        # Every role is up (imports, model load, groups, gateway bind: as tests/test_compose.py checks)
        # and the trainer's rank has joined once its group exists (DeepSpeed builds its CPU comm op first).
        up: set[str] = set()

        async def all_up() -> bool:
            up.update(await roles_serving(redis_url, procs, env["GATEWAY_PORT"], run, logs))
            return up == ROLES and await trainer_group(redis_url, run)

        try:
            anyio.run(eventually, all_up, 300, 1.0)
        except TimeoutError:
            pytest.fail(f"after 300 s not up: {sorted(ROLES - up) or 'the trainer rank'}:\n"
                        + logs["trainer"].read_text()[-3000:])
    finally:
        # the inference node last, as docs/deployment.md says ("Stopping"): its clients' episodes get replies
        codes = {}
        for wave in (sorted(set(procs) - {"infer"}), ["infer"]):
            for name in wave:
                procs[name].send_signal(signal.SIGTERM)
            codes.update({name: procs[name].wait(120) for name in wave})
    assert codes == {**{n: 0 for n in codes}, "trainer": codes["trainer"]}, {
        n: logs[n].read_text()[-1500:] for n in codes}
    # torchrun forwards SIGTERM to its rank, which drains and exits 0; torchrun itself then reports
    # the signal (non-zero, as it does for any signal: compose's restart policy ignores a stop).
    trainer = logs["trainer"].read_text()
    assert "trainer of tiny stopped at step" in trainer and "got signal: 15" in trainer, trainer[-3000:]


async def trainer_group(url: str, run: str) -> bool:
    from jet.keys import GROUP_TRAINER, Keys
    from jet.queues.connect import connect

    r = await connect(url)
    try:
        key = Keys(run).traj("tiny")
        return bool(await r.exists(key)) and any(
            g["name"] == GROUP_TRAINER.encode() for g in await r.xinfo_groups(key))
    finally:
        await r.aclose()
