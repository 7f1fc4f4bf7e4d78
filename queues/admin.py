"""Read-only reports and dead-letter operations for the CLI (`jet status`, `jet dlq`).

`report` describes every stream of a run: length, and per group pending, lag
and consumers with their idle time. Dead letters are entries of `dead` whose
metadata says where they came from and why; `requeue` puts the original entry
back on its stream and deletes the dead letter in one Lua call.
"""

from __future__ import annotations

import time
from typing import Any

import redis.asyncio as aioredis

from jet.errors import CodecError, QueueError
from jet.keys import ALL_RUNS_PATTERN, Keys, run_of
from jet.queues import codec, scripts
from jet.queues.connect import translated


def _s(x: Any) -> Any:
    return x.decode(errors="replace") if isinstance(x, bytes) else x


async def runs(r: aioredis.Redis) -> list[str]:
    """Names of the runs that have keys on this server."""
    found = set()
    async for key in r.scan_iter(match=ALL_RUNS_PATTERN, count=1000):
        found.add(run_of(_s(key)))
    return sorted(found - {None})


async def report(r: aioredis.Redis, keys: Keys, url: str = "") -> dict:
    """{"run", "streams": [{name, length, groups: [{name, pending, lag, consumers: [...]}]}], "stats"}."""
    with translated(url):
        streams = []
        async for key in r.scan_iter(match=keys.pattern(), count=1000, _type="stream"):
            streams.append(_s(key))
        out = []
        for key in sorted(streams):
            groups = []
            for g in await r.xinfo_groups(key):
                consumers = [{"name": _s(c["name"]), "pending": c["pending"], "idle_ms": c["idle"]}
                             for c in await r.xinfo_consumers(key, g["name"])]
                groups.append({"name": _s(g["name"]), "pending": g["pending"], "lag": g.get("lag"),
                               "last_delivered": _s(g["last-delivered-id"]), "consumers": consumers})
            out.append({"name": keys.short(key), "length": await r.xlen(key), "groups": groups})
        stats = {_s(k): int(v) for k, v in (await r.hgetall(keys.stats)).items()}
    return {"run": keys.run, "streams": out, "stats": stats, "dead": await r.xlen(keys.dead), "time": time.time()}


async def dead_letters(r: aioredis.Redis, keys: Keys, *, stream: str | None = None, limit: int = 100,
                       url: str = "") -> list[dict]:
    """Dead letters, oldest first: {id, stream, entry_id, reason, deliveries, time, last_error, kind}."""
    rows = []
    with translated(url):
        entries = await r.xrange(keys.dead, count=limit if not stream else None)
    for dead_id, fields in entries:
        try:
            p = codec.decode(fields, max_bytes=1 << 62)
        except CodecError as e:  # someone wrote garbage to dead itself: show it, don't crash
            rows.append({"id": _s(dead_id), "stream": "?", "reason": f"unreadable dead letter: {e}"})
            continue
        if stream and p.meta.get("stream") != stream:
            continue
        orig = {k.encode(): v for k, v in p.raw.items()}
        rows.append({"id": _s(dead_id), **p.meta, "kind": _s(orig.get(b"k", b"?"))})
        if len(rows) >= limit:
            break
    return rows


async def requeue(r: aioredis.Redis, keys: Keys, dead_ids: list[str], url: str = "") -> int:
    """Put each dead letter's original entry back on its stream; returns how many moved.

    A dead letter whose original was too large to keep whole (`truncated`) cannot be put back:
    `QueueError` names it, after the others were moved."""
    script = r.register_script(scripts.REQUEUE)
    moved, refused = 0, []
    with translated(url):
        for dead_id in dead_ids:
            entries = await r.xrange(keys.dead, dead_id, dead_id)
            if not entries:
                continue
            p = codec.decode(entries[0][1], max_bytes=1 << 62)
            if p.meta.get("truncated"):
                refused.append(f"{dead_id} (original of {p.meta.get('original_bytes')} bytes kept truncated)")
                continue
            args = [dead_id] + [x for k, v in p.raw.items() for x in (k, v)]
            moved += int(await script(keys=[keys.full(p.meta["stream"]), keys.dead], args=args))
    if refused:
        raise QueueError(f"moved {moved}; cannot requeue {', '.join(refused)}")
    return moved


async def drop(r: aioredis.Redis, keys: Keys, dead_ids: list[str], url: str = "") -> int:
    with translated(url):
        return int(await r.xdel(keys.dead, *dead_ids)) if dead_ids else 0
