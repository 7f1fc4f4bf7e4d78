"""Following `weights:<model>`: the newest announced WeightVersion, loaded between batches.

What it is: `WeightFollower.run` reads the weights stream with plain XREAD (no
group: every inference worker sees every announcement, fan-out), starting from
the newest entry present when it starts, and keeps the latest announcement.
`apply(backend)` is called by the worker between batches: when the latest
version differs from the backend's, it loads it (the backend checks the sha256)
and logs it. What it is not: a trainer-side publisher, or a cache of weights.

Invariants: a batch is always generated with one version (loading happens only
between batches); a version that fails to load (missing file, hash mismatch) is
retried on the next batches up to `MAX_LOAD_TRIES` times, meanwhile the old
weights keep serving, and then it is skipped until a newer one is announced.
"""

from __future__ import annotations

import inspect
import logging

import anyio

from jet.errors import CodecError, ConnectError, WeightsError
from jet.keys import Keys
from jet.queues import codec
from jet.queues.connect import translated
from jet.wire import WeightVersion

log = logging.getLogger(__name__)

MAX_LOAD_TRIES = 3


class WeightFollower:
    def __init__(self, blocking_client, url: str, keys: Keys, model: str, block_ms: int = 2000):
        self.rb, self.url, self.stream, self.block_ms = blocking_client, url, keys.weights(model), block_ms
        self.latest: WeightVersion | None = None
        self._tries: dict[str, int] = {}  # announcement msg_id -> failed loads
        self._last_id = "0-0"

    async def catch_up(self) -> None:
        """Take the newest announcement already in the stream (call once before serving)."""
        with translated(self.url):
            newest = await self.rb.xrevrange(self.stream, "+", "-", count=1)
        for entry_id, fields in newest:
            self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            self._take(fields)

    async def run(self) -> None:
        """Follow new announcements forever (cancel to stop)."""
        while True:
            try:
                with translated(self.url):
                    reply = await self.rb.xread({self.stream: self._last_id}, count=16, block=self.block_ms)
            except ConnectError as e:
                log.warning("weights follower: %s; retrying", e)
                await anyio.sleep(1.0)
                continue
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    self._take(fields)

    def _take(self, fields) -> None:
        try:
            self.latest = WeightVersion.from_payload(codec.decode(fields))
        except CodecError as e:
            log.error("ignoring a malformed weights announcement on %s: %s", self.stream, e)

    async def apply(self, backend) -> bool:
        """Load the latest announced version into `backend` if it is not the one serving; True if loaded."""
        w = self.latest
        if w is None or w.version == backend.version or self._tries.get(w.msg_id, 0) >= MAX_LOAD_TRIES:
            return False
        try:
            if inspect.iscoroutinefunction(getattr(backend, "aload_weights", None)):
                await backend.aload_weights(w.path, w.sha256, w.version)
            else:
                await anyio.to_thread.run_sync(backend.load_weights, w.path, w.sha256, w.version)
        except (WeightsError, OSError) as e:
            self._tries[w.msg_id] = self._tries.get(w.msg_id, 0) + 1
            log.error("cannot load %s version %d (try %d of %d): %s", w.model, w.version,
                      self._tries[w.msg_id], MAX_LOAD_TRIES, e)
            return False
        log.info("%s: now serving weight version %d (step %d) from %s", w.model, w.version, w.step, w.path)
        return True
