"""The trainer's one adapter to the queues: a sync facade over an async consumer of `traj:<model>`.

What it is: `Feed` runs a `jet.queues` Consumer (group `trainer`, a stable
consumer name) in an event loop on a background thread (an anyio blocking
portal), with the lease keeper and the reaper running there, and gives the
synchronous training loop plain methods:

- `poll()`: the next trajectories (own pending entries first after a
  restart, then reclaimed, then new; blocks at most `block_ms`); malformed
  entries and trajectories of another model are dead-lettered here;
- `ack(entries)`: acks entries and sets their idempotency markers in one
  atomic step (`Consumer.commit` with no outputs): called only after the
  checkpoint recording their fate is on disk;
- `dead(entry_id, reason)`: dead-letters one held entry with the trainer's
  reason (the dead letter and the ack are one atomic step): a trajectory the
  trainer can never train (`jet.trainer.screen`);
- `publish(w)`: announces a WeightVersion on `weights:<model>` (dedup'd by
  its message id, so a retried publish is announced once);
- `latest_weights()`, `lag()`: the newest announcement; the group's lag.

Every entry handed out stays pending (leased, renewed every lease/3) until
it is acked: the trainer holds entries for minutes (group assembly, then until
the next checkpoint), hence its long lease. Entries already held are never
handed out twice, not even when a reconnect makes the consumer re-read its
own pending entries.

What it is not: policy. Which entry is trained, dropped or acked when is the
loop's business (`jet.trainer.loop`).
"""

from __future__ import annotations

import logging
from typing import Sequence

import anyio
import anyio.from_thread

from jet.config import JetConfig
from jet.errors import CodecError, ConnectError, QueueError
from jet.keys import GROUP_TRAINER, Keys
from jet.queues import codec
from jet.queues.connect import connect, retry_forever, translated
from jet.queues.consumer import Consumer, Delivery, Settings, consumer_name
from jet.queues.producer import Producer
from jet.queues.reaper import Reaper
from jet.queues.serve import lease_keeper, reaper_loop
from jet.wire import Trajectory, WeightVersion

log = logging.getLogger(__name__)

ACK_CHUNK = 500


