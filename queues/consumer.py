"""A consumer of one stream for one consumer group: the delivery rules of DESIGN.md.

What it guarantees (each rule has a test in tests/queues/):
- its own pending entries are re-read (and counted as a delivery) before new ones;
- entries that fail to decode, or are past `max_deliveries`, go to `dead` with a
  reason and are acked: poison never loops;
- a redelivered message whose idempotency marker exists is acked, not redone;
- `commit` acks inputs, writes their outputs and sets their markers in ONE Lua
  call, so a message's effects land exactly once even when it was processed twice;
- leases of in-flight entries are renewed; `release` makes them reclaimable at once;
- reads that block use their own connection, with a socket timeout above BLOCK.
What it is not: a scheduler. Reclaiming other consumers' idle entries is the
`Reaper`'s job (jet.queues.reaper), which feeds what it claims into `fetch`.
"""

from __future__ import annotations

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
from jet.queues.connect import translated

log = logging.getLogger(__name__)

RELEASE_IDLE_MS = 1_000_000_000  # "idle for 11 days": any reaper takes it at once


def consumer_name(role: str, slot: int | str = 0, host: str | None = None) -> str:
    """Stable name host-role-slot: a restarted process finds its own pending entries."""
    return f"{host or socket.gethostname()}-{role}-{slot}"


@dataclass(slots=True)
class Delivery:
    """One entry handed to a handler."""

    stream: str
    entry_id: str
    fields: dict[bytes, bytes]
    payload: codec.Payload
    deliveries: int = 1
    received: float = field(default_factory=time.monotonic)


Output = tuple[str, Mapping[bytes, bytes]]  # (stream key, entry fields)


