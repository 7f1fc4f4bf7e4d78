"""The evaluator: `jet worker eval --model M` evaluates a model's published versions on held-out rows.

What it is: a role beside the trainer, on any machine that reaches the run's Redis (and the run folder,
for full weights; an adapter model's versions also come through Redis). It follows `weights:<model>`
with plain XREAD (fan-out, like an inference worker) and evaluates, on a backend of its own:
- the base weights (version 0) when it starts, unless already evaluated (or `eval.base` is false);
- every version at least `tasks[].eval.every` versions after the last one evaluated;
- the run's final version (its step is the last `trainer.steps` publishes), after which it exits 0.
For each it plays every evaluated task's held-out rows with the task's own workflow and reward
(`jet.workers.evaluator.episodes`: multi-turn agents included, greedy by default) and appends ONE line
to `<run>/trainer/<model>/eval.jsonl`: the version, the trainer step that made it, the wall time it was
announced (`time`) and, per task, `eval/<task>/reward_mean`, `eval/<task>/n`, `eval/<task>/failed`,
`eval/<task>/ci95` and each row's result (`eval/<task>/results`, in row order, for paired comparisons).
`jet dash`, `jet plot` and `jet study` (a metric named `eval/...`) read that file.

Off the training path, by design:
- its generation never goes through `gen:<model>`: the inference workers that make training data never
  wait for it;
- a version it wants is secured at once (hard links to the published files, or the chunks fetched
  from Redis), so the trainer's retention (`trainer.keep_weights`) never waits for it either;
- it runs under the kernel's idle scheduling class (`--idle`, the default on Linux: a core only when
  nothing else wants it), else at a lower CPU priority (`--nice`, default 10), and `jet up` gives it one
  thread, so on a shared machine training keeps the cores (on a machine that training saturates, its
  evaluations wait for idle moments, and for the end of training at the latest);
- when it falls behind, it skips to the newest version due and says so (which versions, and how long
  an evaluation takes against how often versions come); a restarted evaluator skips the versions
  its file already holds;
- `jet up` runs it as an optional role: an evaluator that crashes for good is reported and left
  stopped, and training goes on.

What it is not: a trainer data source (nothing it plays is trained), or a gate on training.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import click
import orjson

from jet.options import config_options, load_config, redis_url_option, require_models, resolve_url
from jet.config import JetConfig, TaskConfig
from jet.errors import CodecError, ConfigError, ConnectError, WeightsError
from jet.keys import Keys
from jet.llm import Tokenizers
from jet.queues import blobs, codec
from jet.queues.connect import connect, retry_forever, translated
from jet.queues.consumer import consumer_name
from jet.queues.registry import heartbeat
from jet.runs import RunDir, read_metrics
from jet.wire import WeightVersion
from jet.workers.evaluator.episodes import LocalClient, Played, held_out_rows, play_rows
from jet.workers.rollout.runtimes import in_process

log = logging.getLogger(__name__)

NICE = 10  # the evaluator's CPU priority offset where the idle class is off or missing


def lower_priority(nice: int, idle: bool) -> str:
    """Lower every thread of this process (Linux sets both per thread, so threads already started count
    too): the SCHED_IDLE class where `idle` and the platform has it, else `nice` more niceness. Returns what
    was done, in words."""
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    if idle and hasattr(os, "SCHED_IDLE"):
        for tid in tids:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return "idle scheduling class"
    if nice:
        for tid in tids:
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    return f"nice +{nice}" + (" (no idle scheduling class here)" if idle else "")


@dataclass(frozen=True, slots=True)
class Due:
    """A version to evaluate, secured in a folder of the evaluator's own."""

    version: int
    step: int
    announced: float  # unix time of its announcement
    folder: Path | None  # None: the model's own weights (version 0)
    sha256: str | None
    final: bool


def evaluated_tasks(cfg: JetConfig, model: str) -> list[TaskConfig]:
    """The tasks of `model` that have an `eval` section (ConfigError when none does)."""
    tasks = [t for t in cfg.tasks if t.model == model and t.eval is not None]
    if not tasks:
        raise ConfigError(f"no task of model {model!r} has an `eval` section (tasks[].eval): nothing to evaluate")
    return tasks


