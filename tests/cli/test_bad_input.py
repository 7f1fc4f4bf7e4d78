"""Bad input given to the CLI from outside, run as real subprocesses against a real server.

`jet enqueue` of a file validates every row before writing: a bad row anywhere is
one error naming the file, the line and why, with the stream left untouched; a good
file is written whole and the command says what it wrote. A config whose model
path holds no model makes every role that loads a model print one line naming
`models[i].path`, not a transformers traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import orjson
import pytest
import yaml

from jet.queues import codec
from jet.queues.connect import connect
from jet.wire import Task

pytestmark = pytest.mark.slow  # every test here starts processes (tests/conftest.py: the process guard)
JET = [sys.executable, "-m", "jet.cli"]


def run_jet(*args: str, cwd: Path | None = None, timeout: float = 120, **extra_env: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("JET_REDIS_URL", "JET_CONFIG")} | extra_env
    return subprocess.run(JET + list(args), capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def stream_entries(url: str, stream: str) -> list:
    async def read():
        r = await connect(url)
        try:
            return await r.xrange(stream)
        finally:
            await r.aclose()

    return anyio.run(read)


def write_rows(path: Path, rows: list) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else orjson.dumps(r)) + b"\n" for r in rows))
    return path


@pytest.fixture
def small_entries(tmp_path, keys) -> Path:
    """A config whose entry limit (queues.max_entry_bytes) is 4 KB."""
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump({
        "run": keys.run, "queues": {"max_entry_bytes": 4096},
        "models": [{"name": "m", "path": "nowhere"}],
        "tasks": [{"name": "guess", "workflow": "a:b", "dataset": "guess", "group_size": 2}]}))
    return path


def test_an_oversized_row_late_in_the_file_writes_nothing(tmp_path, redis_url, keys, small_entries):
    rows = [{"q": i} for i in range(600)]
    rows[550] = {"q": 550, "text": "x" * 5000}  # line 551: over the 4 KB entry limit
    data = write_rows(tmp_path / "rows.jsonl", rows)
    res = run_jet("enqueue", "guess", "--file", str(data), "--config", str(small_entries), "--redis-url", redis_url)
    assert res.returncode == 1, res.stderr
    [line] = res.stderr.strip().splitlines()
    assert line.startswith(f"Error: {data}:551: its task entry is ") and (
        "over the entry limit queues.max_entry_bytes (4096); nothing was written") in line, line
    assert "Traceback" not in res.stderr
    # taking only the first rows (-n) still checks the whole file
    res = run_jet("enqueue", "guess", "--file", str(data), "-n", "5", "--config", str(small_entries),
                  "--redis-url", redis_url)
    assert res.returncode == 1 and f"{data}:551: its task entry is " in res.stderr
    assert stream_entries(redis_url, keys.tasks("guess")) == []


@pytest.mark.parametrize("bad, why", [
    (b"{oops", "not valid JSON"),
    (b"[1, 2]", "each line must be a JSON object, got list"),
    (b'"text"', "each line must be a JSON object, got str"),
])
def test_a_malformed_row_anywhere_writes_nothing(tmp_path, redis_url, keys, bad, why):
    rows: list = [{"q": i} for i in range(700)]
    rows[699] = bad
    data = write_rows(tmp_path / "rows.jsonl", rows)
    # -n takes only the first rows, but the whole file is checked before anything is written
    res = run_jet("enqueue", "guess", "--file", str(data), "-n", "10", "--run", keys.run, "--redis-url", redis_url)
    assert res.returncode == 1 and f"{data}:700: {why}" in res.stderr, res.stderr
    assert stream_entries(redis_url, keys.tasks("guess")) == []


def test_an_empty_file_is_an_error(tmp_path, redis_url, keys):
    data = tmp_path / "empty.jsonl"
    data.write_text("\n\n")
    res = run_jet("enqueue", "guess", "--file", str(data), "--run", keys.run, "--redis-url", redis_url)
    assert res.returncode == 1 and f"{data}: no rows" in res.stderr


def test_a_good_file_says_exactly_what_it_wrote(tmp_path, redis_url, keys, small_entries):
    data = write_rows(tmp_path / "rows.jsonl", [{"q": i, "text": "y" * 100} for i in range(600)] + [b"", b"  "])
    res = run_jet("enqueue", "guess", "--file", str(data), "--config", str(small_entries), "--redis-url", redis_url)
    assert res.returncode == 0, res.stderr
    stream = keys.tasks("guess")
    assert res.stdout.strip() == f"enqueued 1200 tasks (600 rows x 2) to {stream} from {data}"
    tasks = [Task.from_payload(codec.decode(f)) for _, f in stream_entries(redis_url, stream)]
    assert [t.row["q"] for t in tasks] == [i for i in range(600) for _ in range(2)]
    assert {t.group_size for t in tasks} == {2} and len({t.group_id for t in tasks}) == 600
    res = run_jet("enqueue", "guess", "--file", str(data), "-n", "5", "--config", str(small_entries),
                  "--redis-url", redis_url)
    assert res.stdout.strip() == f"enqueued 10 tasks (5 rows x 2) to {stream} from {data} (first 5 of 600 rows)"
    assert len(stream_entries(redis_url, stream)) == 1210


def test_a_redis_failure_midway_says_how_much_was_written(tmp_path):
    data = write_rows(tmp_path / "rows.jsonl", [{"q": i} for i in range(10)])
    res = run_jet("enqueue", "guess", "--file", str(data), "--redis-url", "redis://127.0.0.1:1/0")
    assert res.returncode == 1 and "0 of 40 tasks had been written to jet:{default}:tasks:guess" in res.stderr
    assert "Traceback" not in res.stderr


# ---- a missing model directory, named by its key, from every role that loads a model


ROLES = {
    "infer": ["worker", "infer", "--model", "m"],
    "env": ["worker", "env"],
    "gateway": ["gateway", "--port", "0"],
    "train": ["train", "--model", "m"],
    "up": ["up", "--no-live"],
}


def run_role_on_model(tmp_path, role: str, path: str, **env):
    """(config, result) of `role` started on a config whose one model is at `path` (no server reachable)."""
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump({
        "models": [{"name": "m", "path": path}],
        "tasks": [{"name": "guess", "workflow": "jet.tasks.guess:workflow", "dataset": "guess"}]}))
    return config, run_jet(*ROLES[role], "--config", str(config), "--redis-url", "redis://127.0.0.1:1/0",
                           cwd=tmp_path, **env)


@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_role_names_the_missing_model_path(tmp_path, role):
    config, res = run_role_on_model(tmp_path, role, "./models/m")
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert res.stderr.strip().splitlines() == [
        f"Error: {config}: models[0].path: no model directory at '{tmp_path / 'models' / 'm'}' (no such directory; "
        f"build a tiny one with `jet model init --out {tmp_path / 'models' / 'm'}`, or name a Hub model as "
        "owner/name[@revision])"]
    assert not (tmp_path / "runs").exists()  # nothing started


@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_role_names_a_hub_model_missing_offline(tmp_path, role):
    config, res = run_role_on_model(tmp_path, role, "org/absent@v1", HF_HOME=str(tmp_path / "hf"),
                                    HF_HUB_OFFLINE="1")
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert res.stderr.strip().splitlines() == [
        f"Error: {config}: models[0].path: Hub model 'org/absent' (revision v1) is not in {tmp_path / 'hf' / 'hub'} "
        "and HF_HUB_OFFLINE is set: download it once online (`hf download org/absent`, same HF_HOME), or give a "
        "local folder"]
    assert not (tmp_path / "runs").exists()  # nothing started
