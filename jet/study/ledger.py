"""A study's durable state in Redis: the run ledger, results, progress, stop requests and leases.

What it is: small async functions over one study's keys (`Keys.for_study`),
all under one hash tag, used by the runner, the study workers, the run
keeper and `jet study status`:
- `launch`: HSETNX the run into `study:launched` and, only if it was new,
  XADD its request to `study:runs`, in ONE Lua call. The ledger never
  expires, so a runner restarted days later cannot launch a run twice (the
  runtime's own idempotency markers do expire);
- `results` / `progress`: the result and progress streams, read from an id;
- `request_stop` / `stop_reason`: per-run stop requests (pruned, out of
  budget, cancelled); the first reason wins;
- study fields (`study:state`): the spec, first start, a paused flag;
- `Lease`: an expiring token (runner lock, per-run process lock) taken with
  SET NX PX, renewed and released only by its holder (compare in Lua).

What it is not: the consumer side (the study worker uses the runtime for
its run stream) or any planning.
"""

from __future__ import annotations

import time
import uuid

import orjson

from jet.keys import Keys
from jet.queues import codec
from jet.queues.connect import translated
from jet.study.messages import Progress, RunRequest, RunResult

# KEYS: launched hash, runs stream. ARGV: run id, request json, then the entry's field/value pairs.
# Returns the new entry id, or false when the run was launched before (nothing written).
_LAUNCH = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return false end
return redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
"""
# KEYS: lease key. ARGV: token, ttl ms. Renews (1) only while the token holds it, else 0.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


async def launch(r, url: str, keys: Keys, req: RunRequest) -> bool:
    """Add the run's request unless it was ever launched; True if it was added now."""
    fields = req.to_fields()
    args: list = [req.run, orjson.dumps(req.meta())]
    for k, v in fields.items():
        args += [k, v]
    with translated(url):
        added = await r.eval(_LAUNCH, 2, keys.study_launched, keys.study_runs, *args)
    return added is not None


async def launched(r, url: str, keys: Keys) -> dict[str, RunRequest]:
    """Every run ever launched, by run name."""
    with translated(url):
        raw = await r.hgetall(keys.study_launched)
    out = {}
    for k, v in raw.items():
        meta = orjson.loads(v)
        out[k.decode()] = RunRequest.from_payload(codec.Payload("study_run", meta["run"], meta))
    return out


async def results(r, url: str, keys: Keys, after: str = "0") -> list[tuple[str, RunResult]]:
    """(entry id, result) after `after`, oldest first; an undecodable entry is skipped (it names itself)."""
    return [(i, x) for i, x in await _read(r, url, keys.study_results, after, RunResult.from_payload)]


async def progress(r, url: str, keys: Keys, after: str = "0", count: int | None = None) -> list[tuple[str, Progress]]:
    return await _read(r, url, keys.study_progress, after, Progress.from_payload, count)


async def _read(r, url: str, stream: str, after: str, decode, count: int | None = None) -> list:
    from jet.errors import CodecError

    start = "-" if after in ("0", "0-0") else f"({after}"
    with translated(url):
        entries = await r.xrange(stream, min=start, max="+", count=count)
    out = []
    for entry_id, fields in entries:
        try:
            out.append((entry_id.decode(), decode(codec.decode(fields))))
        except CodecError:
            continue
    return out


async def add_progress(r, url: str, keys: Keys, items: list[Progress], maxlen: int = 200_000) -> None:
    if not items:
        return
    with translated(url):
        async with r.pipeline(transaction=False) as p:
            for x in items:
                p.xadd(keys.study_progress, x.to_fields(), maxlen=maxlen, approximate=True)
            await p.execute()


async def request_stop(r, url: str, keys: Keys, run: str, reason: str) -> bool:
    """Ask run `run` to stop with `reason` (the first reason wins); True if this one was recorded."""
    with translated(url):
        return bool(await r.hsetnx(keys.study_stops, run, reason))


async def stop_reason(r, url: str, keys: Keys, run: str) -> str | None:
    with translated(url):
        raw = await r.hget(keys.study_stops, run)
    return raw.decode() if raw is not None else None


async def stops(r, url: str, keys: Keys) -> dict[str, str]:
    with translated(url):
        raw = await r.hgetall(keys.study_stops)
    return {k.decode(): v.decode() for k, v in raw.items()}


async def get_field(r, url: str, keys: Keys, name: str) -> str | None:
    with translated(url):
        raw = await r.hget(keys.study_state, name)
    return raw.decode() if raw is not None else None


async def set_field(r, url: str, keys: Keys, name: str, value: str, only_new: bool = False) -> str:
    """Set a study field (with `only_new`, keep an existing value); returns the value it holds."""
    with translated(url):
        if only_new:
            await r.hsetnx(keys.study_state, name, value)
            return (await r.hget(keys.study_state, name)).decode()
        await r.hset(keys.study_state, name, value)
    return value


async def del_field(r, url: str, keys: Keys, name: str) -> None:
    with translated(url):
        await r.hdel(keys.study_state, name)


async def first_start(r, url: str, keys: Keys, name: str) -> float:
    """The unix time of the first call for `name` (a study, a run): kept across resumes and attempts."""
    return float(await set_field(r, url, keys, f"started:{name}", repr(time.time()), only_new=True))


async def count_crash(r, url: str, keys: Keys, run: str) -> int:
    with translated(url):
        return int(await r.hincrby(keys.study_crashes, run, 1))


class Lease:
    """An expiring lock held by one token: `await lease.take()`, `renew()`, `release()`."""

    def __init__(self, r, url: str, key: str, ttl_s: float, token: str | None = None):
        self.r, self.url, self.key = r, url, key
        self.ttl_ms = max(1000, int(ttl_s * 1000))
        self.token = token or uuid.uuid4().hex

    async def take(self) -> bool:
        with translated(self.url):
            return bool(await self.r.set(self.key, self.token, nx=True, px=self.ttl_ms))

    async def renew(self) -> bool:
        with translated(self.url):
            return bool(await self.r.eval(_RENEW, 1, self.key, self.token, self.ttl_ms))

    async def release(self) -> None:
        with translated(self.url):
            await self.r.eval(_RELEASE, 1, self.key, self.token)

    async def holder(self) -> str | None:
        with translated(self.url):
            raw = await self.r.get(self.key)
        return raw.decode() if raw is not None else None