def every_of(tasks: list[TaskConfig]) -> int:
    """Versions between evaluations: the smallest `eval.every` of the model's evaluated tasks."""
    return min(t.eval.every for t in tasks)


def is_final(step: int, cfg: JetConfig, model: str) -> bool:
    """Whether a version made at trainer step `step` is the run's last one published."""
    tc = cfg.trainer_of(model)
    return step + tc.publish_every > tc.steps


def done_versions(path: Path) -> set[int]:
    """The versions the evaluator's file already holds (a restarted evaluator does not evaluate them again)."""
    return {int(r["version"]) for r in read_metrics(path) if isinstance(r.get("version"), int)}


def row_of(due: Due, played: dict[str, Played]) -> dict:
    """The eval.jsonl line of one evaluated version."""
    from jet.stats import interval

    row: dict = {"step": due.step, "version": due.version, "time": round(due.announced, 3),
                 "eval_time": round(time.time(), 3)}
    for task, p in played.items():
        lo, hi = interval(p.results)
        row |= {f"eval/{task}/reward_mean": p.mean, f"eval/{task}/n": len(p.results),
                f"eval/{task}/failed": p.failed, f"eval/{task}/ci95": [lo, hi],
                f"eval/{task}/seconds": round(p.seconds, 3), f"eval/{task}/results": p.results}
    return row


def append_line(path: Path, row: dict) -> None:
    """Append one JSON line in one write (O_APPEND), then fsync: a reader never sees half of it for long."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, orjson.dumps(row) + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)


def secure(source: Path, folder: Path) -> Path:
    """Hard-link (else copy) the published version at `source` (a folder, or one file) into `folder`."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    files = [source] if source.is_file() else [f for f in source.iterdir() if f.is_file()]
    for f in files:
        try:
            os.link(f, folder / f.name)
        except OSError:  # another filesystem, or links not allowed: a copy
            shutil.copy2(f, folder / f.name)
    return folder / source.name if source.is_file() else folder


