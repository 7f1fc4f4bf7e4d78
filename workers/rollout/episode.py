"""One episode: run the task's workflow and reward under a timeout, merge its calls.

What it is: `play` runs `workflow(task, llm)` (async, or sync in a thread with
a blocking `llm`), then `reward(task, result)` when the task names a reward
function (else the workflow's return value is the reward), all under the
episode timeout, and merges the recorded calls into timelines
(`jet.timeline.merge_calls`, the task's merge mode). `trajectories` turns the
`Outcome` into one Trajectory per model's trainer.

Failure policy: any exception of agent or reward code, a timeout, a generation
error, a bad reward, or merged samples that do not fit in a stream entry fail
THIS episode: the Outcome carries a one-line reason and the traceback. Only
Redis trouble (`QueueError`) propagates: it is not the episode's fault, so the
env worker gives the task back for another try instead of counting a failure.

Code version (docs/swarm.md, "Live code iteration"): `code_version` hashes the source of the workflow's and
reward's modules (plus the .py files under `runtime.cwd`, when set) into a short
sha256 that every Trajectory of the process carries as `meta["code_version"]`.
It is computed once, when the worker loads the workflow: a process never
re-imports, so new code means new processes (`jet worker env` reloads on SIGHUP
by rolling replacement). Versions played against: each model's Trajectory
records, in `meta["opponent_versions"]`, the sorted weight versions of the
OTHER models' calls in the episode (`{"planner": [3, 4]}`), absent when none.

No LLM call (docs/dashboard.md, "Episodes with no LLM call"): an episode that succeeds without one recorded LLM call
(the agent talked to another endpoint, or to none) would train on nothing.
`trajectories` marks it `meta["no_llm_calls"] = True`; `note_no_llm_calls`,
called by the env worker once the episode is committed, counts it in the run's
stats hash (`no_llm_calls`, shown by `jet status` and `jet dash`) and logs one
warning per worker and task with the likely cause.

Rewards: a number, or a dict agent name -> number. With a dict, each agent's
calls are merged separately and get that agent's reward; every agent that made
calls on a trained model needs an entry. Only models that are trained get
samples (a frozen judge's calls are context, not training data).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import logging
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import anyio
import orjson

from jet.errors import QueueError
from jet.llm import Session
from jet.timeline import Call, Sample, merge_calls
from jet.wire import Reward, Task, Trajectory

log = logging.getLogger(__name__)


@functools.cache
def load_function(spec: str) -> Callable:
    """`"package.module:function"` -> the function (imported once)."""
    module, _, name = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{spec} is not callable")
    return obj


@dataclass(slots=True)
class Outcome:
    reward: Reward | None = None
    samples: dict[str, list[Sample]] = field(default_factory=dict)  # model -> merged samples
    calls: int = 0
    undelivered: int = 0  # calls whose client disconnected before receiving them (not in samples)
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # one line; set when the episode failed
    traceback: str | None = None
    duration_s: float = 0.0
    versions: dict[str, list[int]] = field(default_factory=dict)  # model -> sorted weight versions of its calls

    @property
    def failed(self) -> bool:
        return self.error is not None

    def fail(self, error: str, tb: str | None = None) -> None:
        self.error, self.traceback, self.samples = error, tb, {}


class SyncSession:
    """A blocking view of a Session for sync workflows running in a worker thread."""

    def __init__(self, session: Session):
        self.session, self.info, self.calls = session, session.info, session.calls

    model = property(lambda self: self.session.model)
    episode_id = property(lambda self: self.session.episode_id)
    openai_base_url = property(lambda self: self.session.openai_base_url)
    openai_api_key = property(lambda self: self.session.openai_api_key)

    def openai_credentials(self, **kwargs) -> tuple[str, str]:
        return self.session.openai_credentials(**kwargs)

    def openai_client(self, **kwargs):
        """An `openai.OpenAI` (blocking) client whose calls are recorded in this episode."""
        return self.session.openai_client(sync=True, **kwargs)

    def chat(self, messages, **kwargs) -> dict:
        return anyio.from_thread.run(functools.partial(self.session.chat, messages, **kwargs))

    def generate(self, prompt_ids, **kwargs):
        return anyio.from_thread.run(functools.partial(self.session.generate, prompt_ids, **kwargs))


def is_async(fn: Callable) -> bool:
    """An `async def` function, or an object whose __call__ is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


