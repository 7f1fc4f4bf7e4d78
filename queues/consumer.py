"""A consumer of one stream for one consumer group: the delivery rules of docs/design.md.

What it guarantees (each rule has a test in tests/queues/test_delivery_rules.py):
- its own pending entries are re-read before new ones (counted as a delivery,
  unless `Settings.count_rereads` is off: the trainer's restarts never count
  against the trajectories it holds) (rule 2);
- entries that fail to decode, or are past `max_deliveries`, go to `dead` with a
  reason and are acked: poison never loops (rules 3 and 8);
- a redelivered message whose idempotency marker exists is acked, not redone (rule 1);
- `settle` finishes inputs by their outcome (`Commit`, `Dead`, `Drop`) in ONE
  Lua call (`scripts.SETTLE`): ack, marker, outputs, dead letters and their
  counters together, so a message's effects land exactly once even when it was
  processed twice; an output stream at its maxlen makes the call stop before
  that input (backpressure, atomically: a stream never overshoots its bound) (rules 1 and 4);
- leases of in-flight entries are renewed; `release` makes them reclaimable at once (rule 2);
- reads that block use their own connection, with a socket timeout above BLOCK (rule 7).
What it is not: a loop. `jet.queues.runtime.Runtime` runs the lease keeper, the
reaper (jet.queues.reaper, which feeds what it claims into `fetch`),
reconnects and the serving modes around it.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import redis.asyncio as aioredis
import redis.exceptions as rex

from jet.errors import CodecError
from jet.keys import Keys
from jet.queues import codec, scripts
from jet.queues.connect import is_cluster, translated
from jet.queues.messages import Commit, Dead, Delivery, Drop, Output

log = logging.getLogger(__name__)

RELEASE_IDLE_MS = 1_000_000_000  # "idle for 11 days": any reaper takes it at once
DEAD_ORIGINAL_MAX = 64 * 1024  # a dead letter keeps its original entry whole up to this size (bytes)
DEFAULT_DEAD_CAP = 2_000  # dead letters kept per run unless queues.maxlen.dead says otherwise


def consumer_name(role: str, slot: int | str = 0, host: str | None = None) -> str:
    """Stable name host-role-slot: a restarted process finds its own pending entries."""
    return f"{host or socket.gethostname()}-{role}-{slot}"


def default_marker_ttl(lease_ms: int, max_deliveries: int) -> int:
    """Seconds an idempotency marker must live: while a copy of the message can still arrive.

    A copy comes back through reclaims (at most `max_deliveries` leases) or a client that
    sends a request again under the same id (jet.llm: only after losing its reply stream,
    which the server's data loss mostly takes the markers with); twice the reclaims'
    span, and at least 5 minutes. Memory: ~90 B per marker, so
    rate x TTL x 90 B (1,000 msgs/s at the default 30 s lease: 360 s -> ~32 MB)."""
    return max(300, 2 * (max_deliveries + 1) * lease_ms // 1000)


@dataclass(slots=True)
class Settings:
    lease_ms: int = 30_000
    max_deliveries: int = 5
    block_ms: int = 2_000
    batch: int = 64
    marker_ttl_s: int | None = None  # None: `default_marker_ttl`
    max_entry_bytes: int = codec.DEFAULT_MAX_BYTES
    count_rereads: bool = True  # re-reading our own pending entries after a restart counts a delivery
    maxlen: dict[str, int] = field(default_factory=dict)  # per stream kind: outputs wait while it is full

    @property
    def marker_ttl(self) -> int:
        return self.marker_ttl_s or default_marker_ttl(self.lease_ms, self.max_deliveries)

    @property
    def dead_cap(self) -> int:
        return self.maxlen.get("dead", DEFAULT_DEAD_CAP)

    @classmethod
    def of(cls, queues, *, batch: int | None = None, **changes) -> "Settings":
        """The settings of a config's `queues` section (anything with its attributes)."""
        s = cls(lease_ms=queues.lease_ms, max_deliveries=queues.max_deliveries, block_ms=queues.block_ms,
                batch=batch or queues.batch, marker_ttl_s=getattr(queues, "marker_ttl_s", None),
                max_entry_bytes=queues.max_entry_bytes, maxlen=dict(queues.maxlen))
        for k, v in changes.items():
            setattr(s, k, v)
        return s


def as_str(x: bytes | str) -> str:
    """An id or name from redis-py (bytes or str) as str."""
    return x.decode() if isinstance(x, bytes) else x


def resp(args: Sequence, encode) -> list[bytes]:
    """RESP-encode one command: small arguments joined in one buffer, large ones
    (token arrays) passed on as they are, uncopied. `encode` (the client's) turns
    anything that is not bytes into bytes, exactly as redis-py would."""
    out, small = [b"*%d\r\n" % len(args)], []
    for a in args:
        cls = a.__class__
        if cls is str:
            a = a.encode()  # what redis-py's encoder does with a str (utf-8, strict), without its checks
        elif cls is not bytes:
            a = encode(a)
        if len(a) > 8192:
            small.append(b"$%d\r\n" % len(a))
            out += (b"".join(small), a)
            small = [b"\r\n"]
        else:
            small.append(b"$%d\r\n%s\r\n" % (len(a), a))
    out.append(b"".join(small))
    return out


def dead_entry(meta: dict, original: Mapping[bytes, bytes]) -> dict[bytes, bytes]:
    """A dead letter: `meta` (stream, entry_id, reason, ...) and the original entry, kept whole up to
    DEAD_ORIGINAL_MAX bytes; a larger one keeps only its small fields, with its size and sha256."""
    size = codec.entry_size(original)
    raw = {k.decode(errors="replace"): v for k, v in original.items()}
    if size > DEAD_ORIGINAL_MAX:
        digest = hashlib.sha256(b"".join(k + b"\0" + v for k, v in sorted(original.items()))).hexdigest()
        meta = {**meta, "truncated": True, "original_bytes": size, "original_sha256": digest}
        raw = {k: v[:2048] for k, v in raw.items() if len(v) <= 4096 or k in ("m",)}
    return codec.encode("dead", meta, raw=raw, max_bytes=1 << 62)


class Consumer:
    """Reads `stream` as `name` in `group`. `client` for commands, `blocking` for BLOCK reads."""

    def __init__(self, client: aioredis.Redis, blocking: aioredis.Redis, url: str, keys: Keys,
                 stream: str, group: str, name: str, settings: Settings | None = None):
        self.r, self.rb, self.url, self.keys = client, blocking, url, keys
        self.stream, self.group, self.name = stream, group, name
        self.cfg = settings or Settings()
        self.inflight: dict[str, Delivery] = {}
        self.claimed: list[tuple[str, dict, int]] = []  # fed by the Reaper
        self._own_pending = True  # re-read our own PEL first, once per (re)start
        self._own_from = "-"  # where the next page of that re-read starts (exclusive after the first)
        self._cluster = is_cluster(self.r)  # no raw connections there: the settle goes the normal way
        self._settle = self.r.register_script(scripts.SETTLE)
        self._modes: dict[str, tuple[bytes, bytes]] = {}  # output key -> (maxlen, mode) SETTLE arguments
        self._lease = self.r.register_script(scripts.LEASE)

    # -- setup ---------------------------------------------------------------

    async def ensure_group(self, start: str = "0") -> None:
        """Create the group (and the stream) if missing; existing ones are left as they are.

        A new group reads from `start`: "0" = every entry in the stream, "$" = only entries added later.
        """
        with translated(self.url):
            try:
                await self.r.xgroup_create(self.stream, self.group, id=start, mkstream=True)
            except rex.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    # -- reading -------------------------------------------------------------

    async def fetch(self, count: int | None = None) -> list[Delivery]:
        """Up to `count` deliveries: own pending first, then reclaimed, then new (blocking)."""
        count = count or self.cfg.batch
        with translated(self.url):
            raw = await self._own(count) if self._own_pending else []
            if not raw and self.claimed:
                raw, self.claimed = self.claimed[:count], self.claimed[count:]
            if not raw:
                raw = await self._new(count)
            return await self._accept(raw)

    async def _own(self, count: int) -> list[tuple[str, dict, int]]:
        """Claim our own pending entries to ourselves (each a delivery unless count_rereads is off)."""
        queued = {e[0] for e in self.claimed}
        while True:  # page through the whole PEL: entries already in hand are skipped, not the end
            page = await self.r.xpending_range(self.stream, self.group, self._own_from, "+", count,
                                               consumername=self.name)
            if not page:
                self._own_pending = False
                return []
            self._own_from = "(" + as_str(page[-1]["message_id"])
            pend = [p for p in page if as_str(p["message_id"]) not in self.inflight and as_str(p["message_id"]) not in queued]
            if pend:
                break
        ids = [p["message_id"] for p in pend]
        bump = 1 if self.cfg.count_rereads else 0
        counts = {as_str(p["message_id"]): p["times_delivered"] + bump for p in pend}
        if self.cfg.count_rereads:
            claimed = await self.r.xclaim(self.stream, self.group, self.name, 0, ids)
        else:  # JUSTID: the idle time resets, the delivery count does not move
            kept = await self.r.xclaim(self.stream, self.group, self.name, 0, ids, justid=True)
            async with self.r.pipeline(transaction=False) as p:
                for i in kept:
                    p.xrange(self.stream, i, i)
                claimed = [rows[0] for rows in await p.execute() if rows]
        got = [(as_str(i), f or {}, counts.get(as_str(i), 1)) for i, f in claimed]
        missing = set(counts) - {g[0] for g in got}
        if missing:  # payload trimmed or deleted: XCLAIM dropped them from the PEL
            await self.count_lost(len(missing), "own pending entries whose payload was deleted")
        return got

    async def _new(self, count: int) -> list[tuple[str, dict, int]]:
        reply = await self.rb.xreadgroup(self.group, self.name, {self.stream: ">"},
                                         count=count, block=self.cfg.block_ms)
        return [(as_str(i), f or {}, 1) for _, entries in (reply or []) for i, f in entries]

    async def _accept(self, raw: list[tuple[str, dict, int]]) -> list[Delivery]:
        """Decode, dead-letter poison, ack duplicates; return what a handler should see."""
        good: list[Delivery] = []
        for entry_id, fields, n in raw:
            if n > self.cfg.max_deliveries:
                await self.dead(entry_id, fields, self._why_dead(n), n)
                continue
            try:
                payload = codec.decode(fields, max_bytes=self.cfg.max_entry_bytes)
            except CodecError as e:
                await self.dead(entry_id, fields, str(e), n)
                continue
            good.append(Delivery(self.stream, entry_id, fields, payload, n))
        if good:
            good = await self._drop_done(good)
        for d in good:
            self.inflight[d.entry_id] = d
        return good

    def _why_dead(self, n: int) -> str:
        return f"delivered {n} times, more than max_deliveries={self.cfg.max_deliveries}"

    async def _drop_done(self, ds: list[Delivery]) -> list[Delivery]:
        """Messages whose marker exists were committed already: ack them, don't redo them."""
        # One MGET, not a pipeline of EXISTS: markers are always strings, so a nil
        # answer means "absent", and one command per batch costs far less client CPU.
        flags = [f is not None for f in await self.r.mget(
            [self.keys.done_marker(self.group, d.payload.msg_id) for d in ds])]
        dup = [d.entry_id for d, f in zip(ds, flags) if f]
        if dup:
            await self.r.xack(self.stream, self.group, *dup)
            await self.r.hincrby(self.keys.stats, "duplicates", len(dup))
            log.info("%s: acked %d already-committed redeliveries", self.keys.short(self.stream), len(dup))
        return [d for d, f in zip(ds, flags) if not f]

    # -- finishing -----------------------------------------------------------

    async def settle(self, items: Sequence[tuple[Delivery, Commit | Dead | Drop]]) -> list[int]:
        """Finish each input by its outcome in one atomic step (`scripts.SETTLE`).

        Returns per input 1 (done), 0 (a duplicate or no longer ours: nothing written) or -1
        (not processed: an output stream is full; call again later with those inputs).
        Safe to call again after a dropped reply: nothing is written twice.
        """
        if not items:
            return []
        # One pass per input, exact class tests: this is the client's per-message cost of every hop.
        dead_ids = [d.entry_id for d, o in items if o.__class__ is Dead]
        last_errors = await self._last_errors(dead_ids) if dead_ids else {}
        marker, group = self.keys.done_marker, self.group
        markers: list[str] = []
        out_keys: dict[str, bytes] = {}  # output key -> its KEYS index
        modes: list = []  # per output key, in KEYS order: maxlen, mode
        bounded = False  # some output has a room check (else the script skips that pass)
        body: list = []
        base = 4 + len(items)  # KEYS is 1-based: input, stats, dead, markers..., then outputs
        for d, outcome in items:
            markers.append(marker(group, d.payload.msg_id if d.payload else d.entry_id))
            kind = outcome.__class__
            if kind is Commit:
                action = b"c" + outcome.counter.encode() if outcome.counter else b"c"
                outputs = outcome.outputs
            elif kind is Dead:
                action = b"d"
                outputs = [(self.keys.dead, self._dead_fields(d, outcome.reason, last_errors.get(d.entry_id)))]
            else:
                action, outputs = b"x" + outcome.counter.encode(), ()
            body += (d.entry_id, action, b"%d" % len(outputs))
            for key, fields in outputs:
                index = out_keys.get(key)
                if index is None:
                    index = out_keys[key] = b"%d" % (base + len(out_keys))
                    maxlen, mode = self._output_mode(key)
                    modes += (maxlen, mode)
                    bounded = bounded or (mode == b"b" and maxlen != b"0")
                body += (index, b"%d" % len(fields))
                for kv in fields.items():
                    body += kv
        argv = [self.group, b"%d" % self.cfg.marker_ttl, b"%d" % len(items), b"%d" % self.cfg.dead_cap,
                b"1" if bounded else b"0", b"%d" % len(out_keys), *modes, *body]
        with translated(self.url):
            res = await self._evalsha(self._settle, [self.stream, self.keys.stats, self.keys.dead, *markers,
                                                      *out_keys], argv)
        inflight = self.inflight
        for (d, _), r in zip(items, res):
            if r != -1:
                inflight.pop(d.entry_id, None)
        dead = [d.entry_id for (d, o), r in zip(items, res) if r == 1 and o.__class__ is Dead] if dead_ids else ()
        if dead:
            with translated(self.url):
                await self.r.hdel(self.keys.last_error(), *[f"{self.stream}/{i}" for i in dead])
        return list(res)  # integer replies: ints already

    def _output_mode(self, key: str) -> tuple[bytes, bytes]:
        """(maxlen, mode) of an output stream, as SETTLE arguments (remembered per key)."""
        got = self._modes.get(key)
        if got is None:
            maxlen, mode = self._mode_of(key)
            got = self._modes[key] = (b"%d" % maxlen, mode)
        return got

    def _mode_of(self, key: str) -> tuple[int, bytes]:
        """See `scripts.SETTLE`. Outputs to the input stream itself (a retry copy of the task)
        never wait: acking the input makes up for them."""
        kind = self.keys.kind(key)
        if kind == "dead":
            return 0, b"d"
        if kind == "reply":
            return 0, b"e"
        if kind == "shadow":
            return self.cfg.maxlen.get("shadow", self.cfg.maxlen.get("traj", 10_000)), b"c"
        return (0 if key == self.stream else self.cfg.maxlen.get(kind, 0)), b"b"

    async def commit(self, items: Sequence[tuple[Delivery, Sequence[Output]]]) -> list[bool]:
        """`settle` with every input committed; True per input whose outputs were written.

        An input whose output stream is full is not committed (False) and stays in flight."""
        return [r == 1 for r in await self.settle([(d, Commit(outputs)) for d, outputs in items])]

    async def dead(self, entry_id: str, fields: Mapping[bytes, bytes], reason: str, deliveries: int = 0) -> bool:
        """Move an entry to the dead-letter stream with its reason; ack it. False if someone acked it first."""
        d = self.inflight.get(entry_id) or Delivery(self.stream, entry_id, dict(fields), None, deliveries)  # type: ignore[arg-type]
        [done] = await self.settle([(d, Dead(reason))])
        self.inflight.pop(entry_id, None)
        log.warning("%s %s -> dead: %s", self.keys.short(self.stream), entry_id, reason)
        return done == 1

    def _dead_fields(self, d: Delivery, reason: str, last_error: str | None) -> dict[bytes, bytes]:
        meta = {"stream": self.keys.short(self.stream), "entry_id": d.entry_id, "group": self.group,
                "consumer": self.name, "reason": reason, "deliveries": d.deliveries, "time": time.time()}
        if last_error:
            meta["last_error"] = last_error[-4000:]
        return dead_entry(meta, d.fields)

    async def _last_errors(self, ids: Sequence[str]) -> dict[str, str]:
        """The errors handlers recorded (`fail`) for these entries: the reason behind a dead letter."""
        with translated(self.url):
            found = await self.r.hmget(self.keys.last_error(), [f"{self.stream}/{i}" for i in ids])
        return {i: v.decode(errors="replace") for i, v in zip(ids, found) if v}

    async def fail(self, d: Delivery, error: str) -> None:
        """A handler failed on `d`: record why and release it for redelivery (counts a delivery)."""
        with translated(self.url):
            await self.r.hset(self.keys.last_error(), f"{self.stream}/{d.entry_id}", error[-4000:])
        await self.release([d])

    async def renew(self, ds: Sequence[Delivery] | None = None) -> list[str]:
        """Reset the idle time of in-flight entries (and of claimed ones not yet handed out);
        returns ids another consumer took over."""
        if ds is None and self.claimed:
            lost = await self._lease_ids([i for i, _, _ in self.claimed], 0)
            self.claimed = [e for e in self.claimed if e[0] not in set(lost)]
        return await self._lease_op(ds, 0)

    async def release(self, ds: Sequence[Delivery] | None = None) -> list[str]:
        """Give in-flight entries back: the next reaper pass anywhere reclaims them."""
        lost = await self._lease_op(ds, RELEASE_IDLE_MS)
        for d in list(ds if ds is not None else self.inflight.values()):
            self.inflight.pop(d.entry_id, None)
        return lost

    async def release_claimed(self) -> None:
        """Give back entries the reaper claimed for us that were never handed out."""
        ids, self.claimed = [i for i, _, _ in self.claimed], []
        await self._lease_ids(ids, RELEASE_IDLE_MS)

    async def _lease_op(self, ds, idle_ms: int) -> list[str]:
        return await self._lease_ids([d.entry_id for d in (ds if ds is not None else list(self.inflight.values()))],
                                     idle_ms)

    async def _lease_ids(self, ids: list[str], idle_ms: int) -> list[str]:
        lost: list[str] = []
        with translated(self.url):
            for i in range(0, len(ids), 256):
                chunk = ids[i:i + 256]
                lost += [as_str(x) for x in await self._lease(keys=[self.stream],
                                                          args=[self.group, self.name, idle_ms, *chunk])]
        return lost

    async def count_lost(self, n: int, what: str) -> None:
        await self.r.hincrby(self.keys.stats, "lost", n)
        log.warning("%s: %d %s (counted as lost work)", self.keys.short(self.stream), n, what)

    async def _evalsha(self, script, keys: list, args: list):
        """`script(keys, args)`, but packed here in one pass (`resp`) and sent on a pooled
        connection: redis-py's asyncio packer costs ~1 us per argument, and a commit of
        200 small entries has ~3,000. Retried on a dropped connection like any redis-py
        command (scripts are safe to re-run); NOSCRIPT loads the script and runs it again,
        once: a second NOSCRIPT is raised (a fatal ServerError once translated), never looped.
        On a cluster the script goes through the cluster client (every key is in the run's
        slot, so it is routed to that slot's primary; SCRIPT LOAD reaches every primary)."""
        if self._cluster:
            return await script(keys=keys, args=args)
        pool = self.r.connection_pool
        encode = pool.get_encoder().encode
        conn = await pool.get_connection()

        async def run():
            for attempt in (0, 1):
                await conn.send_packed_command(resp([b"EVALSHA", script.sha, len(keys), *keys, *args], encode))
                try:
                    return await conn.read_response()
                except rex.NoScriptError:
                    if attempt:
                        raise
                    script.sha = await self.r.script_load(script.script)

        async def dropped(_error):
            await conn.disconnect()

        try:  # (a send or read cut short disconnects the connection itself)
            return await conn.retry.call_with_retry(run, dropped)
        finally:
            await pool.release(conn)

    def restarted(self) -> None:
        """After a reconnect: the server's PEL is the truth. Entries still being handled here
        stay in flight (renewed, never handed out twice); our other pending entries are
        re-read before new ones; what the reaper had claimed is read again from the PEL."""
        self.claimed.clear()
        self._own_pending, self._own_from = True, "-"