class Evaluator:
    """One model's evaluator (see the module docstring)."""

    def __init__(self, cfg: JetConfig, model: str, url: str, backend, *, slot: int = 0):
        self.cfg, self.model, self.url, self.backend = cfg, model, url, backend
        self.keys = Keys(cfg.run)
        self.name = consumer_name(f"eval-{model}", slot)
        self.tasks = evaluated_tasks(cfg, model)
        self.rows = {t.name: held_out_rows(t) for t in self.tasks}
        self.every = every_of(self.tasks)
        run = RunDir.of(cfg)
        self.file = run.evals(model)
        self.cache = run.trainer(model) / "eval-weights"
        from jet.workers.inference.worker import weights_roots

        self.roots = [p.resolve() for p in weights_roots(cfg, model)]
        tokenizers = Tokenizers({m.name: m.path for m in cfg.models})
        self.clients = {t.name: LocalClient(backend, tokenizers, greedy=t.eval.greedy) for t in self.tasks}
        self.done = done_versions(self.file)
        self.last_due = max(self.done, default=-1)  # the newest version evaluated or secured
        self.queue: dict[int, Due] = {}
        self.arrived = anyio.Event()
        self.evaluating: int | None = None
        self.seconds: list[float] = []  # how long each evaluation took
        self.gaps: list[float] = []  # seconds between announcements

    async def run(self, stop: anyio.Event) -> None:
        r = await retry_forever(lambda: connect(self.url, name=self.name), url=self.url, what="connect", stop=stop)
        rb = await connect(self.url, block_ms=self.cfg.queues.block_ms, name=f"{self.name}-read")
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(heartbeat, r, self.keys, self.name, "eval", self._beat)
                tg.start_soon(self._follow, r, rb)
                done = anyio.Event()
                tg.start_soon(self._evaluate_all, done)
                with anyio.CancelScope() as scope:
                    tg.start_soon(_cancel_on, stop, scope)
                    await done.wait()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                for c in (r, rb):
                    await c.aclose()
            shutil.rmtree(self.cache, ignore_errors=True)

    def _beat(self) -> dict:
        return {"model": self.model, "weight_version": self.evaluating, "evaluated": max(self.done, default=None),
                "waiting": sorted(self.queue)}

    # -- following the versions ------------------------------------------------

    async def _follow(self, r, rb) -> None:
        """Read every announcement from the start of the stream; secure each version that is due."""
        if 0 not in self.done and self.last_due < 0 and any(t.eval.base for t in self.tasks):
            self._put(Due(0, 0, time.time(), None, None, False))
        self.last_due = max(self.last_due, 0)
        stream, last, previous = self.keys.weights(self.model), "0-0", None
        while True:
            try:
                with translated(self.url):
                    reply = await rb.xread({stream: last}, count=64, block=self.cfg.queues.block_ms)
            except ConnectError as e:
                log.warning("%s: %s; retrying", self.name, e)
                await anyio.sleep(1.0)
                continue
            for entry_id, fields in [(i, f) for _, es in reply or [] for i, f in es]:
                last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                announced = int(last.split("-")[0]) / 1000
                if previous is not None:
                    self.gaps.append(announced - previous)
                previous = announced
                w = self._announcement(last, fields)
                due = w is not None and (w.version - self.last_due >= self.every or self._final(w))
                if due:
                    await self._secure(r, w, announced)

    def _announcement(self, entry_id: str, fields) -> WeightVersion | None:
        try:
            w = WeightVersion.from_payload(codec.decode(fields))
        except CodecError as e:
            log.warning("%s: ignoring a malformed announcement %s: %s", self.name, entry_id, e)
            return None
        if w.model != self.model or w.version <= self.last_due:
            return None
        if not w.blob and not self._allowed(w.path):
            log.warning("%s: ignoring version %d: %s is outside the allowed weights folders", self.name, w.version,
                        w.path)
            return None
        return w

    def _allowed(self, path: str) -> bool:
        """Whether `path` is inside the run's weights folder or a configured root (as inference workers check)."""
        return any(Path(path).resolve().is_relative_to(root) for root in self.roots)

    async def _secure(self, r, w: WeightVersion, announced: float) -> None:
        folder = self.cache / f"v{w.version}"
        try:
            if w.blob and not (self._allowed(w.path) and Path(w.path).exists()):  # through Redis, as workers do
                with translated(self.url):
                    source = await blobs.fetch(r, self.keys, self.model, w.version, w.blob, w.blob_chunks, folder)
            else:
                source = await anyio.to_thread.run_sync(secure, Path(w.path), folder)
        except (OSError, WeightsError, ConnectError) as e:  # pruned before we read it (we started late), ...
            log.warning("%s: cannot take version %d (%s): %s", self.name, w.version, w.path, e)
            shutil.rmtree(folder, ignore_errors=True)
            return
        self._put(Due(w.version, w.step, announced, Path(source), w.sha256, self._final(w)))

    def _final(self, w: WeightVersion) -> bool:
        return is_final(w.step, self.cfg, self.model)

    def _put(self, due: Due) -> None:
        self.last_due = due.version
        self.queue[due.version] = due
        self.arrived.set()

    # -- evaluating ----------------------------------------------------------------

    async def _evaluate_all(self, done: anyio.Event) -> None:
        while True:
            while not self.queue:
                self.arrived = anyio.Event()
                await self.arrived.wait()
            newest = max(self.queue)
            skipped = [v for v in sorted(self.queue) if v != newest]
            if skipped:
                self._say_behind(skipped, newest)
            for v in skipped:
                self._drop(self.queue.pop(v))
            due = self.queue.pop(newest)
            await self._evaluate(due)
            self._drop(due)
            if due.final:
                log.info("%s: evaluated the run's final version %d; done", self.name, due.version)
                done.set()
                return

    async def _evaluate(self, due: Due) -> None:
        self.evaluating = due.version
        t0 = time.monotonic()
        try:
            if due.folder is not None:
                await self.backend.aload_weights(due.folder, due.sha256, due.version)
            played = {t.name: await play_rows(self.cfg, t, self.rows[t.name], self.clients[t.name])
                      for t in self.tasks}
        except WeightsError as e:  # a version that cannot be loaded is reported, and the next one awaited
            log.error("%s: cannot evaluate version %d: %s", self.name, due.version, e)
            return
        finally:
            self.evaluating = None
        row = row_of(due, played)
        await anyio.to_thread.run_sync(append_line, self.file, row)
        self.done.add(due.version)
        self.seconds.append(time.monotonic() - t0)
        log.info("%s: version %d (step %d): %s in %.1f s", self.name, due.version, due.step,
                 ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("/reward_mean")), self.seconds[-1])

    def _say_behind(self, skipped: list[int], newest: int) -> None:
        took = sum(self.seconds) / len(self.seconds) if self.seconds else float("nan")
        gap = sum(self.gaps[-20:]) / len(self.gaps[-20:]) if self.gaps else float("nan")
        log.warning("%s is behind: skipping version(s) %s for the newest due, %d (an evaluation takes %.0f s; a "
                    "version comes every %.1f s, and every %d-th is due): training is not held back; raise "
                    "tasks[].eval.every or lower tasks[].eval.n to keep up", self.name, skipped, newest, took, gap,
                    self.every)

    def _drop(self, due: Due) -> None:
        if due.folder is not None:
            shutil.rmtree(self.cache / f"v{due.version}", ignore_errors=True)


