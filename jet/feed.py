"""The feeder of `jet up`: keeps every task stream topped up and watches progress.

Topping up: each tick, a task whose backlog (unread + pending Tasks of the
`env` group) is below its target gets more rows, in `group_size` copies, from
its dataset: built-in datasets in deterministic chunks (chunk k uses seed
`trainer.seed + k`), JSONL files cycled. Backlog targets follow the tasks'
`weight`s, so the offered mix matches the configured ratio.
Progress: it XREADs the `traj:<model>` streams without a group (it must never
hold back trimming) and keeps the count and rewards of the trajectories it saw.

Synchronous on the outside (the `jet up` loop is), async inside via a portal.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio.from_thread
import click

from jet.cliopts import config_options, load_config, redis_url_option, resolve_url, run_dir_option
from jet.config import JetConfig
from jet.keys import GROUP_ENV, Keys
from jet.wire import Task, Trajectory

log = logging.getLogger(__name__)


class Feeder:
    def __init__(self, cfg: JetConfig, url: str, *, backlog_per_weight: int | None = None):
        self.cfg, self.url, self.keys = cfg, url, Keys(cfg.run)
        total = sum(t.weight for t in cfg.tasks) or 1.0
        base = backlog_per_weight or max(64, 2 * max(t.concurrency for t in cfg.tasks) * 2)
        self.target = {t.name: max(t.group_size, int(base * t.weight / total * len(cfg.tasks))) for t in cfg.tasks}
        self.chunk = {t.name: 0 for t in cfg.tasks}
        self.file_pos = {t.name: 0 for t in cfg.tasks}
        self.cursor = {m.name: "0-0" for m in cfg.models}
        self.trajectories = 0
        self.failed = 0
        self.rewards: list[float] = []
        self.enqueued = {t.name: 0 for t in cfg.tasks}
        self.last_report: list[tuple] = []
        self._cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._cm.__enter__()
        try:
            self.r = self.portal.call(self._connect)
            self.portal.call(self._start_cursors)
        except BaseException:  # e.g. a fatal MOVED or refused password: the portal thread must not outlive us
            self._cm.__exit__(None, None, None)
            raise

    async def _connect(self):
        from jet.queues.connect import connect

        return await connect(self.url)

    async def _start_cursors(self) -> None:
        """Count only trajectories made from now on (the run may hold older ones)."""
        from jet.queues.connect import translated

        with translated(self.url):
            await self._cursors()

    async def _cursors(self) -> None:
        for m in self.cfg.models:
            last = await self.r.xrevrange(self.keys.traj(m.name), count=1)
            if last:
                self.cursor[m.name] = last[0][0].decode()

    def close(self) -> None:
        try:
            self.portal.call(self.r.aclose)
        finally:
            self._cm.__exit__(None, None, None)

    # -- topping up -----------------------------------------------------------

    def tick(self) -> None:
        from jet.queues.connect import translated

        async def tick() -> None:
            with translated(self.url):  # a redis error is a JetError here: fatal ones end `jet up`
                await self._tick()

        self.portal.call(tick)

    async def _tick(self) -> None:
        report = []
        for t in self.cfg.tasks:
            stream = self.keys.tasks(t.name)
            backlog, length, pending, lag = await self._backlog(stream)
            report.append((self.keys.short(stream), length, pending, lag))
            missing = self.target[t.name] - backlog
            if missing > 0:
                rows = self._rows(t, -(-missing // t.group_size))
                await self._enqueue(t, rows)
        for m in self.cfg.models:
            await self._watch(m.name)
            report.append((self.keys.short(self.keys.traj(m.name)), await self.r.xlen(self.keys.traj(m.name)), "", ""))
        self.last_report = report

    async def _backlog(self, stream: str) -> tuple[int, int, Any, Any]:
        length = await self.r.xlen(stream)
        groups = {g["name"]: g for g in await self.r.xinfo_groups(stream)} if length else {}
        g = groups.get(GROUP_ENV.encode())
        if g is None:
            return length, length, 0, length
        lag = g["lag"] if g["lag"] is not None else length
        return lag + g["pending"], length, g["pending"], lag

    def _rows(self, t, n: int) -> list[dict]:
        from jet.config import _is_path

        if _is_path(t.dataset):
            from jet.enqueue import read_jsonl

            rows = list(read_jsonl(t.dataset))
            if not rows:
                return []
            start = self.file_pos[t.name]
            self.file_pos[t.name] = (start + n) % len(rows)
            return [rows[(start + i) % len(rows)] for i in range(n)]
        from jet.tasks import dataset

        k = self.chunk[t.name]
        self.chunk[t.name] += 1
        return dataset(t.dataset, n=n, seed=self.cfg.trainer.seed * 100_003 + k)

    async def _enqueue(self, t, rows: list[dict]) -> None:
        from jet.enqueue import enqueue, tasks_for

        tasks: list[Task] = tasks_for(t.name, rows, t.group_size)
        maxlen = self.cfg.queues.maxlen.get("tasks", 100_000)
        self.enqueued[t.name] += await enqueue(self.url, self.cfg.run, t.name, tasks, maxlen)

    # -- watching ---------------------------------------------------------------

    async def _watch(self, model: str) -> None:
        from jet.queues import codec

        stream = self.keys.traj(model)
        reply = await self.r.xread({stream: self.cursor[model]}, count=1000)
        for _, entries in reply or []:
            for entry_id, fields in entries:
                self.cursor[model] = entry_id.decode()
                try:
                    traj = Trajectory.from_payload(codec.decode(fields))
                except Exception as e:  # a bad entry is the trainer's to dead-letter; just skip it here
                    log.debug("feeder: unreadable trajectory %s: %s", entry_id, e)
                    continue
                self.trajectories += 1
                if traj.failed:
                    self.failed += 1
                else:
                    r = traj.reward
                    self.rewards.append(sum(r.values()) / len(r) if isinstance(r, dict) and r else float(r or 0))

    def summary(self) -> str:
        recent = self.rewards[-64:]
        mean = f"{sum(recent) / len(recent):.3f}" if recent else "-"
        return (f"enqueued {sum(self.enqueued.values())} tasks; trajectories {self.trajectories} "
                f"({self.failed} failed); reward mean (last {len(recent)}) {mean}")


@click.command("feed")
@config_options("tasks, queues, run")
@click.option("--every", type=float, default=2.0, show_default=True, help="Seconds between top-ups.")
@redis_url_option
@run_dir_option
def cli(config_path, overrides, every, redis_url, run_dir) -> None:
    """Keep every task stream of a config topped up from its dataset (what `jet up` does)."""
    import signal
    import time

    from jet.errors import JetError, is_fatal
    from jet.supervisor import EXIT_FATAL

    cfg = load_config(config_path, overrides)
    try:
        feed = Feeder(cfg, resolve_url(redis_url, run_dir))
    except JetError as e:  # one line, and EXIT_FATAL when no restart can help (jet.supervisor)
        click.echo(f"jet feed: error: {e}", err=True)
        raise SystemExit(EXIT_FATAL if is_fatal(e) else 1) from None
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            feed.tick()
            log.info("%s", feed.summary())
            time.sleep(every)
    except KeyboardInterrupt:
        pass
    except JetError as e:
        click.echo(f"jet feed: error: {e}", err=True)
        raise SystemExit(EXIT_FATAL if is_fatal(e) else 1) from None
    finally:
        feed.close()