async def _call(fn: Callable, *args: Any) -> Any:
    if is_async(fn):
        return await fn(*args)
    return await anyio.to_thread.run_sync(functools.partial(fn, *args), abandon_on_cancel=True)


def check_reward(value: Any) -> Reward:
    """A finite number or a dict of finite numbers, as floats; ValueError otherwise."""
    def number(x: Any) -> float:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ValueError(f"a reward must be a finite number or a dict agent -> number, got {x!r}")
        return float(x)

    if isinstance(value, dict):
        return {str(k): number(v) for k, v in value.items()}
    return number(value)


def merge(calls: list[Call], reward: Reward, mode: str, episode_id: str, trained: set[str]) -> dict[str, list[Sample]]:
    """Merged samples of the trained models' calls, per model."""
    calls = [c for c in calls if c.model in trained]
    if isinstance(reward, dict):
        missing = sorted({c.agent for c in calls} - set(reward))
        if missing:
            raise ValueError(f"the reward dict has no entry for agent(s) {missing}")
        groups = [([c for c in calls if c.agent == a], reward[a]) for a in dict.fromkeys(c.agent for c in calls)]
    else:
        groups = [(calls, reward)]
    out: dict[str, list[Sample]] = {}
    for group, r in groups:
        for s in merge_calls(group, mode, episode_id=episode_id, reward=r):
            out.setdefault(s.model, []).append(s)
    return out


async def play(task: Task, llm: Session, workflow: Callable, reward_fn: Callable | None, *, timeout_s: float,
               merge_mode: str, trained: set[str], collect: Callable[[], Awaitable[None]] | None = None) -> Outcome:
    """Run one episode to an Outcome; raises only QueueError (and cancellation).

    `collect`, when given, is awaited after the workflow and reward, before the
    merge: it adds calls recorded elsewhere (a standalone gateway) to `llm.calls`.
    """
    out, start = Outcome(), time.monotonic()
    try:
        with anyio.move_on_after(timeout_s) as scope:
            agent = llm if is_async(workflow) else SyncSession(llm)
            result = await _call(workflow, task, agent)
            reward = check_reward(await _call(reward_fn, task, result) if reward_fn else result)
            out.reward = reward
            if collect is not None:
                await collect()
            out.samples = await anyio.to_thread.run_sync(merge, list(llm.calls), reward, merge_mode,
                                                         llm.episode_id, trained)
        if scope.cancelled_caught:
            out.fail(f"episode timed out after {timeout_s:g}s")
    except QueueError:
        raise
    except Exception as e:  # noqa: BLE001 - agent and reward code may raise anything: it fails the episode
        out.fail(f"{type(e).__name__}: {e}"[:500], traceback.format_exc()[-8000:])
    out.calls, out.info, out.duration_s = len(llm.calls), _jsonable(llm.info), time.monotonic() - start
    out.undelivered = len(getattr(llm, "undelivered", ()))  # answered, never received by the client: not trained
    for c in llm.calls:
        out.versions.setdefault(c.model, []).append(c.version)
    out.versions = {m: sorted(set(v)) for m, v in out.versions.items()}
    return out


def _jsonable(info: dict) -> dict:
    try:
        return orjson.loads(orjson.dumps(info, default=str, option=orjson.OPT_NON_STR_KEYS))
    except (TypeError, orjson.JSONEncodeError):
        return {"unserialisable_info": repr(info)[:2000]}


