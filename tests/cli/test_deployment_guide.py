"""The deployment guide as a user follows it: docs/deployment.md's "By hand, per node" and the README's
"Scale out" are run, not paraphrased.

The guide marks each block a test runs with `<!-- guide:NAME -->` ... `<!-- /guide -->` around a fenced
`sh` block; `blocks` reads them, so a changed guide is a changed test. The slow test runs them as written,
each node in its own folder on this machine (a copy of the project folder each, nothing else in common but
the Redis URL and the read-only base model), with the substitutions the guide lists: the host `jet server`
names for `redis-host` (`jet.cli.server.reachable_host`, and the server must print that URL), a free port
for 6390 (parallel test workers share the machine), `cpu` for `cuda`, `-n 1` for `-n 16`; and, in the
project's config (the edit the guide asks for), the suite's tiny model, `adapter: {r: 4}` and two steps.
The README's block must be lines of the guide's blocks, so it cannot drift from what is run.

The fast tests check what the guide relies on in process: every command with `--run` takes the run from
$JET_CONFIG, the URL `jet server` prints, one port in every example, the thread warning.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import orjson
import pytest
import yaml
from click.testing import CliRunner

from jet.cli.main import main
from jet.cli.server import public_url, reachable_host
from jet.queues.connect import connect
from jet.queues.server import EmbeddedServer, free_port
from tests.queues.helpers import close, make_consumer

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "deployment.md"
README = ROOT / "README.md"
BLOCK = re.compile(r"<!-- guide:([\w-]+)[^>]*-->\n```sh\n(.*?)```\n<!-- /guide -->", re.DOTALL)
NODES = ("redis-node", "env-box", "infer-node", "trainer-node")


def blocks(page: Path) -> dict[str, str]:
    """The marked shell blocks of `page`, by name."""
    found = {}
    for name, text in BLOCK.findall(page.read_text()):
        assert name not in found, f"{page.name}: two blocks named {name}"
        found[name] = text
    return found


def commands(text: str) -> list[str]:
    """The command lines of a shell block, without comments and repeated spaces."""
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in text.splitlines()]
    return [" ".join(line.split()) for line in lines if line and not line.startswith("#")]


def substituted(text: str, host: str, port: int) -> str:
    """The guide's lines with the test's substitutions (the guide lists them)."""
    shown = f"[{host}]" if ":" in host else host
    text = text.replace("redis-host", shown).replace("6390", str(port)).replace("cuda", "cpu")
    return text.replace("-n 16", "-n 1")


def test_the_guide_has_every_block_and_the_readme_is_made_of_its_lines():
    guide = blocks(GUIDE)
    assert set(guide) == {"project", "every-node", *NODES, "operator"}
    readme = blocks(README)
    assert list(readme) == ["readme"]
    tested = {line for text in guide.values() for line in commands(text)}
    assert [line for line in commands(readme["readme"]) if line not in tested] == []


EXAMPLE_URL = re.compile(r"redis(?:\+cluster)?://[^\s/`'\"]*@[\w.-]+:(\d+)")


def test_one_port_in_every_example():
    from jet.cli.server import cli as server_cli

    [port] = {p.default for p in server_cli.params if p.name == "port"}
    pages = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "docker-compose.multinode.yml"]
    found = {(page.name, int(p)) for page in pages for p in EXAMPLE_URL.findall(page.read_text())}
    assert found and {p for _, p in found} == {port}, found
    assert '"${REDIS_BIND:-0.0.0.0}:6390:6379"' in (ROOT / "docker-compose.multinode.yml").read_text()


def test_jet_server_prints_a_url_other_nodes_can_use():
    host = reachable_host("0.0.0.0")
    assert host not in ("0.0.0.0", "::", "") and reachable_host("::") == host
    shown = f"[{host}]" if ":" in host else host
    assert public_url("redis://:pw@0.0.0.0:6390/0", "0.0.0.0") == f"redis://:pw@{shown}:6390/0"
    assert public_url("redis+cluster://0.0.0.0:7000/0", "0.0.0.0") == f"redis+cluster://{shown}:7000/0"
    assert public_url("redis://127.0.0.1:6390/0", "127.0.0.1") == "redis://127.0.0.1:6390/0"  # a bind address stays
    assert public_url("redis://:pw@10.1.2.3:6390/0", "10.1.2.3") == "redis://:pw@10.1.2.3:6390/0"


def test_every_command_with_run_takes_the_run_from_jet_config(redis_url, keys, tmp_path):
    src = keys.tasks("add")

    async def dead_letter():  # a real one: an entry without a schema version, read by a consumer
        c = await make_consumer(redis_url, keys, src)
        await c.r.xadd(src, {b"junk": b"1"})
        assert await c.fetch() == []
        await close(c)

    anyio.run(dead_letter)
    config = tmp_path / "c.yaml"
    config.write_text(f"run: {keys.run}\nmodels: [{{name: m, path: /nonexistent}}]\n"
                      "tasks: [{name: add, workflow: 'a:b', dataset: arith, group_size: 2, model: m}]\n")
    env = {"JET_CONFIG": str(config), "JET_REDIS_URL": redis_url, "JET_RUN": None}
    run = CliRunner().invoke
    res = run(main, ["dlq", "list"], env=env)
    assert res.exit_code == 0 and f"1 dead letter(s) in run '{keys.run}'" in res.output, res.output
    res = run(main, ["status", "--json"], env=env)
    assert [rep["run"] for rep in orjson.loads(res.output)] == [keys.run], res.output
    res = run(main, ["enqueue", "guess", "--dataset", "guess", "-n", "2"], env=env)  # not a task of the config
    assert res.exit_code == 0 and keys.tasks("guess") in res.output, res.output
    res = run(main, ["enqueue", "add", "-n", "2"], env=env)  # one of its tasks: its dataset and group size
    assert res.exit_code == 0 and f"enqueued 4 tasks (2 rows x 2) to {keys.tasks('add')}" in res.output, res.output
    res = run(main, ["dlq", "list", "--run", "other"], env=env)  # --run beats the config
    assert "0 dead letter(s) in run 'other'" in res.output
    res = run(main, ["dlq", "drop", "--all"], env=env)
    assert f"dropped 1 dead letter(s) of run '{keys.run}'" in res.output
    res = run(main, ["dlq", "list"], env={**env, "JET_CONFIG": str(tmp_path / "missing.yaml")})
    assert res.exit_code == 2 and "missing.yaml" in res.output and "does not exist" in res.output


def test_torch_roles_warn_when_they_oversubscribe_the_cores(tmp_path, monkeypatch, caplog):
    from jet import supervisor

    folder = tmp_path / f"{supervisor.THREADS_DIR}-{os.getuid()}"
    folder.mkdir()
    (folder / str(os.getppid())).write_text("2")  # another live torch role of this host (the test's parent)
    gone = folder / str(2**22 + 12345)  # a role that died without cleaning up: no such pid
    gone.write_text("8")
    monkeypatch.setattr(supervisor, "_threads_warned", False)
    assert supervisor.check_threads("infer", 2, cores=4, where=tmp_path) is None
    assert not gone.exists() and (folder / str(os.getpid())).read_text() == "2"
    with caplog.at_level("WARNING", logger="jet.supervisor"):
        message = supervisor.check_threads("infer", 3, cores=4, where=tmp_path)
    assert message and "2 torch roles on this host use 5 CPU threads in all" in message and "on 4 cores" in message
    assert message in caplog.text and "models[].threads, trainer.threads, or OMP_NUM_THREADS" in message
    assert supervisor.check_threads("infer", 3, cores=4, where=tmp_path) is None  # once a process


def role_env(tmp: Path) -> dict[str, str]:
    """A user's shell: `jet` on the PATH, no JET_* of the test's, one temporary directory (one machine)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JET_")}
    return {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", "TMPDIR": str(tmp),
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
def test_the_guide_runs_as_written_each_node_in_its_own_folder(tmp_path, tiny_model):
    guide = blocks(GUIDE)
    host, port = reachable_host("0.0.0.0"), free_port()
    (tmp_path / "tmp").mkdir()
    env = role_env(tmp_path / "tmp")

    # The project, and the config edit the guide asks for; then a copy on every node.
    (tmp_path / "src").mkdir()
    subprocess.run(["bash", "-ec", guide["project"]], cwd=tmp_path / "src", env=env, check=True, timeout=60)
    config_file = tmp_path / "src" / "myproject" / "config.yaml"
    cfg = yaml.safe_load(config_file.read_text())
    cfg["models"][0].update(path=str(tiny_model), adapter={"r": 4})
    cfg["trainer"].update(steps=2, batch_groups=2)
    config_file.write_text(yaml.safe_dump(cfg))
    folders = {}
    for node in (*NODES, "operator"):
        folders[node] = tmp_path / node
        shutil.copytree(tmp_path / "src" / "myproject", folders[node] / "myproject")

    def script(node: str) -> str:
        return substituted(f"set -e\n{guide['every-node']}{guide[node]}", host, port)

    procs, logs = {}, {}
    for node in (*NODES[1:], NODES[0]):  # the Redis node last: the others wait for it
        logs[node] = folders[node] / "node.log"
        with open(logs[node], "wb") as out:
            procs[node] = subprocess.Popen(["bash", "-c", script(node)], cwd=folders[node], env=env, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)

    def log(node: str) -> str:
        return logs[node].read_text(errors="replace")

    url = f"redis://:change-me@{f'[{host}]' if ':' in host else host}:{port}/0"
    try:
        deadline = time.monotonic() + 300
        served = None
        while served is None:
            served = re.search(r"policy: now serving weight version 2 \(step \d+\) from (\S+)", log("infer-node"))
            for node, p in procs.items():
                assert p.poll() is None or (node == "trainer-node" and p.returncode == 0), \
                    f"{node} exited with {p.returncode}:\n{log(node)[-3000:]}"
            assert time.monotonic() < deadline, {n: log(n)[-1500:] for n in procs}
            time.sleep(0.5)
        fetched = Path(served.group(1))
        assert fetched.is_relative_to(tmp_path / "tmp"), "the version came through Redis, not a shared folder"
        assert procs["trainer-node"].wait(120) == 0, log("trainer-node")[-3000:]
        assert f"JET_REDIS_URL=redis://:***@{url.split('@')[1]}" in log("redis-node")  # what the others used

        async def poison():  # an entry no env worker can read: it must show in `jet dlq list`
            r = await connect(url)
            await r.xadd("jet:{myproject}:tasks:add", {b"junk": b"1"})
            await r.aclose()

        anyio.run(poison)
        operator = None
        for _ in range(60):
            operator = subprocess.run(["bash", "-c", script("operator")], cwd=folders["operator"], env=env,
                                      capture_output=True, text=True, timeout=60, check=False)
            if "no schema version" in operator.stdout:
                break
            time.sleep(0.5)
        assert operator.returncode == 0 and "tasks:add" in operator.stdout, operator.stdout + operator.stderr
        assert "no schema version" in operator.stdout and "in run 'myproject'" in operator.stdout, operator.stdout
    finally:
        codes = {}
        for group in (NODES[1:], NODES[:1]):  # the roles first, then Redis, which their drain still needs
            for node in group:  # Ctrl-C, as in a terminal: the whole foreground process group
                if procs[node].poll() is None:
                    os.killpg(procs[node].pid, signal.SIGINT)
            codes |= {node: procs[node].wait(120) for node in group}
        for p in procs.values():  # what is left of a group (a background job ignores Ctrl-C) stops as a user would
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    assert codes == dict.fromkeys(procs, 0), {n: log(n)[-2000:] for n in procs}
    assert not fetched.parent.exists(), "the inference worker deleted the versions it fetched"
    assert "Traceback" not in "".join(log(n) for n in procs)


@pytest.mark.slow
def test_jet_feed_waits_for_redis(tmp_path, monkeypatch):
    """`jet server & jet feed`: the feeder may start first; it waits (with a warning) and then feeds."""
    port = free_port()
    url = f"redis://:pw@127.0.0.1:{port}/0"
    (tmp_path / "c.yaml").write_text("run: fed\nmodels: [{name: m, path: /nonexistent}]\n"
                                     "tasks: [{name: add, workflow: 'a:b', dataset: arith, group_size: 2, model: m}]\n")
    env = {**role_env(tmp_path), "JET_REDIS_URL": url, "JET_CONFIG": "c.yaml"}
    with open(tmp_path / "feed.log", "wb") as out:
        feed = subprocess.Popen(["jet", "feed", "--every", "0.2"], cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "retrying in" not in (tmp_path / "feed.log").read_text():
            assert feed.poll() is None, (tmp_path / "feed.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "feed.log").read_text()
            time.sleep(0.2)
        with EmbeddedServer(tmp_path / "redis", port=port, password="pw"):

            async def fed() -> int:
                r = await connect(url)
                try:
                    return await r.xlen("jet:{fed}:tasks:add")
                finally:
                    await r.aclose()

            while not anyio.run(fed):
                assert feed.poll() is None and time.monotonic() < deadline, (tmp_path / "feed.log").read_text()
                time.sleep(0.2)
            feed.send_signal(signal.SIGTERM)
            assert feed.wait(30) == 0, (tmp_path / "feed.log").read_text()
    finally:
        if feed.poll() is None:
            feed.kill()
