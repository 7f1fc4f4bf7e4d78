"""A client node: a fresh venv with only the base wheel (`pip install jet-rl`, no extras) runs
`jet worker env` against a server whose inference worker and trainer run from the full install.

The base venv gets its dependencies from the package index, as a user's would; the test skips,
saying why, when the index cannot be reached. What it proves: `import torch` (and transformers)
is impossible there, the env worker's process never maps libtorch, its episodes complete, and the
trainer trains on them (two optimiser steps with trajectories). It also records the venv's size
on disk (docs/benchmarks.md's figure, as `du` counts it: the blocks its files take) and checks it
against the base install's budget, and runs the client node's operator commands there (`jet
enqueue`, `jet status`, `jet dlq list`: no rich in the base install). A fast test checks that
jet/extras.py's table and pyproject's extras agree.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from jet.supervisor import python_module

ROOT = Path(__file__).resolve().parents[1]
BUDGET_MB = 150  # the goal for the base install in a fresh venv by `du`, pip and setuptools included


def du_mb(path: Path) -> float:
    """Disk usage under `path` as `du -s` counts it: the blocks of its files and folders (each small file
    takes a whole block, so a package of many small files, like openai's, weighs more than its bytes)."""
    return sum(f.lstat().st_blocks * 512 for f in [path, *path.rglob("*")] if not f.is_symlink()) / 2**20


def file_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20


def extra_requirements(extra: str, table: dict[str, list[str]]) -> set[str]:
    """The distribution names `extra` installs, through `jet-rl[...]` references to other extras."""
    import re

    names = set()
    for req in table[extra]:
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower().replace("_", "-")
        if name == "jet-rl":
            for sub in re.search(r"\[(.*)\]", req).group(1).split(","):
                names |= extra_requirements(sub.strip(), table)
        else:
            names.add(name)
    return names


def test_the_extras_table_and_pyproject_agree():
    """Every module jet/extras.py says an extra provides is a requirement of that extra in pyproject.toml
    (so a role's one-line error names the extra that really brings it), and none is a base dependency."""
    import tomllib

    from jet.extras import EXTRAS

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    base = {d.split(">")[0].split("[")[0].split("=")[0].split("<")[0].strip().lower() for d in project["dependencies"]}
    for extra, modules in EXTRAS.items():
        wanted = {m.replace("_", "-") for m in modules}
        assert wanted <= extra_requirements(extra, optional), (extra, wanted - extra_requirements(extra, optional))
        assert not wanted & base, (extra, wanted & base)


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Path:
    """A fresh venv holding the base wheel and its base dependencies, from the index."""
    out = tmp_path_factory.mktemp("client")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out / "wheel"), str(ROOT)], check=True)
    [wheel] = (out / "wheel").glob("*.whl")
    venv = out / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    res = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", str(wheel)],
                         capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        if "No matching distribution" in res.stderr or "Could not find a version" in res.stderr \
                or "Failed to establish" in res.stderr or "Network is unreachable" in res.stderr:
            pytest.skip(f"the package index cannot be reached for the base install: {res.stderr.strip()[-300:]}")
        raise AssertionError(res.stderr[-3000:])
    return venv


@pytest.mark.slow
def test_the_base_install_has_no_torch_and_fits_its_budget(client_venv):
    python = str(client_venv / "bin" / "python")
    for heavy in ("torch", "transformers", "numpy", "scipy", "optuna", "matplotlib", "prometheus_client", "rich"):
        res = subprocess.run([python, "-P", "-c", f"import {heavy}"], capture_output=True, text=True)
        assert res.returncode != 0 and "ModuleNotFoundError" in res.stderr, heavy
    size = du_mb(client_venv)
    print(f"base install: {size:.0f} MB in a fresh venv by du ({file_mb(client_venv):.0f} MB of files)")
    assert size < BUDGET_MB, f"the base install grew to {size:.0f} MB"
    # A role that needs an extra says which, in one line, and exits non-zero.
    res = subprocess.run([str(client_venv / "bin" / "jet"), "worker", "infer", "--help"], capture_output=True,
                         text=True)
    assert res.returncode != 0
    assert res.stderr.strip().splitlines() == [
        "Error: jet worker infer needs the 'infer' extra (torch, transformers, safetensors not installed): "
        "pip install 'jet-rl[infer]'"]


