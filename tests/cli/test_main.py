"""The `jet` CLI, through click's runner and as real subprocesses, against a real server."""

import signal
import subprocess
import sys

import anyio
import orjson
import pytest
from click.testing import CliRunner

from jet.cli.main import main
from jet.queues import codec
from jet.queues.connect import connect
from jet.wire import Task
from tests.queues.helpers import close, make_consumer

JET = [sys.executable, "-m", "jet.cli"]


def jet(*args, env=None):
    res = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return res


@pytest.mark.slow
def test_help_lists_commands_and_imports_no_torch():
    code = ("import sys; from jet.cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "for cmd in (['bench', '--help'], ['status', '--help'], ['enqueue', '--help'], ['dlq', '--help']):\n"
            "    try:\n        main(cmd)\n    except SystemExit:\n        pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for name in ("server", "enqueue", "status", "dlq", "up", "bench"):
        assert f"  {name} " in out
    assert "HEAVY []" in out


@pytest.mark.slow
def test_server_subprocess_prints_url_and_stops_cleanly(tmp_path):
    p = subprocess.Popen(JET + ["server", "--run-dir", str(tmp_path), "--port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline().strip()
        assert line.startswith("JET_REDIS_URL=redis://127.0.0.1:")
        url = line.split("=", 1)[1]

        async def poke():
            r = await connect(url)
            await r.xadd("s", {"a": "1"})
            info = await r.config_get("appendonly")
            await r.aclose()
            return info

        assert anyio.run(poke)["appendonly"] == "yes"
        # Other commands find it through the run directory without being told.
        res = subprocess.run(JET + ["status", "--run-dir", str(tmp_path), "--json"],
                             capture_output=True, text=True, check=True)
        assert orjson.loads(res.stdout) == []
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(20) == 0
    assert list((tmp_path / "redis").rglob("*.aof")), "AOF files are written under the run dir"


@pytest.mark.cluster  # also on a local Redis Cluster (tests/conftest.py)
def test_enqueue_jsonl_groups(redis_url, keys, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"q": 1}\n\n{"q": 2}\n')
    res = jet("enqueue", "guess", "--file", str(rows), "--group-size", "3", "--run", keys.run,
              "--redis-url", redis_url)
    assert res.exit_code == 0, res.output
    assert "enqueued 6 tasks" in res.output

    async def read():
        r = await connect(redis_url)
        entries = await r.xrange(keys.tasks("guess"))
        await r.aclose()
        return [Task.from_payload(codec.decode(f)) for _, f in entries]

    tasks = anyio.run(read)
    assert [t.row["q"] for t in tasks] == [1, 1, 1, 2, 2, 2]
    assert len({t.group_id for t in tasks}) == 2 and [t.index for t in tasks[:3]] == [0, 1, 2]
    assert tasks[0].group_id == tasks[2].group_id != tasks[3].group_id


def test_enqueue_bad_input_is_a_clear_error(redis_url, keys, tmp_path):
    rows = tmp_path / "bad.jsonl"
    rows.write_text('{"q": 1}\n{oops\n')
    res = jet("enqueue", "guess", "--file", str(rows), "--run", keys.run, "--redis-url", redis_url)
    assert res.exit_code != 0 and f"{rows}:2: not valid JSON" in res.output
    res = jet("enqueue", "bad:name", "--file", str(rows), "--redis-url", redis_url)
    assert res.exit_code == 2 and "task name 'bad:name' must match" in res.output
    res = jet("enqueue", "guess", "--run", keys.run, "--redis-url", redis_url)
    assert res.exit_code == 2 and "exactly one of --file or --dataset" in res.output


@pytest.mark.cluster  # also on a local Redis Cluster (tests/conftest.py)
def test_status_shows_lengths_pending_and_consumers(redis_url, keys):
    async def seed():
        c = await make_consumer(redis_url, keys, keys.tasks("guess"), "worker-1")
        for i in range(5):
            await c.r.xadd(keys.tasks("guess"), codec.encode("test", {"n": i}))
        await c.fetch(2)
        await close(c)

    anyio.run(seed)
    res = jet("status", "--run", keys.run, "--redis-url", redis_url, "--json")
    [rep] = orjson.loads(res.output)
    [s] = rep["streams"]
    assert (s["name"], s["length"]) == ("tasks:guess", 5)
    [g] = s["groups"]
    assert (g["name"], g["pending"], g["lag"]) == ("g", 2, 3)
    assert g["consumers"][0]["name"] == "worker-1" and g["consumers"][0]["pending"] == 2
    table = jet("status", "--run", keys.run, "--redis-url", redis_url)
    assert "tasks:guess" in table.output and "worker-1" in table.output


@pytest.mark.cluster  # also on a local Redis Cluster (tests/conftest.py)
def test_dlq_list_requeue_drop(redis_url, keys):
    src = keys.tasks("guess")

    async def seed():
        c = await make_consumer(redis_url, keys, src)
        await c.r.xadd(src, {b"v": b"9", b"k": b"task", b"i": b"x", b"m": b"{}"})
        await c.r.xadd(src, {b"junk": b"1"})
        assert await c.fetch() == []
        await close(c)

    anyio.run(seed)
    base = ["--run", keys.run, "--redis-url", redis_url]
    res = jet("dlq", "list", *base, "--json")
    rows = orjson.loads(res.output)
    assert [r["stream"] for r in rows] == ["tasks:guess", "tasks:guess"]
    assert "unknown schema version '9'" in rows[0]["reason"] and "no schema version" in rows[1]["reason"]
    res = jet("dlq", "requeue", *base, rows[0]["id"])
    assert "requeued 1" in res.output

    async def lengths():
        r = await connect(redis_url)
        out = await r.xlen(src), await r.xlen(keys.dead), (await r.xrange(src))[-1][1]
        await r.aclose()
        return out

    n_src, n_dead, last = anyio.run(lengths)
    assert (n_src, n_dead) == (3, 1) and last[b"v"] == b"9"  # the original entry, byte for byte
    assert "dropped 1" in jet("dlq", "drop", *base, "--all").output
    assert anyio.run(lengths)[1] == 0
    assert jet("dlq", "drop", *base).exit_code == 2


@pytest.mark.slow
def test_unreachable_server_names_url_without_password():
    res = subprocess.run(JET + ["status", "--redis-url", "redis://:hunter2@127.0.0.1:1/0"],
                         capture_output=True, text=True)
    assert res.returncode == 1
    assert "cannot reach Redis at redis://:***@127.0.0.1:1/0" in res.stderr
    assert "hunter2" not in res.stderr + res.stdout


def test_enqueue_builtin_dataset_and_config(redis_url, keys, tmp_path):
    res = jet("enqueue", "guess", "--dataset", "guess", "-n", "5", "--group-size", "2", "--run", keys.run,
              "--redis-url", redis_url)
    assert res.exit_code == 0, res.output
    assert "enqueued 10 tasks (5 rows x 2)" in res.output
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"run: {keys.run}\nmodels: [{{name: m, path: /nonexistent}}]\n"
                   "tasks: [{name: arith, workflow: 'a:b', dataset: arith, group_size: 3, model: m}]\n")
    res = jet("enqueue", "arith", "--config", str(cfg), "-n", "4", "--redis-url", redis_url)
    assert res.exit_code == 0, res.output
    assert "enqueued 12 tasks (4 rows x 3)" in res.output and keys.tasks("arith") in res.output
    res = jet("enqueue", "guess", "--dataset", "nope", "--run", keys.run, "--redis-url", redis_url)
    assert res.exit_code == 1 and "unknown built-in dataset 'nope'" in res.output
