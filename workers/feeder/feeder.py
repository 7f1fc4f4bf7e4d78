"""The feeder (`jet feed`, and inside `jet up`): keeps every task stream topped up and watches progress.

Topping up: each tick, a task whose backlog (unread + pending Tasks of the
`env` group) is below its target gets more rows, in `group_size` copies, from
its dataset: built-in datasets in deterministic chunks (chunk k uses seed
`trainer.seed + k`), files and Hub datasets (jet.rows) read once and cycled. Backlog targets follow the tasks'
`weight`s, so the offered mix matches the configured ratio.
Admission (`trainer.admission: staleness`, the default): a trained model's
episodes start only while the trajectories admitted for it and not yet decided
by its trainer (trained, stale, failed, dropped with a small group, malformed,
poison) stay within `(max_staleness + 1) x batch_groups` groups, so the swarm
never generates a sample only for it to arrive stale (AReaL's admission rule);
with `trainer.skip_no_signal`, groups it will train: the window is divided by
the share of recent done groups that had a signal (`Feeder.recent_share`).
Both counts live in the hash `Keys.rollout(model)`: `admitted`, which the
feeder raises as it enqueues, and `counts`, the trainer's outcome counts,
rewritten after every step (and restored from its checkpoint on a resume).
Work that dead-letters never reaches a trainer outcome (a task an env worker
crash loop dead-lettered, a trajectory the trainer's consumer did): the feeder
reads the dead stream from where it last stopped (`dead_seen` in the same hash)
and counts each such entry of a model in its `dead` field, decided too, so lost
work never closes the window for good (a dead letter put back with
`jet dlq requeue` is then decided twice: the window runs one wider until the
next resume resets it).
Within the budget, rows go to the task furthest below its weight's share. Tasks
enqueued by hand (`jet enqueue`) are not admitted: they run as they come.
Progress: it XREADs the `traj:<model>` streams without a group (it must never
hold back trimming) and keeps the count and rewards of the trajectories it saw.

Synchronous on the outside (the `jet up` loop is), async inside via a portal.
`jet feed`, started by hand (maybe before its Redis, e.g. `jet server & jet feed`), waits for Redis with
backoff like every other role, at start and whenever the connection is lost; under `jet up`, which
started the server itself, a refused connection is an error at once.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import anyio.from_thread
import click

from jet.options import config_options, load_config, redis_url_option, resolve_url, run_dir_option
from jet.config import JetConfig
from jet.keys import ENDING, GROUP_ENV, Keys
from jet.wire import Task, Trajectory

log = logging.getLogger(__name__)


class Feeder:
    def __init__(self, cfg: JetConfig, url: str, *, backlog_per_weight: int | None = None, wait: bool = False):
        self.cfg, self.url, self.keys = cfg, url, Keys(cfg.run)
        total = sum(t.weight for t in cfg.tasks) or 1.0
        base = backlog_per_weight or max(64, 2 * max(t.concurrency for t in cfg.tasks) * 2)
        self.target = {t.name: max(t.group_size, int(base * t.weight / total * len(cfg.tasks))) for t in cfg.tasks}
        self.chunk = {t.name: 0 for t in cfg.tasks}
        self.file_pos = {t.name: 0 for t in cfg.tasks}
        self.file_rows: dict[str, list[dict]] = {}  # task -> rows of its file or Hub dataset
        self.cursor = {m.name: "0-0" for m in cfg.models}
        self.dead_cursor = "0-0"  # the dead stream, read for admitted work that will never be decided
        self.trajectories = 0
        self.failed = 0
        self.rewards: list[float] = []
        self.enqueued = {t.name: 0 for t in cfg.tasks}
        self.outcomes: dict[str, dict[str, int]] = {}  # model -> its trainer's outcome counts (admission)
        self.signal_seen: dict[str, list[tuple[int, int]]] = {}  # model -> (groups trained, dropped) seen (skip)
        self.last_report: list[tuple] = []
        self._cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._cm.__enter__()
        try:
            self.r = self.portal.call(self._connect, wait)
            self.portal.call(self._start_cursors)
        except BaseException:  # e.g. a fatal MOVED or refused password: the portal thread must not outlive us
            self._cm.__exit__(*sys.exc_info())  # with the error: a wait still running is cancelled, not awaited
            raise

    async def _connect(self, wait: bool):
        """The client; with `wait` (`jet feed`, started by hand maybe before its Redis) a refused or lost
        connection is retried with backoff until Redis answers, as every other role does
        (`retry_forever`); without (`jet up`, which started the server) it is an error at once."""
        from jet.queues.connect import connect, retry_forever

        if wait:
            return await retry_forever(lambda: connect(self.url), url=self.url, what="jet feed: connect")
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
        seen = [await self.r.hget(self.keys.rollout(m), "dead_seen") for m in self.admitted_models()]
        if any(seen):  # a restarted feeder goes on where the last one stopped
            self.dead_cursor = min((v.decode() for v in seen if v), key=lambda i: tuple(map(int, i.split("-"))))
        else:  # a new run: dead letters older than its first feeder are no admitted work
            last = await self.r.xrevrange(self.keys.dead, count=1)
            self.dead_cursor = last[0][0].decode() if last else "0-0"

    def close(self) -> None:
        try:
            self.portal.call(self.r.aclose)
        finally:
            self._cm.__exit__(None, None, None)

    def longest_micro_batch_s(self) -> float:
        """The longest micro-batch any live trainer of the run reported in its heartbeat (s); 0 if none
        (or Redis is unreachable): how long a stopping trainer may still be busy (`jet up`'s drain)."""
        from jet.queues import registry
        from jet.errors import QueueError

        async def longest() -> float:
            try:
                seen = await registry.workers(self.r, self.keys, url=self.url)
            except QueueError:
                return 0.0
            times = [w.get("micro_batch_s") for w in seen if w["alive"] and w.get("role") == "trainer"]
            return max([float(t) for t in times if isinstance(t, (int, float))], default=0.0)

        return self.portal.call(longest)

    # -- topping up -----------------------------------------------------------

    def tick(self) -> None:
        from jet.queues.connect import translated

        async def tick() -> None:
            with translated(self.url):  # a redis error is a JetError here: fatal ones end `jet up`
                await self._tick()

        self.portal.call(tick)

    async def _tick(self) -> None:
        report, want = [], {}
        for t in self.cfg.tasks:
            stream = self.keys.tasks(t.name)
            backlog, length, pending, lag = await self._backlog(stream)
            report.append((self.keys.short(stream), length, pending, lag))
            want[t.name] = max(0, -(-(self.target[t.name] - backlog) // t.group_size))
        budgets = await self._budgets()
        allotted = allot(self.cfg.tasks, want, budgets, self.enqueued)
        for t in self.cfg.tasks:
            if allotted[t.name]:
                await self._enqueue(t, self._rows(t, allotted[t.name]))
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
        from jet.rows import kind

        if kind(t.dataset) != "builtin":
            from jet.rows import read

            if t.name not in self.file_rows:  # read (and validated) once: a parquet or Hub dataset is no tail
                self.file_rows[t.name] = read(t.dataset)
            rows = self.file_rows[t.name]
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
        from jet.workers.feeder.tasks import enqueue, tasks_for

        tasks: list[Task] = tasks_for(t.name, rows, t.group_size)
        maxlen = self.cfg.queues.maxlen.get("tasks", 100_000)
        sent = await enqueue(self.url, self.cfg.run, t.name, tasks, maxlen)
        self.enqueued[t.name] += sent
        if self._admitted(t.model):
            await self.r.hincrby(self.keys.rollout(t.model), "admitted", sent)

    # -- admission --------------------------------------------------------------

    def _admitted(self, model: str) -> bool:
        """Whether `model`'s episodes are admitted against its trainer's progress."""
        m = self.cfg.model(model)
        return m.trainable and self.cfg.trainer_of(model).admission == "staleness"

    def admitted_models(self) -> list[str]:
        return sorted({t.model for t in self.cfg.tasks if self._admitted(t.model)})

    async def _count_dead(self) -> None:
        """Count the dead letters of admitted work since the last look (`dead` in `Keys.rollout(model)`):
        a task of an admitted model's task, or a trajectory of an admitted model, is one trajectory that
        no trainer outcome will ever decide."""
        from jet.queues import codec
        from jet.queues.messages import TRAINER_REASON

        models = self.admitted_models()
        if not models:
            return
        task_model = {self.keys.short(self.keys.tasks(t.name)): t.model for t in self.cfg.tasks}
        traj_model = {self.keys.short(self.keys.traj(m)): m for m in models}
        reply = await self.r.xread({self.keys.dead: self.dead_cursor}, count=1000)
        entries = [e for _, es in reply or [] for e in es]
        if not entries:
            return
        lost: dict[str, int] = {}
        for _, fields in entries:
            try:
                meta = codec.decode(fields, max_bytes=1 << 62).meta
            except Exception:  # garbage written to the dead stream itself names no admitted work
                continue
            if str(meta.get("reason", "")).startswith(TRAINER_REASON):  # the trainer counted it: poison
                continue
            stream = meta.get("stream")
            model = task_model.get(stream) or traj_model.get(stream)
            if model in models:
                lost[model] = lost.get(model, 0) + 1
        self.dead_cursor = entries[-1][0].decode()
        async with self.r.pipeline(transaction=True) as p:  # the counts and the cursor move together
            for model in models:
                if lost.get(model):
                    p.hincrby(self.keys.rollout(model), "dead", lost[model])
                p.hset(self.keys.rollout(model), "dead_seen", self.dead_cursor)
            await p.execute()
        for model, n in sorted(lost.items()):
            log.warning("feeder: %d admitted trajectories of %s were dead-lettered (`jet dlq list`); counted as "
                        "decided, so the admission window stays open", n, model)

    def window(self, model: str, counts: dict[str, int] | None = None) -> int:
        """Trajectories of `model` that may be admitted and not yet decided: (max_staleness + 1) batches of
        groups its trainer will train. With `trainer.skip_no_signal` a batch takes more groups than it trains
        (those with all-equal rewards are dropped), so the window is divided by the share of recent done
        groups that had a signal, from the trainer's outcome `counts` (`recent_share`): else it fills with
        groups about to be dropped while the trainer steps, and generation waits for the step to end."""
        tc = self.cfg.trainer_of(model)
        size = max(t.group_size for t in self.cfg.tasks if t.model == model)
        base = (tc.max_staleness + 1) * tc.batch_groups * size
        if not tc.skip_no_signal or counts is None:
            return base
        return round(base / self.recent_share(model, counts))

    def recent_share(self, model: str, counts: dict[str, int]) -> float:
        """`signal_share` over the last (max_staleness + 1) x batch_groups x 2 groups `model`'s trainer
        decided (all of them while it has decided fewer): the share moves as the model learns, and a
        window sized by an old, lower share admits more trainable groups than the bound lets it train."""
        tc = self.cfg.trainer_of(model)
        span = 2 * (tc.max_staleness + 1) * tc.batch_groups
        now = int(counts.get("groups_trained", 0)), int(counts.get("groups_no_signal", 0))
        seen = self.signal_seen.setdefault(model, [(0, 0)])
        if now[0] < seen[-1][0] or now[1] < seen[-1][1]:  # counts went back (a group evicted, a resume)
            seen[:] = [(0, 0)]
        if now != seen[-1]:
            seen.append(now)
        older = [i for i, (t, d) in enumerate(seen) if sum(now) - t - d >= span]
        del seen[:older[-1] if older else 0]  # keep the newest snapshot at least `span` groups back
        return signal_share(now, seen[0])

    async def flow(self, model: str) -> tuple[int, dict[str, int]]:
        """(trajectories admitted, the trainer's outcome counts and the feeder's `dead`) of `model`, from
        `Keys.rollout`."""
        import orjson

        raw = await self.r.hgetall(self.keys.rollout(model))
        admitted = int(raw.get(b"admitted", 0))
        try:
            counts = orjson.loads(raw.get(b"counts", b"{}"))
        except orjson.JSONDecodeError:
            counts = {}
        counts = counts if isinstance(counts, dict) else {}
        if raw.get(b"dead"):
            counts = {**counts, "dead": int(raw[b"dead"])}
        return admitted, counts

    async def _budgets(self) -> dict[str, int]:
        """Trajectories each admitted model may still take now (models not admitted are absent)."""
        out = {}
        await self._count_dead()
        for model in self.admitted_models():
            admitted, counts = await self.flow(model)
            done = decided(counts)
            if admitted < done:  # a trainer resumed on a fresh server: start the window from its count
                await self.r.hset(self.keys.rollout(model), "admitted", done)
                admitted = done
            out[model] = max(0, self.window(model, counts) - (admitted - done))
            self.outcomes[model] = counts
        return out

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
        trained = ""
        for model, c in sorted(self.outcomes.items()):
            dropped = decided(c) - c.get("trained", 0) - c.get("stale", 0)  # the other final outcomes
            trained += f"; {model}: trained {c.get('trained', 0)}, stale {c.get('stale', 0)}, dropped {dropped}"
        return (f"enqueued {sum(self.enqueued.values())} tasks; trajectories {self.trajectories} "
                f"({self.failed} failed); reward mean (last {len(recent)}) {mean}{trained}")


# Outcomes that end an admitted trajectory: the trainer's (`jet.keys.ENDING`, and `poison`: a
# member the trainer dead-lettered) and the feeder's own `dead` (dead-lettered before any trainer outcome).
FINAL = (*ENDING, "poison", "dead")


SIGNAL_SHARE_FLOOR = 1 / 8  # the widest window skip_no_signal opens: 8 times the batches it would train


def signal_share(now: tuple[int, int], before: tuple[int, int] = (0, 0)) -> float:
    """The share of a trainer's groups that had a signal (trained, not dropped by `skip_no_signal`) between
    two of its (groups trained, groups dropped with no signal) counts, with one trained group counted in
    advance (1 before any), and never below SIGNAL_SHARE_FLOOR: a model whose rewards never vary does not
    open an unbounded window."""
    trained, dropped = max(0, now[0] - before[0]), max(0, now[1] - before[1])
    return max(SIGNAL_SHARE_FLOOR, (trained + 1) / (trained + dropped + 1))


def decided(counts: dict[str, int]) -> int:
    """Admitted trajectories the trainer is done with, from its outcome counts."""
    return sum(int(counts.get(k, 0)) for k in FINAL)


def allot(tasks, want: dict[str, int], budgets: dict[str, int], enqueued: dict[str, int]) -> dict[str, int]:
    """Rows to enqueue per task: at most `want`, within each admitted model's budget (trajectories;
    models without one are unlimited), a row at a time to the task furthest below its weight's share."""
    out = {t.name: 0 for t in tasks}
    left = dict(budgets)
    share = {t.name: enqueued.get(t.name, 0) for t in tasks}
    while True:
        open_ = [t for t in tasks if out[t.name] < want.get(t.name, 0)
                 and left.get(t.model, t.group_size) >= t.group_size]
        if not open_:
            return out
        t = min(open_, key=lambda t: (share[t.name] / t.weight if t.weight > 0 else float("inf"), t.name))
        out[t.name] += 1
        share[t.name] += t.group_size
        if t.model in left:
            left[t.model] -= t.group_size


@click.command("feed")
@config_options("tasks, queues, run")
@click.option("--every", type=float, default=2.0, show_default=True, help="Seconds between top-ups.")
@redis_url_option
@run_dir_option
def cli(config_path, overrides, every, redis_url, run_dir) -> None:
    """Keep every task stream of a config topped up from its dataset (what `jet up` does)."""
    import signal
    import time

    from jet.errors import ConnectError, JetError, is_fatal
    from jet.supervisor import EXIT_FATAL

    cfg = load_config(config_path, overrides)
    url = resolve_url(redis_url, run_dir)

    def stopped(*_) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stopped)  # while it waits for Redis: nothing to finish yet
    try:
        feed = Feeder(cfg, url, wait=True)
    except KeyboardInterrupt:
        raise SystemExit(0) from None
    except JetError as e:  # one line, and EXIT_FATAL when no restart can help (jet.supervisor)
        click.echo(f"jet feed: error: {e}", err=True)
        raise SystemExit(EXIT_FATAL if is_fatal(e) else 1) from None
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    delay = every
    try:
        while not stop:
            try:
                feed.tick()
            except ConnectError as e:  # Redis restarting or a network blip: wait for it, as the other roles do
                log.warning("jet feed: %s; retrying in %.1fs", e, delay)
                time.sleep(delay)
                delay = min(30.0, delay * 2)
                continue
            delay = every
            log.info("%s", feed.summary())
            time.sleep(every)
    except KeyboardInterrupt:
        pass
    except JetError as e:
        click.echo(f"jet feed: error: {e}", err=True)
        raise SystemExit(EXIT_FATAL if is_fatal(e) else 1) from None
    finally:
        feed.close()
