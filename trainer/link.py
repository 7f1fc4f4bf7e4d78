"""The trainer's one adapter to the queues: a sync facade over the consumer runtime's pull mode.

What it is: `Link` runs a `jet.queues.runtime.Runtime` on `traj:<model>`
(group `trainer`, a stable consumer name) in an event loop on a background
thread (an anyio blocking portal); the runtime's lease keeper, reaper and
reconnects run there. The synchronous training loop gets plain methods:

- `poll()`: the next trajectories (own pending entries first after a
  restart, then reclaimed, then new; blocks at most `block_ms`); malformed
  entries and trajectories of another model are dead-lettered here;
- `ack(entries)`: acks entries and sets their idempotency markers in one
  atomic step: called only after the checkpoint or resume point recording
  their fate is on disk; entries known only from its ledger (after a restart) too;
- `dead(entry_id, reason)`: dead-letters one held entry with its real reason
  (a trajectory the trainer cannot train on), atomically with its ack;
- `publish(w)`: announces a WeightVersion on `weights:<model>` (dedup'd by
  its message id, so a retried publish is announced once);
- `put_blob(version, folder, files, keep, max_bytes)`: a small version's files as chunks
  on `wblob:<model>` (`jet.queues.blobs`), for workers without the run folder;
- `latest_weights()`, `lag()`: the newest announcement; the group's lag;
- `served_versions()`: the weight version each live inference worker of the
  model serves, from their heartbeats (None when Redis is unreachable).

Every entry handed out stays pending (leased, renewed every lease/3) until
it is acked: the trainer holds entries for minutes (group assembly, then until
the next resume point or checkpoint), hence its long lease. Entries already held are never
handed out twice, not even when a reconnect makes the consumer re-read its
own pending entries. Re-reading them after a restart does not count as a
delivery (`Settings.count_rereads` off): a trainer that restarts never
dead-letters the trajectories it held as "delivered too often".

What it is not: policy. Which entry is trained, dropped or acked when is the
loop's business (`jet.trainer.loop`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import anyio
import anyio.from_thread

from jet.config import JetConfig
from jet.errors import CodecError, ConnectError, QueueError
from jet.keys import GROUP_TRAINER, Keys
from jet.queues import blobs, codec, registry
from jet.queues.connect import retry_forever, translated
from jet.queues.consumer import Settings, consumer_name
from jet.queues.messages import Commit, Dead, Delivery
from jet.queues.producer import Producer
from jet.queues.runtime import Runtime
from jet.wire import Trajectory, WeightVersion

log = logging.getLogger(__name__)

ACK_CHUNK = 500


class Link:
    def __init__(self, url: str, keys: Keys, model: str, name: str, settings: Settings,
                 weights_maxlen: int = 10_000, stop: Callable[[], bool] | None = None):
        self.url, self.keys, self.model, self.name, self.settings = url, keys, model, name, settings
        self.weights_maxlen = weights_maxlen
        self.stop = stop  # polled while connecting: a trainer stuck waiting for Redis still obeys SIGTERM
        self.held: dict[str, Delivery] = {}  # handed out, not yet acked
        self.status: dict = {"model": model}  # what the trainer's heartbeat says (the loop updates it)
        self._portal_cm = None

    @classmethod
    def for_trainer(cls, cfg: JetConfig, model: str, url: str, stop: Callable[[], bool] | None = None) -> "Link":
        """The link of `model`'s trainer: consumer `<host>-trainer-<model>-0`, the trainer's long lease."""
        q, lease_ms = cfg.queues, int(cfg.trainer_of(model).lease_s * 1000)
        settings = Settings.of(q, lease_ms=lease_ms, block_ms=min(q.block_ms, lease_ms // 4), count_rereads=False)
        return cls(url, Keys(cfg.run), model, consumer_name(f"trainer-{model}"), settings,
                   q.maxlen.get("weights", 10_000), stop)

    # -- lifecycle (sync) ----------------------------------------------------

    def __enter__(self) -> "Link":
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        try:
            stop_event = self.portal.call(anyio.Event)
            if self.stop is not None:
                self._watcher = threading.Thread(target=self._watch_stop, args=(stop_event,), daemon=True)
                self._watcher.start()
            self.rt = Runtime(self.url, self.keys, self.keys.traj(self.model), GROUP_TRAINER, self.name,
                              self.settings, stop=stop_event, role="trainer", beat=lambda: self.status)
            self._rt_cm = self.portal.wrap_async_context_manager(self.rt)
            self._rt_cm.__enter__()
            self.producer = Producer(self.rt.client, self.url, self.keys, self.keys.weights(self.model),
                                     maxlen=self.weights_maxlen, dedup=True, marker_ttl_s=self.settings.marker_ttl)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            self._portal_cm = None
            raise
        return self

    def _watch_stop(self, event: anyio.Event) -> None:
        while self._portal_cm is not None and not event.is_set():
            if self.stop():
                with contextlib.suppress(RuntimeError):  # the portal closed meanwhile
                    self.portal.call(event.set)
                return
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the runtime; entries still held are given back at once (their lease is not waited out)."""
        if self._portal_cm is None:
            return
        try:
            self._rt_cm.__exit__(None, None, None)
        finally:
            cm, self._portal_cm = self._portal_cm, None
            cm.__exit__(None, None, None)

    # -- the loop's calls (sync) --------------------------------------------

    def poll(self) -> list[tuple[str, Trajectory]]:
        self.rt.check()
        return self.portal.call(self._poll)

    def ack(self, entries: Sequence[tuple[str, str]]) -> None:
        """Ack (entry id, message id) pairs, with their markers; safe to repeat."""
        if entries:
            self.portal.call(self._ack, list(entries))

    def dead(self, entry_id: str, reason: str) -> None:
        """Dead-letter a held entry with `reason` (acked with it): the trainer cannot train on it."""
        self.portal.call(self._dead, entry_id, reason)

    def publish(self, w: WeightVersion) -> None:
        self.portal.call(self._publish, w)

    def put_blob(self, version: int, folder: Path, files: Sequence[str], keep: int,
                 max_bytes: int) -> tuple[str, int]:
        """Append a version's files to `wblob:<model>` when they fit in `max_bytes`; (first entry id, chunks)
        for its announcement, or ("", 0) when they are larger (workers then read the run folder)."""
        if blobs.version_bytes(folder, files) > max_bytes:
            return "", 0
        return self.portal.call(self._put_blob, version, folder, list(files), keep)

    def latest_weights(self) -> WeightVersion | None:
        return self.portal.call(self._latest_weights)

    def report(self, counts: dict[str, int]) -> bool:
        """Write the trainer's outcome counts where the feeder's admission reads them (`Keys.rollout`);
        a Redis error skips this report (False: the caller writes the counts again later)."""
        return self.portal.call(self._report, counts)

    def served_versions(self) -> dict[str, int] | None:
        """{inference worker: weight version it serves} from the registry; None if Redis is unreachable."""
        return self.portal.call(self._served_versions)

    def lag(self) -> dict[str, int]:
        """{'lag': entries not yet read by the trainer group, 'pending': read and not acked}; {} if unreachable."""
        return self.portal.call(self._lag)

    # -- async side -----------------------------------------------------------

    async def _poll(self) -> list[tuple[str, Trajectory]]:
        out = []
        for d in await self.rt.fetch():
            if d.entry_id in self.held:
                continue
            try:
                t = Trajectory.from_payload(d.payload)
                if t.model != self.model:
                    raise CodecError(f"a trajectory of model {t.model!r} on the stream of {self.model!r}")
            except CodecError as e:
                await self.rt.settle([(d, Dead(str(e)))])
                continue
            self.held[d.entry_id] = d
            out.append((d.entry_id, t))
        return out

    async def _dead(self, entry_id: str, reason: str) -> None:
        d = self.held.pop(entry_id, None)
        if d is not None:
            await self.rt.settle([(d, Dead(reason))])

    async def _ack(self, entries: list[tuple[str, str]]) -> None:
        known = [(e, m) for e, m in entries if e not in self.held]
        held = [self.held.pop(e) for e, _ in entries if e in self.held]
        for i in range(0, len(held), ACK_CHUNK):
            await self.rt.settle([(d, Commit()) for d in held[i:i + ACK_CHUNK]])
        if known:  # acked after a restart, before they were read again
            await self.rt.ack_known(known)

    async def _put_blob(self, version: int, folder: Path, files: list[str], keep: int) -> tuple[str, int]:
        async def put():
            with translated(self.url):
                return await blobs.put(self.rt.client, self.keys, self.model, version, folder, files,
                                       keep_versions=keep)

        return await retry_forever(put, url=self.url, what="put weights in Redis")

    async def _publish(self, w: WeightVersion) -> None:
        await retry_forever(lambda: self.producer.send([w.to_fields()]), url=self.url, what="publish weights")

    async def _latest_weights(self) -> WeightVersion | None:
        async def newest_entry():
            with translated(self.url):
                return await self.rt.client.xrevrange(self.keys.weights(self.model), "+", "-", count=1)

        newest = await retry_forever(newest_entry, url=self.url, what="read weights announcements")
        for _, fields in newest:
            try:
                return WeightVersion.from_payload(codec.decode(fields))
            except CodecError as e:
                log.error("ignoring a malformed weights announcement: %s", e)
        return None

    async def _report(self, counts: dict[str, int]) -> bool:
        import orjson

        try:
            with translated(self.url):
                await self.rt.client.hset(self.keys.rollout(self.model), "counts", orjson.dumps(counts))
            return True
        except QueueError as e:
            log.warning("could not report the outcome counts: %s", e)
            return False

    async def _served_versions(self) -> dict[str, int] | None:
        try:
            return await registry.served(self.rt.client, self.keys, self.model, url=self.url)
        except QueueError:
            return None  # retention waits for the next publish rather than guess

    async def _lag(self) -> dict[str, int]:
        try:
            with translated(self.url):
                groups = await self.rt.client.xinfo_groups(self.rt.stream)
        except ConnectError:
            return {}  # a metric is not worth a crash; the next step asks again
        for g in groups:
            g = {(k.decode() if isinstance(k, bytes) else k): v for k, v in g.items()}
            name = g.get("name")
            if (name.decode() if isinstance(name, bytes) else name) == GROUP_TRAINER:
                return {"lag": int(g.get("lag") or 0), "pending": int(g.get("pending") or 0)}
        return {"lag": 0, "pending": 0}
