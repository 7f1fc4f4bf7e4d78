"""Which processes `jet worker env` supervises: per-task interpreters (`tasks[].runtime.python`).

What it is: `env_children(...)(bank)` lists one generation of env worker
processes: per slot, one under this interpreter for the tasks that run here,
and one per task whose `runtime.python` is another interpreter, started as
`<runtime.python> -m jet.workers.rollout.worker --task <name>` in `runtime.cwd`. That
interpreter imports jet from its own environment (nothing is put on its
PYTHONPATH, so the two environments' dependencies stay apart); `check_runtime`
tells the user at start when it cannot. `same_python` compares interpreter
paths without resolving symlinks (a virtual env's python links to its base).

What it is not: an installer; the runtime's environment is the user's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import click

from jet.config import TaskConfig
from jet.supervisor import Child


def same_python(python: str | None) -> bool:
    """Whether `python` (a path or a command; None = ours) is this interpreter. Paths are compared
    WITHOUT resolving symlinks: a virtual env's python links to its base interpreter."""
    if not python:
        return True
    found = shutil.which(python) if os.sep not in python else python
    return os.path.abspath(found or python) == os.path.abspath(sys.executable)


def in_process(tasks: list[TaskConfig], role: str) -> None:
    """Make the workflows of `tasks` importable in this process, as an env worker finds them: each task's
    `runtime.cwd` first on sys.path, the folder the role runs in last (roles start with -P, so that folder
    never shadows an installed package). A task with its own `runtime.python` cannot run here: ConfigError."""
    from jet.errors import ConfigError

    for t in tasks:
        if not same_python(t.runtime.python):
            raise ConfigError(f"tasks.{t.name}.runtime.python: {t.runtime.python} is not this interpreter "
                              f"({sys.executable}); {role}")
        if t.runtime.cwd and t.runtime.cwd not in sys.path:
            sys.path.insert(0, t.runtime.cwd)
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


def env_children(config_path: str, overrides, chosen: list[TaskConfig], apart: list[TaskConfig], processes: int,
                 slot: int, drain_timeout: float, shadow: bool, bank: int) -> list[Child]:
    """The supervisor's children of one generation: per slot, one process for the tasks of this
    interpreter and one per task with its own runtime (under its interpreter, in its cwd)."""
    here = [t.name for t in chosen if t not in apart]
    out = []
    for i in range(processes):
        common = ["-P", "-m", "jet.workers.rollout.worker", "--config", config_path, "--slot", str(slot + i), "--bank", str(bank),
                  "--drain-timeout", str(drain_timeout), *(x for o in overrides for x in ("--set", o)),
                  *(["--shadow"] if shadow else [])]
        if here:
            out.append(Child(f"env-{slot + i}", [sys.executable, *common, *(x for t in here for x in ("--task", t))]))
        out += [Child(f"env-{t.name}-{slot + i}", [t.runtime.python, *common, "--task", t.name], cwd=t.runtime.cwd)
                for t in apart]
    return out


def check_runtime(t: TaskConfig) -> None:
    """Fail early, and clearly, when a task's interpreter cannot import the env worker."""
    try:
        res = subprocess.run([t.runtime.python, "-c", "import jet.workers.rollout.worker"], cwd=t.runtime.cwd,
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise click.ClickException(f"tasks.{t.name}.runtime.python: cannot run {t.runtime.python}: {e}") from None
    if res.returncode != 0:
        raise click.ClickException(f"tasks.{t.name}.runtime.python: {t.runtime.python} cannot import jet "
                                   f"(install jet in that environment):\n{res.stderr[-2000:]}")