class Feed:
    def __init__(self, url: str, keys: Keys, model: str, name: str, settings: Settings,
                 weights_maxlen: int = 10_000):
        self.url, self.keys, self.model, self.name, self.settings = url, keys, model, name, settings
        self.weights_maxlen = weights_maxlen
        self.held: dict[str, Delivery] = {}  # handed out, not yet acked
        self._portal_cm = None

    @classmethod
    def for_trainer(cls, cfg: JetConfig, model: str, url: str) -> "Feed":
        """The feed of `model`'s trainer: consumer `<host>-trainer-<model>-0`, the trainer's long lease."""
        q, lease_ms = cfg.queues, int(cfg.trainer_of(model).lease_s * 1000)
        settings = Settings(lease_ms=lease_ms, max_deliveries=q.max_deliveries,
                            block_ms=min(q.block_ms, lease_ms // 4), batch=q.batch, marker_ttl_s=q.marker_ttl_s,
                            max_entry_bytes=q.max_entry_bytes)
        return cls(url, Keys(cfg.run), model, consumer_name(f"trainer-{model}"), settings,
                   q.maxlen.get("weights", 10_000))

    # -- lifecycle (sync) ----------------------------------------------------

    def __enter__(self) -> "Feed":
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        try:
            self.portal.call(self._open)
            self._background = self.portal.start_task_soon(self._helpers)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close(release=True)

    def close(self, release: bool = True) -> None:
        """Stop the helpers; with `release`, give held entries back at once (else their lease runs out)."""
        if self._portal_cm is None:
            return
        try:
            self.portal.call(self._close, release)
        finally:
            self._portal_cm.__exit__(None, None, None)
            self._portal_cm = None

    # -- the loop's calls (sync) --------------------------------------------

    def poll(self) -> list[tuple[str, Trajectory]]:
        self._check_helpers()
        return self.portal.call(self._poll)

    def ack(self, entries: Sequence[tuple[str, str]]) -> None:
        """Ack (entry id, message id) pairs, with their markers; safe to repeat."""
        if entries:
            self.portal.call(self._ack, list(entries))

    def dead(self, entry_id: str, reason: str) -> None:
        """Dead-letter a held entry with `reason`; it is never handed out again (unknown ids: no-op)."""
        d = self.held.pop(entry_id, None)
        if d is not None:
            self.portal.call(self._dead, d, reason)

    def publish(self, w: WeightVersion) -> None:
        self.portal.call(self._publish, w)

    def latest_weights(self) -> WeightVersion | None:
        return self.portal.call(self._latest_weights)

    def lag(self) -> dict[str, int]:
        """{'lag': entries not yet read by the trainer group, 'pending': read and not acked}; {} if unreachable."""
        return self.portal.call(self._lag)

    # -- async side -----------------------------------------------------------

    async def _open(self) -> None:
        self.r = await retry_forever(lambda: connect(self.url, name=self.name), url=self.url, what="connect")
        self.rb = await connect(self.url, block_ms=self.settings.block_ms, name=self.name)
        self.c = Consumer(self.r, self.rb, self.url, self.keys, self.keys.traj(self.model), GROUP_TRAINER,
                          self.name, self.settings)
        await retry_forever(self.c.ensure_group, url=self.url, what=f"create group {GROUP_TRAINER}")
        self.producer = Producer(self.r, self.url, self.keys, self.keys.weights(self.model),
                                 maxlen=self.weights_maxlen, dedup=True, marker_ttl_s=self.settings.marker_ttl_s)
        self._stop = anyio.Event()

    async def _helpers(self) -> None:
        every = min(5.0, max(0.1, self.settings.lease_ms / 2000))
        async with anyio.create_task_group() as tg:
            tg.start_soon(lease_keeper, self.c, self._stop)
            tg.start_soon(reaper_loop, Reaper(self.c), self._stop, every)

    def _check_helpers(self) -> None:
        if self._background.done() and not self._stop.is_set():
            self._background.result()  # re-raise what killed them
            raise QueueError("the trainer's lease keeper and reaper stopped")

    async def _close(self, release: bool) -> None:
        self._stop.set()
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            try:
                if release and self.c.inflight:
                    await self.c.release()
            except QueueError as e:
                log.warning("could not release held entries (their lease will expire): %s", e)
        for client in (self.r, self.rb):
            await client.aclose()

    async def _poll(self) -> list[tuple[str, Trajectory]]:
        try:
            batch = await self.c.fetch()
        except ConnectError as e:
            log.warning("%s; reconnecting", e)
            await anyio.sleep(0.5)
            self.c.restarted()
            self.c.inflight.update(self.held)  # still ours: keep renewing, never hand out twice
            await retry_forever(self.c.ensure_group, url=self.url, what="reconnect")
            return []
        out = []
        for d in batch:
            if d.entry_id in self.held:
                continue
            try:
                t = Trajectory.from_payload(d.payload)
                if t.model != self.model:
                    raise CodecError(f"a trajectory of model {t.model!r} on the stream of {self.model!r}")
            except CodecError as e:
                await self._dead(d, str(e))
                continue
            self.held[d.entry_id] = d
            out.append((d.entry_id, t))
        return out

    async def _dead(self, d: Delivery, reason: str) -> None:
        try:
            await self.c.dead(d.entry_id, d.fields, reason, d.deliveries)
        except ConnectError as e:  # left pending, unrenewed: the reaper hands it back after the lease
            self.c.inflight.pop(d.entry_id, None)
            log.warning("could not dead-letter %s yet: %s", d.entry_id, e)

    async def _ack(self, entries: list[tuple[str, str]]) -> None:
        items = []
        for entry_id, msg_id in entries:
            d = self.held.pop(entry_id, None)
            if d is None:  # acked after a restart, before it was read again
                d = Delivery(self.c.stream, entry_id, {}, codec.Payload(Trajectory.KIND, msg_id, {}))
            items.append((d, []))
        for i in range(0, len(items), ACK_CHUNK):
            chunk = items[i:i + ACK_CHUNK]
            await retry_forever(lambda: self.c.commit(chunk), url=self.url, what="ack trajectories")

    async def _publish(self, w: WeightVersion) -> None:
        await retry_forever(lambda: self.producer.send([w.to_fields()]), url=self.url, what="publish weights")

    async def _latest_weights(self) -> WeightVersion | None:
        async def newest_entry():
            with translated(self.url):
                return await self.r.xrevrange(self.keys.weights(self.model), "+", "-", count=1)

        newest = await retry_forever(newest_entry, url=self.url, what="read weights announcements")
        for _, fields in newest:
            try:
                return WeightVersion.from_payload(codec.decode(fields))
            except CodecError as e:
                log.error("ignoring a malformed weights announcement: %s", e)
        return None

    async def _lag(self) -> dict[str, int]:
        try:
            with translated(self.url):
                groups = await self.r.xinfo_groups(self.c.stream)
        except ConnectError:
            return {}  # a metric is not worth a crash; the next step asks again
        for g in groups:
            g = {(k.decode() if isinstance(k, bytes) else k): v for k, v in g.items()}
            name = g.get("name")
            if (name.decode() if isinstance(name, bytes) else name) == GROUP_TRAINER:
                return {"lag": int(g.get("lag") or 0), "pending": int(g.get("pending") or 0)}
        return {"lag": 0, "pending": 0}