async def _cancel_on(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def run(cfg: JetConfig, model: str, url: str, stop: anyio.Event, *, slot: int = 0) -> None:
    """Evaluate `model`'s versions until its final one is evaluated, or `stop`."""
    from jet.workers.inference.worker import make_backend

    m = cfg.model(model)
    # a config without eval sections, or whose workflows cannot run here, fails before the model loads
    in_process(evaluated_tasks(cfg, model), "the evaluator plays workflows in its own process")
    backend = await anyio.to_thread.run_sync(make_backend, m.backend, m.path, m.device, 64, m.dtype,
                                             m.prefix_cache_mb, 1, None)
    try:
        if m.adapter is not None and m.adapter.publish == "adapter" and hasattr(backend, "keep_base_of"):
            await anyio.to_thread.run_sync(backend.keep_base_of, m.adapter.target_modules)
        evaluator = Evaluator(cfg, model, url, backend, slot=slot)
        log.info("%s: evaluating %s on %s (%d rows), every %d versions, from version %s", evaluator.name, model,
                 ", ".join(evaluator.rows), sum(map(len, evaluator.rows.values())), evaluator.every,
                 max(evaluator.done) + 1 if evaluator.done else 0)
        await evaluator.run(stop)
    finally:
        if hasattr(backend, "close"):
            backend.close()


@click.command("eval")
@config_options("models, tasks[].eval, trainer.steps, queues, run")
@click.option("--model", required=True, help="The model whose published versions to evaluate.")
@click.option("--slot", type=click.IntRange(min=0), default=0, show_default=True,
              help="Slot number (a stable name: host-eval-<model>-<slot>).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Torch threads on the CPU (default: torch's own; jet up gives the evaluator 1).")
@click.option("--idle/--no-idle", default=True, show_default=True,
              help="Run in the kernel's idle scheduling class (Linux SCHED_IDLE): a core only when nothing "
                   "else wants it. Elsewhere, or with --no-idle, --nice applies.")
@click.option("--nice", type=click.IntRange(0, 19), default=NICE, show_default=True,
              help="With --no-idle: lower this process's CPU priority by this much, so training keeps the cores.")
@redis_url_option
def cli(config_path, overrides, model, slot, threads, idle, nice, redis_url) -> None:
    """Evaluate a model's published versions on its tasks' held-out rows (tasks[].eval), off the training path."""
    from jet.supervisor import run_role

    cfg = load_config(config_path, overrides)
    if model not in [m.name for m in cfg.models]:
        raise click.UsageError(f"--model: unknown model {model!r}; configured: {[m.name for m in cfg.models]}")
    try:
        evaluated_tasks(cfg, model)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    cfg = require_models(cfg, config_path, [model])
    url = resolve_url(redis_url)
    log.info("evaluator priority: %s", lower_priority(nice, idle))
    if threads:
        import torch

        torch.set_num_threads(threads)
    run_role(lambda stop: run(cfg, model, url, stop, slot=slot), "jet worker eval")


if __name__ == "__main__":
    from jet.options import setup_logging

    setup_logging(os.environ.get("JET_LOG_LEVEL", "INFO"))
    cli()
