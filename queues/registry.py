"""The worker registry: who is in the swarm, on which code and weights, by heartbeat.

What it is: each long-running role (env worker, inference worker, trainer,
gateway) calls `beat` every few seconds, or runs `heartbeat` in its task
group. A beat writes the hash `worker:<name>` (role, host, pid, code version,
the weight version it serves, whatever else the role adds) with a TTL of a few
beats, and the worker's last-beat time into the sorted set `workers`. `workers`
reads them back for `jet dash`: a worker whose hash expired is reported as gone
(with the time it was last seen) until it has been silent for `FORGET_S`.

What it is not: membership for correctness. Nothing in delivery depends on
it (leases and the reaper do that); a worker that never beats still works, it
is only missing from the dashboard's worker table (which then falls back to
consumer names). One reader errs on the safe side with it: the trainer's
retention of published weights keeps every version at or past the oldest one a
live inference worker reports (`served`, `jet.trainer.weights.prune_weights`).

Invariants: the hash and the index change together (one MULTI); values are
strings (numbers and dicts as JSON), so any Redis client can read them.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, Callable

import anyio
import orjson
import redis.asyncio as aioredis

from jet.errors import QueueError
from jet.keys import Keys
from jet.queues.connect import translated

log = logging.getLogger(__name__)

EVERY_S = 5.0  # seconds between beats of `heartbeat`
TTL_BEATS = 3  # a worker's hash outlives this many missed beats
FORGET_S = 3600.0  # gone workers stay listed (as gone) this long after their last beat


def _value(v: Any) -> str:
    return v if isinstance(v, str) else orjson.dumps(v, default=str).decode()


async def beat(r: aioredis.Redis, keys: Keys, name: str, role: str, *, every_s: float = EVERY_S,
               url: str = "", **fields: Any) -> None:
    """Record that worker `name` (its consumer name) of `role` is alive now, with `fields`
    (e.g. code_version="ab12", model="tiny", weight_version=3). None values are left out."""
    now = time.time()
    record = {"role": role, "host": socket.gethostname(), "pid": os.getpid(), "beat": now,
              **{k: v for k, v in fields.items() if v is not None}}
    key = keys.worker(name)
    with translated(url):
        async with r.pipeline(transaction=True) as p:
            p.hset(key, mapping={k: _value(v) for k, v in record.items()})
            p.hsetnx(key, "started", _value(now))
            p.expire(key, max(1, int(every_s * TTL_BEATS + 1)))
            p.zadd(keys.workers, {name: now})
            await p.execute()


async def heartbeat(r: aioredis.Redis, keys: Keys, name: str, role: str, fields: Callable[[], dict] | None = None,
                    *, every_s: float = EVERY_S, url: str = "") -> None:
    """Beat every `every_s` seconds until cancelled; `fields()` is read at each beat (so the weight
    version a worker serves stays current). Redis trouble skips a beat, never ends the worker."""
    while True:
        try:
            await beat(r, keys, name, role, every_s=every_s, url=url, **(fields() if fields else {}))
        except QueueError as e:
            log.debug("heartbeat of %s skipped: %s", name, e)
        await anyio.sleep(every_s)


def _field(raw: bytes | str) -> Any:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


async def workers(r: aioredis.Redis, keys: Keys, *, url: str = "") -> list[dict]:
    """Every worker seen in the last FORGET_S: {name, alive, last_beat, <its fields>}, by name."""
    now = time.time()
    with translated(url):
        await r.zremrangebyscore(keys.workers, "-inf", now - FORGET_S)
        seen = await r.zrange(keys.workers, 0, -1, withscores=True)
        async with r.pipeline(transaction=False) as p:
            for name, _ in seen:
                p.hgetall(keys.worker(name.decode() if isinstance(name, bytes) else name))
            records = await p.execute()
    out = []
    for (name, last), rec in zip(seen, records):
        row = {k.decode() if isinstance(k, bytes) else k: _field(v) for k, v in rec.items()}
        out.append({**row, "name": name.decode() if isinstance(name, bytes) else name,
                    "alive": bool(rec), "last_beat": last})
    return sorted(out, key=lambda w: w["name"])


async def served(r: aioredis.Redis, keys: Keys, model: str, *, url: str = "") -> dict[str, int]:
    """{worker name: weight version it serves} of every live inference worker of `model`."""
    out = {}
    for w in await workers(r, keys, url=url):
        version = w.get("weight_version")
        if w["alive"] and w.get("role") == "infer" and str(w.get("model")) == model and isinstance(version, int):
            out[w["name"]] = version
    return out