def trajectories(task: Task, out: Outcome, *, episode_id: str, task_model: str, trained: set[str],
                 retry: bool, meta: dict[str, Any]) -> list[Trajectory]:
    """One Trajectory per trained model that has samples, plus, for every trained model the
    episode called and the task's own model, one even without samples: each trainer counts
    every member of a group, failed ones included (a team task's failure reaches both)."""
    models = sorted(set(out.samples) | ({task_model, *out.versions} & trained))
    meta = {**meta, "info": out.info, "calls": out.calls, "duration_s": round(out.duration_s, 3),
            **({"undelivered_calls": out.undelivered} if out.undelivered else {})}
    if no_llm_calls(out):
        meta["no_llm_calls"] = True
    return [Trajectory(task=task.task, group_id=task.group_id, index=task.index, episode_id=episode_id, model=m,
                       reward=out.reward if out.reward is not None else 0.0, samples=tuple(out.samples.get(m, ())),
                       group_size=task.group_size, attempt=task.attempt, failed=out.failed,
                       retry=retry and out.failed, error=out.error, traceback=out.traceback,
                       meta=_with_opponents(meta, out.versions, m))
            for m in models]


def _with_opponents(meta: dict[str, Any], versions: dict[str, list[int]], model: str) -> dict[str, Any]:
    others = {m: v for m, v in sorted(versions.items()) if m != model}
    return {**meta, "opponent_versions": others} if others else meta


def no_llm_calls(out: Outcome) -> bool:
    """A finished episode in which no LLM call was recorded: it has nothing to train on."""
    return not out.failed and out.calls == 0


_warned_no_calls: set[tuple[str, str]] = set()  # (worker, task) pairs already warned about, per process


def no_calls_cause() -> str:
    """The likely reason an episode recorded no call, for the warning."""
    cause = ("the workflow made no call through its episode's LLM client or gateway: an OpenAI client must be "
             "built from the session (llm.openai_client(), or base_url/api_key from llm.openai_credentials()), "
             "or the workflow returned before calling the model")
    base = os.environ.get("OPENAI_BASE_URL")
    if base:
        cause += f"; OPENAI_BASE_URL={base} is set in this worker, so a default OpenAI() client talks there"
    return cause


def warn_no_llm_calls(out: Outcome, *, task: str, worker: str) -> bool:
    """Whether the episode recorded no LLM call (its commit then counts it in stats `no_llm_calls`,
    atomically); warns once per (worker, task), naming the likely cause."""
    if not no_llm_calls(out):
        return False
    if (worker, task) not in _warned_no_calls:
        _warned_no_calls.add((worker, task))
        log.warning("task %s: an episode recorded no LLM call, so it trains nothing (counted as no_llm_calls "
                    "in `jet status`; warned once per worker and task). Likely cause: %s", task, no_calls_cause())
    return True


MAX_CWD_FILES = 2000  # .py files under runtime.cwd hashed into the code version, at most


def code_version(functions: list[Callable | None], cwd: str | None = None) -> str:
    """Short sha256 of the source files of the modules defining `functions` and of the .py
    files under `cwd` (sorted, hidden dirs / __pycache__ / virtual envs skipped, first
    MAX_CWD_FILES). Deterministic across hosts for the same files."""
    files: dict[str, str] = {}
    for fn in functions:
        path = getattr(sys.modules.get(getattr(fn, "__module__", "") or ""), "__file__", None)
        if fn is not None and path:
            files[f"module:{fn.__module__}"] = path
    if cwd:
        for path in _py_files(cwd)[:MAX_CWD_FILES]:
            files[f"cwd:{os.path.relpath(path, cwd)}"] = path
    h = hashlib.sha256()
    for name, path in sorted(files.items()):
        try:
            data = open(path, "rb").read()
        except OSError:
            data = b"<unreadable>"
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()[:12]


def _py_files(root: str) -> list[str]:
    out = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith(".") and x != "__pycache__"
                         and not os.path.exists(os.path.join(d, x, "pyvenv.cfg")))
        out += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
        if len(out) >= MAX_CWD_FILES:
            break
    return sorted(out)