@pytest.mark.slow
def test_a_client_node_env_worker_trains_against_a_full_install_server(client_venv, embedded, tmp_path):
    from jet.models import init_model

    run = f"client{os.getpid()}"
    init_model(tmp_path / "model", vocab_size=512, hidden_size=32, layers=2, heads=4, kv_heads=2, seed=0)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "run": run, "runs_dir": str(tmp_path / "runs"),
        "models": [{"name": "tiny", "path": str(tmp_path / "model")}],
        "tasks": [{"name": "guess", "workflow": "jet.tasks.guess:workflow", "dataset": "guess", "model": "tiny",
                   "group_size": 4, "concurrency": 8}],
        "trainer": {"steps": 2, "batch_groups": 2, "lr": 2e-3, "checkpoint_every": 100}}))
    env = {**os.environ, "JET_REDIS_URL": embedded.url, "OMP_NUM_THREADS": "1"}
    env.pop("JET_CONFIG", None)
    jet = str(client_venv / "bin" / "jet")

    def operator(*args: str) -> str:  # a command of the client node, which has no rich
        res = subprocess.run([jet, *args], env={**env, "JET_CONFIG": str(config)}, capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0, res.stderr
        return res.stdout

    assert f"enqueued 128 tasks (32 rows x 4) to jet:{{{run}}}:tasks:guess" in operator("enqueue", "guess", "-n", "32")
    server_roles = {"infer": python_module("jet.workers.inference.worker") + ["--config", str(config), "--model", "tiny"],
                    "train": python_module("jet.trainer.cli") + ["--config", str(config), "--model", "tiny"]}
    client = [jet, "worker", "env", "--config", str(config), "--drain-timeout", "5"]
    procs, logs = {}, {}
    for name, argv in [*server_roles.items(), ("env", client)]:
        logs[name] = tmp_path / f"{name}.log"
        with open(logs[name], "wb") as out:
            procs[name] = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        mapped_torch = []
        deadline = time.monotonic() + 400
        while procs["train"].poll() is None:
            for name, p in procs.items():
                assert p.poll() is None or name == "train", f"{name} exited:\n{logs[name].read_text()[-3000:]}"
            maps = Path(f"/proc/{procs['env'].pid}/maps").read_text()
            mapped_torch += [line for line in maps.splitlines() if "libtorch" in line or "/torch/" in line]
            assert time.monotonic() < deadline, "the trainer never finished:\n" + logs["train"].read_text()[-3000:]
            time.sleep(0.5)
        assert procs["train"].returncode == 0, logs["train"].read_text()[-3000:]
        assert mapped_torch == []
        status = operator("status")  # the config's run, as a plain table
        assert status.splitlines()[0].split() == ["run", "stream", "length", "group", "pending", "lag", "consumers",
                                                  "(pending,", "idle)"]
        assert any(line.split()[:2] == [run, "traj:tiny"] for line in status.splitlines()), status
        assert operator("dlq", "list").strip() == f"0 dead letter(s) in run '{run}'"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = {name: p.wait(120) for name, p in procs.items()}
    assert codes == {"infer": 0, "train": 0, "env": 0}, {n: logs[n].read_text()[-1500:] for n in codes}
    lines = [json.loads(x) for x in (tmp_path / "runs" / run / "trainer" / "tiny" / "metrics.jsonl")
             .read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    assert all(m["rollout/trajectories"] > 0 for m in lines)
    assert "Traceback" not in logs["env"].read_text()
