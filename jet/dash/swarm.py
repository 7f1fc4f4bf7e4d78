"""The swarm page's data: streams, groups, consumers, dead letters, workers, counters.

What it is: `snapshot` gathers, for one run, what `jet status` reports
(`jet.queues.admin.report`: every stream with length, and per group pending,
lag and consumers with their idle time; the stats counters), the dead letters
with their reasons (`admin.dead_letters`), the latest announced weight version
per model, and one row per worker. Workers come from the heartbeat registry
(`jet.queues.registry`: role, host, code version, the weight version served)
when roles beat; every consumer of every group is listed too, so a swarm whose
roles do not beat still shows who reads what: its role is the group, its host
the part of the `host-role-slot` name before the role, its code version the
one on its latest trajectories, its weight version the latest announced.

What it is not: a writer. Dead-letter actions are `jet.queues.admin`'s
`requeue` and `drop`, the same code `jet dlq` runs.
"""

from __future__ import annotations

import time

from jet.errors import CodecError
from jet.keys import Keys
from jet.queues import admin, codec, registry
from jet.queues.connect import translated
from jet.wire import WeightVersion

PEEK = 50  # latest trajectories per model read (every snapshot) for code versions and the no-LLM-call count


def models_of(report: dict) -> list[str]:
    """Model names that appear in the run's stream names (gen:, traj:, weights:, shadow:)."""
    out = set()
    for s in report["streams"]:
        kind, _, name = s["name"].partition(":")
        if kind in ("gen", "traj", "weights", "shadow") and name:
            out.add(name)
    return sorted(out)


async def weights(r, keys: Keys, models: list[str], url: str = "") -> dict[str, dict]:
    """model -> the latest WeightVersion announced ({version, step, time, path})."""
    out = {}
    with translated(url):
        for m in models:
            last = await r.xrevrange(keys.weights(m), count=1)
            if not last:
                continue
            try:
                w = WeightVersion.from_payload(codec.decode(last[0][1]))
            except CodecError:
                continue
            out[m] = {"version": w.version, "step": w.step, "path": w.path,
                      "time": int(last[0][0].decode().split("-")[0]) / 1000}
    return out


async def recent(r, keys: Keys, models: list[str], url: str = "") -> dict:
    """From the latest PEEK trajectories per model: worker -> code version, and counts."""
    code: dict[str, str] = {}
    counts = {"looked": 0, "failed": 0, "no_llm_calls": 0}
    with translated(url):
        for m in models:
            for _, fields in reversed(await r.xrevrange(keys.traj(m), count=PEEK)):
                try:
                    p = codec.decode(fields, max_bytes=1 << 62)
                except CodecError:
                    continue
                meta = p.meta.get("meta") if isinstance(p.meta.get("meta"), dict) else {}
                counts["looked"] += 1
                counts["failed"] += bool(p.meta.get("failed"))
                counts["no_llm_calls"] += bool(meta.get("no_llm_calls"))
                if meta.get("worker") and meta.get("code_version"):
                    code[str(meta["worker"])] = str(meta["code_version"])
    return {"code": code, **counts}


def _host(name: str, role: str) -> str | None:
    cut = name.rfind(f"-{role}-")
    return name[:cut] if cut > 0 else None


def workers(report: dict, beats: list[dict], announced: dict, code: dict, alive_s: float) -> list[dict]:
    """One row per worker: the registry's record over what the consumer groups show."""
    rows: dict[str, dict] = {}
    for s in report["streams"]:
        kind, _, target = s["name"].partition(":")
        for g in s["groups"]:
            for c in g["consumers"]:
                row = rows.setdefault(c["name"], {
                    "name": c["name"], "role": g["name"], "host": _host(c["name"], g["name"]),
                    "idle_s": c["idle_ms"] / 1000, "pending": 0, "reads": [], "source": "consumer"})
                row["idle_s"] = min(row["idle_s"], c["idle_ms"] / 1000)
                row["pending"] += c["pending"]
                row["reads"].append(s["name"])
                if kind in ("gen", "traj") and target:
                    row["model"] = target
                    if target in announced:
                        row["weight_version"] = announced[target]["version"]
                        row["weight_source"] = "announced"
                if c["name"] in code:
                    row["code_version"] = code[c["name"]]
                row["alive"] = row["idle_s"] < alive_s
    now = time.time()
    for b in beats:
        row = rows.setdefault(b["name"], {"name": b["name"], "reads": [], "pending": 0})
        row.update({k: v for k, v in b.items() if k not in ("name",)})
        row["source"] = "heartbeat"
        row["weight_source"] = "heartbeat" if "weight_version" in b else row.get("weight_source")
        row["idle_s"] = now - float(b.get("last_beat") or now)
    return sorted(rows.values(), key=lambda w: (w.get("role") or "", w["name"]))


async def snapshot(r, keys: Keys, url: str = "", *, alive_s: float = 60.0, dead_limit: int = 200) -> dict:
    """Everything the swarm page shows for one run."""
    report = await admin.report(r, keys, url)
    dead = await admin.dead_letters(r, keys, limit=dead_limit, url=url)
    for d in dead:
        d["last_error"] = str(d.get("last_error") or "")[-2000:]
    models = models_of(report)
    announced = await weights(r, keys, models, url)
    peek = await recent(r, keys, models, url)
    beats = await registry.workers(r, keys, url=url)
    rows = workers(report, beats, announced, peek.pop("code"), alive_s)
    return {**report, "dead_letters": dead, "models": models, "weights": announced, "recent": peek,
            "workers": rows, "alive_s": alive_s}
