"""Following `weights:<model>`: each announced WeightVersion checked, then loaded, or dead-lettered.

What it is: `WeightFollower` reads the weights stream with plain XREAD (no
group: every inference worker sees every announcement, fan-out). `catch_up`
loads the newest acceptable announcement already in the stream (before
serving); `run` follows new ones and loads each as it comes, through the
backend's `aload_weights`, whose gate lets the requests in flight finish first
and holds new ones back meanwhile (`jet.workers.inference.gate`). Every reply carries
the version its tokens came from.

The poison policy (docs/design.md, "Poison"): an announcement this worker cannot process is
dead-lettered on `dead` with its real reason, recorded in the hash
`Keys.weights_rejected(model)` under `<consumer> <entry id>`, and never read
again by this worker, also after a restart (`catch_up` skips what it rejected
and takes the newest announcement it has not). Rejected at once: a malformed
entry, another model's, a negative version, a version that does not increase
on the one serving (a repeat of the serving version with the same hash is
ignored silently), a path outside the allowed roots (the run's
`weights/<model>` folder and `models[].weights_roots`, compared after
resolving symlinks). Rejected after `MAX_LOAD_TRIES` failed loads (the
backend's WeightsError: missing file, hash mismatch, not safetensors, tensors
that do not fit): transient I/O gets its retries. Meanwhile the old weights
keep serving. Not rejected: an announcement whose folder is gone while a
newer one is in the stream (the trainer's retention pruned it, e.g. under a
follower that fell behind): it is skipped and the newer one loaded.

Weights without a shared folder: an announcement that carries a `blob` (a small
version, a LoRA adapter, whose files the trainer also put on `wblob:<model>`,
`jet.queues.blobs`) is loaded from `path` when this worker can read it there
(inside the allowed roots), else its chunks are fetched into a folder of this
worker's own and loaded from it: then `path` is only a name, and the allowed-roots
rule does not apply to it. Fetched versions are bounded and never outlive the worker:
the folder (`jet-weights-<model>-<pid>-*` in the temporary directory) holds the serving
version and the one being fetched, no more (a version is deleted once another serves, or
once it is given up on); `close` deletes it when the follower stops, an exit hook when the
process ends without stopping it, and a worker that starts deletes the folders of workers
that died without either (SIGKILL), found by the pid in their names. Missing or corrupted chunks are a failed load
(retried, then dead-lettered with the reason; the old version keeps serving);
chunks trimmed away while a newer version is announced are skipped like a
pruned folder.

What it is not: a trainer-side publisher, or a cache of weights.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Sequence

import anyio

from jet.errors import CodecError, ConnectError, WeightsError
from jet.keys import Keys
from jet.queues import blobs, codec
from jet.queues.connect import translated
from jet.wire import WeightVersion

log = logging.getLogger(__name__)

MAX_LOAD_TRIES = 3
RETRY_S = 0.5  # first wait before loading a failed version again (doubles each try)
CATCH_UP_DEPTH = 64  # announcements looked at, newest first, when a worker starts


FETCHED = re.compile(r"jet-weights-.+-(\d+)-[^-]+$")  # a fetched-versions folder; the number: its worker's pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to clean
        return True
    return True


def sweep_fetched(where: str | os.PathLike | None = None) -> list[Path]:
    """Delete the fetched-versions folders in `where` (the temporary directory) whose worker is gone."""
    gone = []
    for folder in Path(where or tempfile.gettempdir()).glob("jet-weights-*"):
        m = FETCHED.match(folder.name)
        if m and folder.is_dir() and not _alive(int(m.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder)
    return gone


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


class WeightFollower:
    def __init__(self, client, blocking_client, url: str, keys: Keys, model: str, consumer: str,
                 roots: Sequence[str | os.PathLike], block_ms: int = 2000):
        self.r, self.rb, self.url, self.keys = client, blocking_client, url, keys
        self.model, self.consumer, self.block_ms = model, consumer, block_ms
        self.stream = keys.weights(model)
        self.roots = [Path(p).resolve() for p in roots]
        self.latest: WeightVersion | None = None  # the announcement serving now (None: the model's own weights)
        self._last_id = "0-0"
        self._cache: Path | None = None  # where versions fetched from Redis go (made on first use)
        self._serving: str | None = None  # the folder the serving version was loaded from

    async def catch_up(self, backend) -> None:
        """Load the newest announcement already in the stream that this worker has not rejected."""
        with translated(self.url):
            entries = await self.r.xrevrange(self.stream, "+", "-", count=CATCH_UP_DEPTH)
            if entries:
                self._last_id = _s(entries[0][0])
                names = [f"{self.consumer} {_s(i)}" for i, _ in entries]
                seen = await self.r.hmget(self.keys.weights_rejected(self.model), names)
        for (entry_id, fields), rejected in zip(entries, seen if entries else []):
            if rejected is not None:
                continue  # our own verdict from an earlier life: never again
            w = await self._checked(_s(entry_id), fields, backend, catching_up=True)
            if w is not None and await self._load(_s(entry_id), fields, w, backend):
                return

    async def run(self, backend) -> None:
        """Follow new announcements until cancelled, loading the newest acceptable one of each read; then
        delete the versions fetched from Redis (`close`)."""
        try:
            await self._follow(backend)
        finally:
            self.close()

    def close(self) -> None:
        """Delete the folder of versions fetched from Redis (a later fetch makes a new one)."""
        if self._cache is not None:
            shutil.rmtree(self._cache, ignore_errors=True)
            atexit.unregister(self._remove_cache)
            self._cache = None

    def _remove_cache(self) -> None:
        if self._cache is not None:
            shutil.rmtree(self._cache, ignore_errors=True)

    async def _follow(self, backend) -> None:
        while True:
            try:
                with translated(self.url):
                    reply = await self.rb.xread({self.stream: self._last_id}, count=16, block=self.block_ms)
            except ConnectError as e:
                log.warning("weights follower: %s; retrying", e)
                await anyio.sleep(1.0)
                continue
            entries = [(_s(i), f) for _, es in reply or [] for i, f in es]
            if entries:
                self._last_id = entries[-1][0]
            good = []
            for entry_id, fields in entries:
                w = await self._checked(entry_id, fields, backend)
                if w is not None:
                    good.append((entry_id, fields, w))
            if good:  # older ones in the same read are superseded, not wrong
                await self._load(*good[-1], backend)

    async def _checked(self, entry_id: str, fields, backend, catching_up: bool = False) -> WeightVersion | None:
        """The announcement if it may be loaded; None after dead-lettering it (or for a silent repeat)."""
        try:
            w = WeightVersion.from_payload(codec.decode(fields))
        except CodecError as e:
            await self._reject(entry_id, fields, f"malformed weights announcement: {e}")
            return None
        if w.version == backend.version and self.latest is not None and w.sha256 == self.latest.sha256:
            return None  # the version serving, announced again
        reason = self._problem(w, backend, catching_up)
        if reason:
            await self._reject(entry_id, fields, reason)
            return None
        return w

    def _problem(self, w: WeightVersion, backend, catching_up: bool) -> str | None:
        if w.model != self.model:
            return f"announces model {w.model!r} on the weights stream of {self.model!r}"
        if w.version < 0:
            return f"version must be >= 0, got {w.version}"
        if not catching_up and w.version <= backend.version:
            return f"version {w.version} does not increase on version {backend.version}, which is serving"
        path = Path(w.path).resolve()
        if not w.blob and not self._allowed(path):
            allowed = ", ".join(str(r) for r in self.roots)
            return f"path {w.path} ({path}) is outside the allowed weights folders: {allowed}"
        return None

    def _allowed(self, path: Path) -> bool:
        return any(path.resolve().is_relative_to(root) for root in self.roots)

    async def _source(self, w: WeightVersion) -> str:
        """Where to load `w` from: its path when this worker can read it there, else a folder of its own
        filled from the version's chunks in Redis."""
        if not w.blob or (self._allowed(Path(w.path)) and os.path.exists(w.path)):
            return w.path
        if self._cache is None:
            sweep_fetched()
            self._cache = Path(tempfile.mkdtemp(prefix=f"jet-weights-{self.model}-{os.getpid()}-"))
            atexit.register(self._remove_cache)  # a process that ends without `close` (an error) cleans up too
        folder = self._cache / f"v{w.version}"
        self._forget_cached(keep=self._serving)  # a version given up on earlier: the serving one alone stays
        shutil.rmtree(folder, ignore_errors=True)
        with translated(self.url):
            await blobs.fetch(self.r, self.keys, self.model, w.version, w.blob, w.blob_chunks, folder)
        return str(folder)

    def _forget_cached(self, keep: str | None) -> None:
        """Delete fetched versions but the one serving (`keep`)."""
        if self._cache is not None and self._cache.is_dir():
            for old in self._cache.iterdir():
                if str(old) != keep:
                    shutil.rmtree(old, ignore_errors=True)

    async def _load(self, entry_id: str, fields, w: WeightVersion, backend) -> bool:
        """Load `w`, retrying transient failures; dead-letter it after the last. True if loaded.

        A folder that is gone while a newer announcement exists was pruned by the trainer's
        retention (`jet.trainer.weights.prune_weights`): skipped, no verdict, the newer one follows."""
        for attempt in range(1, MAX_LOAD_TRIES + 1):
            source = w.path
            try:
                source = await self._source(w)
                await backend.aload_weights(source, w.sha256, w.version)
            except (WeightsError, OSError, ConnectError) as e:
                gone = getattr(e, "gone", False) if w.blob else not os.path.exists(w.path)
                if gone and await self._superseded(entry_id):
                    log.info("%s version %d: %s is gone (pruned) and a newer version is announced; skipping it",
                             w.model, w.version, w.path)
                    return False
                log.error("cannot load %s version %d (try %d of %d): %s", w.model, w.version, attempt,
                          MAX_LOAD_TRIES, e)
                if attempt == MAX_LOAD_TRIES:
                    await self._reject(entry_id, fields, f"failed to load {MAX_LOAD_TRIES} times: {e}")
                    return False
                await anyio.sleep(RETRY_S * 2 ** (attempt - 1))
                continue
            self.latest, self._serving = w, source
            self._forget_cached(source)
            log.info("%s: now serving weight version %d (step %d) from %s", w.model, w.version, w.step, source)
            return True
        return False

    async def _superseded(self, entry_id: str) -> bool:
        """Whether the stream holds an announcement after `entry_id` (False when Redis cannot say)."""
        try:
            with translated(self.url):
                newer = await self.r.xrange(self.stream, f"({entry_id}", "+", count=1)
        except ConnectError:
            return False  # then the load's retries decide
        return bool(newer)

    async def _reject(self, entry_id: str, fields, reason: str) -> None:
        """Dead-letter the announcement with its reason and remember, for this consumer, never to read it again."""
        meta = {"stream": self.keys.short(self.stream), "entry_id": entry_id, "group": None,
                "consumer": self.consumer, "reason": reason, "deliveries": 1, "time": time.time()}
        dead = codec.encode("dead", meta, raw={_s(k): v for k, v in fields.items()}, max_bytes=1 << 62)
        with translated(self.url):
            async with self.r.pipeline(transaction=True) as p:
                p.xadd(self.keys.dead, dead)
                p.hset(self.keys.weights_rejected(self.model), f"{self.consumer} {entry_id}", reason[:2000])
                p.hincrby(self.keys.stats, "dead", 1)
                await p.execute()
        log.error("%s %s -> dead: %s", self.keys.short(self.stream), entry_id, reason)
