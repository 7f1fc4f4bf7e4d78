"""The env worker: `jet worker env --config C [-n N]` runs agent episodes.

What it is: for each configured task (or those named with --task), a consumer
of `tasks:<task>` (group `env`, consumer `<host>-env-<task>-<slot>`) that keeps
up to `tasks[].concurrency` episodes running at once in this process, all
sharing one LLM client (`jet.llm`, one reply stream per process). Scale by
process count (`-n N`, or more machines).

Per episode (`jet.workers.rollout.episode`): run the workflow and reward under the
episode timeout, merge the calls, then ONE atomic commit: the task's ack + its
idempotency marker + the Trajectory on `traj:<model>` for each trained model,
and, when the episode failed, either a copy of the task with attempt + 1 on
`tasks:<task>` (while attempt < max_retries) or its dead letter (which
`jet dlq requeue` turns back into a fresh first attempt). A failed
episode is still published (failed=True, with its traceback) so the trainer
can count the group member. A redelivered task whose commit already happened
is acked, not re-run (the Consumer's marker check).

Around it, the consumer runtime (`jet.queues.runtime.Runtime.serve_each`, one
handler call per task, each committed as it finishes): the lease keeper renews
leases of running episodes, the reaper reclaims tasks of crashed workers, Redis
trouble inside an episode gives the task back for another delivery, and a full
trajectory stream makes the commit wait, atomically (backpressure). SIGTERM
drains: no new tasks, running episodes get `drain_timeout_s` to finish, the
rest are released for other workers at once.

OpenAI-SDK agents: each episode's session gets the base URL and API key of
an OpenAI-compatible gateway (`jet.workers.gateway.app`): by default one embedded
in this process on loopback; with `--gateway-url` a standalone `jet gateway`,
whose recorded calls are collected before the merge and the commit.

Code versions and reloads (docs/swarm.md, "Live code iteration"): every Trajectory carries
`meta["code_version"]`, a short hash of the workflow's and reward's source
files and of the .py files under `runtime.cwd` (`episode.code_version`),
computed once when this process loads them. New code needs new processes:
under the supervisor (`-n N`, or `--reload` with one process), SIGHUP starts a
new generation of children and, once each has loaded its workflows, SIGTERMs
the old one, which drains as above (`jet.supervisor.Supervisor`). The two generations overlap, so
their consumer names differ: generation bank 1 appends `.1` to the slot
(`host-env-<task>-0.1`); banks alternate, and a second SIGHUP waits until the
previous old generation has exited, so never two processes share a name.

Runtimes: a task whose `runtime.python` is another interpreter runs in its own
child processes, `<runtime.python> -m jet.workers.rollout.worker --task <name> ...` with
`cwd=runtime.cwd`, started by the supervisor (which is then always used). That
interpreter must import jet and its dependencies itself (jet installed in that
environment, or the environment layered on this one); nothing is added to its
PYTHONPATH, so the conflicting dependencies of the two stay apart. The
supervisor checks `import jet.workers.rollout.worker` under it before starting. A task
with only `runtime.cwd` runs here with the directory put on sys.path. The folder
the worker runs in is searched last: roles start with `python -P`
(`jet.supervisor.python_module`), so a `jet/` folder there never shadows the
installed package.

Shadow mode (`--shadow`) is the same worker on another lane (`jet.workers.rollout.lanes`):
it plays every new task in its own group `env-shadow`, publishes to
`shadow:<model>` (no trainer reads it) and only records failures: no retry,
dead letter or re-enqueue.

What it is not: a sandbox. Workflows run in the worker's process.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time

import anyio
import click

import jet
from jet.options import config_options, load_config, redis_url_option, require_models, resolve_url
from jet.config import JetConfig, TaskConfig
from jet.errors import CodecError, ConfigError
from jet.keys import Keys
from jet.llm import LLMClient, Tokenizers, open_client
from jet.queues.consumer import Settings, consumer_name, dead_entry
from jet.queues.messages import Commit, Dead, Delivery, Drop, Outcome
from jet.queues.runtime import Runtime
from jet.supervisor import mark_ready
from jet.wire import Task
from jet.workers.gateway.app import KEY_GRACE_S, episode_gateway, pool_size
from jet.workers.gateway.sessions import Episodes
from jet.workers.rollout.episode import Outcome as Episode
from jet.workers.rollout.episode import code_version, load_function, play, trajectories, warn_no_llm_calls
from jet.workers.rollout.lanes import LIVE, SHADOW, Lane, leave_group
from jet.workers.rollout.runtimes import check_runtime, env_children, in_process, same_python

log = logging.getLogger(__name__)

GATEWAY_URL_ENV = "JET_GATEWAY_URL"


class TaskRunner:
    """Runs episodes of one task in this process, on one lane (live or shadow)."""

    def __init__(self, cfg: JetConfig, task: TaskConfig, url: str, llm: LLMClient, slot: int | str,
                 drain_timeout_s: float, gateway: Episodes, lane: Lane = LIVE, ready=None):
        self.cfg, self.t, self.url, self.llm, self.gateway, self.lane = cfg, task, url, llm, gateway, lane
        self.keys = Keys(cfg.run)
        self.name = consumer_name(f"{lane.role}-{task.name}", slot)
        self.code = ""  # code_version of the loaded workflow and reward
        self.ready = ready  # called once the workflow is loaded and the group exists
        self.trained = {m.name for m in cfg.models if m.trainable}
        self.drain_timeout_s = drain_timeout_s

    async def run(self, stop: anyio.Event) -> None:
        self.workflow = _load(self.t.workflow, f"tasks.{self.t.name}.workflow")
        self.reward = _load(self.t.reward, f"tasks.{self.t.name}.reward") if self.t.reward else None
        self.code = code_version([self.workflow, self.reward], self.t.runtime.cwd)
        log.info("task %s: code version %s (%s lane)", self.t.name, self.code, self.lane.role)
        settings = Settings.of(self.cfg.queues, batch=self.t.concurrency)
        stream = self.keys.tasks(self.t.name)
        beat = {"code_version": self.code, "task": self.t.name, "model": self.t.model, "lane": self.lane.role}
        async with Runtime(self.url, self.keys, stream, self.lane.group, self.name, settings,
                           start=self.lane.start, stop=stop, role="env", beat=lambda: beat) as rt:
            if self.ready:
                self.ready()
            await rt.serve_each(self._episode, stop, concurrency=self.t.concurrency,
                                drain_timeout_s=self.drain_timeout_s)
            if self.lane.leave_on_exit:
                await leave_group(rt.client, self.url, stream, self.lane.group, self.name)

    async def _episode(self, d: Delivery) -> Outcome:
        """One task: play it, then its trajectories (+ retry copy or dead letter) as one commit."""
        try:
            task = Task.from_payload(d.payload)
            if task.task != self.t.name:
                raise CodecError(f"task {task.task!r} on the stream of task {self.t.name!r}")
        except CodecError as e:  # the live lane dead-letters it; the shadow only drops its copy
            return Dead(str(e)) if self.lane.owns_fate else Drop()
        session = self.llm.session(task.msg_id, self.t.model)
        session.deadline = time.time() + self.t.episode_timeout_s  # its calls' requests are moot after it
        try:
            await self.gateway.open(session, ttl_s=self.t.episode_timeout_s + KEY_GRACE_S, task=self.t.name)
            out = await play(task, session, self.workflow, self.reward, timeout_s=self.t.episode_timeout_s,
                             merge_mode=self.t.merge, trained=self.trained,
                             collect=functools.partial(self.gateway.collect, session))
        finally:
            self.llm.close_session(task.msg_id)
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await self.gateway.close(session)
        quiet = warn_no_llm_calls(out, task=task.task, worker=self.name)  # trains nothing: counted by the commit
        return Commit(self._outputs(d, task, out), counter="no_llm_calls" if quiet else "")

    def _outputs(self, d: Delivery, task: Task, out: Episode) -> list[tuple[str, dict]]:
        """The trajectories, and for a failed episode the retry copy or the dead letter."""
        retry = out.failed and task.attempt < self.t.max_retries and self.lane.owns_fate
        meta = {"worker": self.name, "workflow": self.t.workflow, "reward_fn": self.t.reward,
                "deliveries": d.deliveries, "pid": os.getpid(), "jet": jet.__version__,
                "code_version": self.code, "host": socket.gethostname(), **self.lane.meta}
        try:
            outputs = self._trajectories(task, out, retry, meta)
        except CodecError as e:  # e.g. the samples exceed queues.max_entry_bytes: publish the failure
            out.fail(f"cannot publish the trajectory: {e}")
            out.info = {}
            retry = task.attempt < self.t.max_retries and self.lane.owns_fate
            outputs = self._trajectories(task, out, retry, meta)
        if out.failed:
            log.warning("episode %s of %s (attempt %d) failed: %s", task.msg_id, task.task, task.attempt, out.error)
            if self.lane.owns_fate:
                outputs.append(self._retry(task) if retry else self._dead_letter(d, task, out))
        return outputs

    def _trajectories(self, task: Task, out: Episode, retry: bool, meta: dict) -> list[tuple[str, dict]]:
        trajs = trajectories(task, out, episode_id=task.msg_id, task_model=self.t.model,
                             trained=self.trained, retry=retry, meta=meta)
        return [(self.lane.traj(self.keys, t.model), t.to_fields(self.cfg.queues.max_entry_bytes)) for t in trajs]

    def _retry(self, task: Task) -> tuple[str, dict]:
        again = Task(task=task.task, row=task.row, group_id=task.group_id, index=task.index,
                     group_size=task.group_size, attempt=task.attempt + 1)
        return self.keys.tasks(task.task), again.to_fields()

    def _dead_letter(self, d: Delivery, task: Task, out: Episode) -> tuple[str, dict]:
        """The task's dead letter, written (and counted) by the commit. Its original entry is a fresh
        copy of the task (new id, attempt 0): the commit marks the old id done, so `jet dlq requeue`
        of the old entry would be skipped as a duplicate; the copy runs again, with retries."""
        meta = {"stream": self.keys.short(d.stream), "entry_id": d.entry_id, "group": self.lane.group,
                "consumer": self.name, "reason": f"episode failed {task.attempt + 1} times: {out.error}",
                "deliveries": d.deliveries, "time": time.time(), "last_error": (out.traceback or "")[-4000:],
                "task_id": task.msg_id}
        fresh = Task(task=task.task, row=task.row, group_id=task.group_id, index=task.index,
                     group_size=task.group_size).to_fields()
        return self.keys.dead, dead_entry(meta, fresh)


def _load(spec: str, key: str):
    try:
        return load_function(spec)
    except (ImportError, AttributeError, TypeError) as e:
        raise ConfigError(f"{key}: cannot load {spec!r}: {type(e).__name__}: {e}") from e


async def run(cfg: JetConfig, url: str, stop: anyio.Event, *, slot: int | str = 0, tasks: tuple[str, ...] = (),
              drain_timeout_s: float = 30.0, gateway_url: str | None = None, shadow: bool = False) -> None:
    """Run episodes of the configured tasks until `stop`, then drain.

    `gateway_url`: the /v1 URL of a standalone `jet gateway` for OpenAI-SDK
    agents; None serves an embedded one on loopback."""
    chosen = [t for t in cfg.tasks if not tasks or t.name in tasks]
    unknown = sorted(set(tasks) - {t.name for t in cfg.tasks})
    if unknown or not chosen:
        raise ConfigError(f"--task: unknown task(s) {unknown}" if unknown else "tasks: none configured")
    in_process(chosen, "start it with `jet worker env`, which runs it in its own process")
    tokenizers = Tokenizers({m.name: m.path for m in cfg.models})
    for model in {t.model for t in chosen}:  # load before the first episodes, not under their timeout
        await anyio.to_thread.run_sync(tokenizers.get, model)
    timeouts = {m.name: m.request_timeout_s for m in cfg.models}
    async with open_client(url, Keys(cfg.run), tokenizers, timeouts=timeouts, max_connections=pool_size(cfg),
                           gen_maxlen=cfg.queues.maxlen.get("gen", 10_000), stop=stop) as llm:
        log.info("env worker slot %s: tasks %s, reply stream %s", slot, [t.name for t in chosen], llm.id)
        loaded: set[str] = set()

        def ready(name: str) -> None:  # every task loaded: a rolling reload may drain the old workers
            loaded.add(name)
            if len(loaded) == len(chosen):
                mark_ready()

        async with episode_gateway(cfg, url, llm, gateway_url) as gateway, anyio.create_task_group() as tg:
            for t in chosen:
                tg.start_soon(TaskRunner(cfg, t, url, llm, slot, drain_timeout_s, gateway,
                                         SHADOW if shadow else LIVE, functools.partial(ready, t.name)).run, stop)


@click.command("env")
@config_options("tasks, models, queues, run")
@click.option("--task", "tasks", multiple=True, help="Run only these tasks (repeatable; default: all).")
@click.option("-n", "processes", type=click.IntRange(min=1), default=1, show_default=True, help="Worker processes.")
@click.option("--slot", type=click.IntRange(min=0), default=0, show_default=True,
              help="First slot number (stable consumer names: host-env-<task>-<slot>).")
@click.option("--drain-timeout", type=float, default=30.0, show_default=True,
              help="On SIGTERM, seconds running episodes get to finish before they are released.")
@click.option("--gateway-url", envvar=GATEWAY_URL_ENV, default=None, metavar="URL",
              help="Base URL (.../v1) of a standalone `jet gateway` for OpenAI-SDK agents "
                   "(default: one embedded in each worker, on loopback).")
@click.option("--reload", is_flag=True,
              help="Supervise even one process, so that SIGHUP rolls the workers onto new code "
                   "(always so with -n > 1 or a task with its own runtime.python).")
@click.option("--shadow", is_flag=True,
              help="Shadow mode: see new tasks without taking them from the live workers; "
                   "trajectories go to shadow:<model>, never to a trainer.")
@click.option("--bank", type=click.IntRange(0, 1), default=0, hidden=True,
              help="Generation bank set by the supervisor: bank 1 names its consumers <slot>.1.")
@redis_url_option
def cli(config_path, overrides, tasks, processes, slot, drain_timeout, gateway_url, reload, shadow, bank,
        redis_url) -> None:
    """Run agent episodes of the configured tasks (tasks:<task> -> traj:<model>)."""
    from jet.config import REDIS_URL_ENV
    from jet.supervisor import Supervisor, run_role

    cfg = load_config(config_path, overrides)
    unknown = sorted(set(tasks) - {t.name for t in cfg.tasks})
    if unknown:
        raise click.UsageError(f"--task: unknown task(s) {unknown}; configured: {[t.name for t in cfg.tasks]}")
    cfg = require_models(cfg, config_path)
    url = resolve_url(redis_url)
    chosen = [t for t in cfg.tasks if not tasks or t.name in tasks]
    apart = [t for t in chosen if not same_python(t.runtime.python)]  # their own interpreter: own processes
    if processes > 1 or reload or apart:
        for t in apart:
            check_runtime(t)
        os.environ[REDIS_URL_ENV] = url  # children inherit it; a password never shows in `ps`
        if gateway_url:
            os.environ[GATEWAY_URL_ENV] = gateway_url
        children = functools.partial(env_children, os.path.abspath(config_path), overrides, chosen, apart, processes,
                                     slot, drain_timeout, shadow)
        raise SystemExit(Supervisor(children, reload=True).run())
    run_role(lambda stop: run(cfg, url, stop, slot=slot if bank == 0 else f"{slot}.{bank}", tasks=tasks,
                              drain_timeout_s=drain_timeout, gateway_url=gateway_url, shadow=shadow), "jet worker env")


if __name__ == "__main__":
    from jet.options import setup_logging

    setup_logging(os.environ.get("JET_LOG_LEVEL", "INFO"))
    cli()