@dataclass(slots=True)
class Settings:
    lease_ms: int = 30_000
    max_deliveries: int = 5
    block_ms: int = 2_000
    batch: int = 64
    marker_ttl_s: int = 21_600
    max_entry_bytes: int = codec.DEFAULT_MAX_BYTES


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def resp(args: Sequence, encode) -> list[bytes]:
    """RESP-encode one command: small arguments joined in one buffer, large ones
    (token arrays) passed on as they are, uncopied. `encode` (the client's) turns
    anything that is not bytes into bytes, exactly as redis-py would."""
    out, small = [b"*%d\r\n" % len(args)], []
    for a in args:
        if a.__class__ is not bytes:
            a = encode(a)
        if len(a) > 8192:
            small.append(b"$%d\r\n" % len(a))
            out += (b"".join(small), a)
            small = [b"\r\n"]
        else:
            small.append(b"$%d\r\n%s\r\n" % (len(a), a))
    out.append(b"".join(small))
    return out


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
        self._commit = self.r.register_script(scripts.COMMIT)
        self._dead = self.r.register_script(scripts.DEAD)
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
        """Claim our own pending entries to ourselves: counts as a delivery (bumps the count)."""
        queued = {e[0] for e in self.claimed}
        while True:  # page through the whole PEL: entries already in hand are skipped, not the end
            page = await self.r.xpending_range(self.stream, self.group, self._own_from, "+", count,
                                               consumername=self.name)
            if not page:
                self._own_pending = False
                return []
            self._own_from = "(" + _s(page[-1]["message_id"])
            pend = [p for p in page if _s(p["message_id"]) not in self.inflight and _s(p["message_id"]) not in queued]
            if pend:
                break
        ids = [p["message_id"] for p in pend]
        claimed = await self.r.xclaim(self.stream, self.group, self.name, 0, ids)
        counts = {_s(p["message_id"]): p["times_delivered"] + 1 for p in pend}
        got = [(_s(i), f or {}, counts.get(_s(i), 1)) for i, f in claimed]
        missing = set(counts) - {g[0] for g in got}
        if missing:  # payload trimmed or deleted: XCLAIM dropped them from the PEL
            await self.count_lost(len(missing), "own pending entries whose payload was deleted")
        return got

    async def _new(self, count: int) -> list[tuple[str, dict, int]]:
        reply = await self.rb.xreadgroup(self.group, self.name, {self.stream: ">"},
                                         count=count, block=self.cfg.block_ms)
        return [(_s(i), f or {}, 1) for _, entries in (reply or []) for i, f in entries]

    async def _accept(self, raw: list[tuple[str, dict, int]]) -> list[Delivery]:
        """Decode, dead-letter poison, ack duplicates; return what a handler should see."""
        good: list[Delivery] = []
        for entry_id, fields, n in raw:
            if n > self.cfg.max_deliveries:
                await self.dead(entry_id, fields, self._why_dead(entry_id, n), n)
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

    def _why_dead(self, entry_id: str, n: int) -> str:
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

    async def commit(self, items: Sequence[tuple[Delivery, Sequence[Output]]]) -> list[bool]:
        """Ack every input, write its outputs and set its marker, in one atomic step.

        Returns per input whether its outputs were written (False: a duplicate).
        Safe to call again after a dropped reply: nothing is written twice.
        """
        if not items:
            return []
        markers = [self.keys.done_marker(self.group, d.payload.msg_id) for d, _ in items]
        out_keys = list(dict.fromkeys(key for _, outputs in items for key, _ in outputs))
        base = 2 + len(markers)  # KEYS is 1-based: input, markers..., then outputs
        index = {k: b"%d" % (base + i) for i, k in enumerate(out_keys)}
        argv: list = [self.group, b"%d" % self.cfg.marker_ttl_s, b"%d" % len(items)]
        for d, outputs in items:
            argv += (d.entry_id, b"%d" % len(outputs))
            for key, fields in outputs:
                argv += (index[key], b"%d" % len(fields))
                for kv in fields.items():
                    argv += kv
        with translated(self.url):
            res = await self._evalsha(self._commit, [self.stream, *markers, *out_keys], argv)
        for d, _ in items:
            self.inflight.pop(d.entry_id, None)
        return [bool(x) for x in res]

    async def dead(self, entry_id: str, fields: Mapping[bytes, bytes], reason: str, deliveries: int = 0) -> bool:
        """Move an entry to the dead-letter stream with its reason; ack it."""
        meta = {"stream": self.keys.short(self.stream), "entry_id": entry_id, "group": self.group,
                "consumer": self.name, "reason": reason, "deliveries": deliveries, "time": time.time()}
        last = await self.r.hget(self.keys.last_error(), f"{self.stream}/{entry_id}")
        if last:
            meta["last_error"] = last.decode(errors="replace")[-4000:]
        dead = codec.encode("dead", meta, raw={k.decode(errors="replace"): v for k, v in fields.items()},
                            max_bytes=1 << 62)
        args = [self.group, entry_id] + [x for kv in dead.items() for x in kv]
        with translated(self.url):
            done = await self._dead(keys=[self.stream, self.keys.dead, self.keys.stats], args=args)
            await self.r.hdel(self.keys.last_error(), f"{self.stream}/{entry_id}")
        self.inflight.pop(entry_id, None)
        log.warning("%s %s -> dead: %s", self.keys.short(self.stream), entry_id, reason)
        return bool(done)

    async def fail(self, d: Delivery, error: str) -> None:
        """A handler failed on `d`: record why and release it for redelivery (counts a delivery)."""
        with translated(self.url):
            await self.r.hset(self.keys.last_error(), f"{self.stream}/{d.entry_id}", error[-4000:])
        await self.release([d])

    async def renew(self, ds: Sequence[Delivery] | None = None) -> list[str]:
        """Reset the idle time of in-flight entries; returns ids another consumer took over."""
        return await self._lease_op(ds, 0)

    async def release(self, ds: Sequence[Delivery] | None = None) -> list[str]:
        """Give in-flight entries back: the next reaper pass anywhere reclaims them."""
        lost = await self._lease_op(ds, RELEASE_IDLE_MS)
        for d in list(ds if ds is not None else self.inflight.values()):
            self.inflight.pop(d.entry_id, None)
        return lost

    async def _lease_op(self, ds, idle_ms: int) -> list[str]:
        ids = [d.entry_id for d in (ds if ds is not None else list(self.inflight.values()))]
        lost: list[str] = []
        with translated(self.url):
            for i in range(0, len(ids), 256):
                chunk = ids[i:i + 256]
                lost += [_s(x) for x in await self._lease(keys=[self.stream],
                                                          args=[self.group, self.name, idle_ms, *chunk])]
        return lost

    async def count_lost(self, n: int, what: str) -> None:
        await self.r.hincrby(self.keys.stats, "lost", n)
        log.warning("%s: %d %s (counted as lost work)", self.keys.short(self.stream), n, what)

    async def _evalsha(self, script, keys: list, args: list):
        """`script(keys, args)`, but packed here in one pass (`resp`) and sent on a pooled
        connection: redis-py's asyncio packer costs ~1 us per argument, and a commit of
        200 small entries has ~3,000. Retried on a dropped connection like any redis-py
        command (scripts are safe to re-run); NOSCRIPT loads the script and runs it again."""
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
        """After a reconnect: forget local state; the server's PEL is the truth, and our
        own pending entries are re-read before new ones."""
        self.inflight.clear()
        self.claimed.clear()
        self._own_pending, self._own_from = True, "-"

