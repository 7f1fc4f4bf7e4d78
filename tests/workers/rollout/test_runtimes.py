"""Per-task runtimes (docs/swarm.md): one task's workers run under another virtual environment.

Two tasks of one run train one model: `mine` runs in the env worker's own
interpreter with `jetconflict` 1.0 on its `runtime.cwd`, `theirs` runs under a
second virtual env (created here, layered on this one so that it imports jet
and its dependencies) that has `jetconflict` 2.0 installed by pip, from its own
`runtime.cwd`. The supervisor (`jet worker env`) starts the second task's
processes under that interpreter. Checked: each task's trajectories report its
own version of the conflicting package, none failed, each from its own consumer.
"""

from __future__ import annotations

import site
import subprocess
import sys
from collections import Counter

import pytest

from tests.workers.conftest import HOST, enqueue, trajectories, wait_for, write_config

FLOW = '''
import sys

import jetconflict


async def flow(task, llm):
    await llm.chat([{"role": "user", "content": "Hi."}], max_tokens=2)
    llm.info.update(jetconflict=jetconflict.__version__, python=sys.executable)
    return 1.0
'''


def make_venv(tmp_path):
    """A venv layered on this one (a .pth adds this env's site-packages after its own), with
    jetconflict 2.0 pip-installed into it."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                         capture_output=True, text=True).stdout.strip()
    ours = [p for p in site.getsitepackages() if p.endswith("site-packages")][0]
    (tmp_path / "venv" / own.split(str(venv) + "/", 1)[1] / "zz_layer.pth").write_text(
        f"import site; site.addsitedir({ours!r})\n")
    pkg = tmp_path / "jetconflict-src"
    (pkg / "jetconflict").mkdir(parents=True)
    (pkg / "jetconflict" / "__init__.py").write_text('__version__ = "2.0"\n')
    (pkg / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\n'
                                        'build-backend = "setuptools.build_meta"\n'
                                        '[project]\nname = "jetconflict"\nversion = "2.0"\n'
                                        '[tool.setuptools]\npackages = ["jetconflict"]\n')
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "--no-index", str(pkg)], check=True, cwd=tmp_path)
    return python


def two_runtimes(tmp_path):
    """The new venv's python and two task folders holding the workflow: `mine` with its own
    jetconflict 1.0 on the path, `theirs` relying on the venv's 2.0."""
    python = make_venv(tmp_path)
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    for d in (mine, theirs):
        d.mkdir()
        (d / "conflictflow.py").write_text(FLOW)
    (mine / "jetconflict").mkdir()
    (mine / "jetconflict" / "__init__.py").write_text('__version__ = "1.0"\n')
    return python, mine, theirs


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_task_runs_under_its_own_virtual_env_with_conflicting_dependencies(
        redis_url, keys, tiny_model, procs, tmp_path):
    python, mine, theirs = two_runtimes(tmp_path)
    with pytest.raises(subprocess.CalledProcessError):  # this env has no jetconflict of its own
        subprocess.run([sys.executable, "-c", "import jetconflict"], check=True, capture_output=True)
    task = {"workflow": "conflictflow:flow", "group_size": 1}
    write_config(procs.cfg_path, keys.run, tiny_model,
                 [{**task, "name": "mine", "runtime": {"cwd": str(mine)}},
                  {**task, "name": "theirs", "runtime": {"cwd": str(theirs), "python": str(python)}}])
    await enqueue(keys=keys, url=redis_url, task="mine", rows=[{}] * 3, group_size=1)
    await enqueue(keys=keys, url=redis_url, task="theirs", rows=[{}] * 3, group_size=1)
    procs.start("infer")
    env = procs.start("env")
    trajs = await wait_for(lambda: _at_least(redis_url, keys, 6, env), timeout=90)
    assert not [t.error for t in trajs if t.failed], procs.dump()
    by_task = Counter((t.task, t.meta["info"]["jetconflict"], t.meta["info"]["python"], t.meta["worker"])
                      for t in trajs)
    assert by_task == {("mine", "1.0", sys.executable, f"{HOST}-env-mine-0"): 3,
                       ("theirs", "2.0", str(python), f"{HOST}-env-theirs-0"): 3}
    assert len({t.meta["code_version"] for t in trajs}) == 2  # the two cwds hold different files


async def _at_least(url, keys, n, env):
    assert env.poll() is None, "the env worker exited"
    trajs = await trajectories(url, keys)
    return trajs if len(trajs) >= n else None
