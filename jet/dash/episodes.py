"""Episodes for `jet dash`: the latest trajectories of a run, and one decoded token by token.

What it is: `latest` pages backwards through `traj:<model>` (or `shadow:<model>`)
with XREVRANGE and keeps the entries matching the filters (task, reward range,
failed, no LLM call), one summary row each; `one` decodes a single entry: every
sample's tokens as text with the model's tokenizer, beside their loss mask,
behaviour logprob and weight version, plus the reward, versions, code version
and, for a failed episode, its error and traceback.

What it is not: a consumer. It never reads with a group, never acks, never
trims: reading here cannot take a trajectory from the trainer.

Invariants: joining the texts of a sample's tokens gives the tokenizer's decode
of the whole sample (a byte sequence split across tokens is shown on the token
that completes it); an entry that does not decode is listed with the reason.
"""

from __future__ import annotations

from typing import Any, Callable

from jet.errors import CodecError
from jet.keys import Keys
from jet.queues import codec
from jet.queues.connect import translated
from jet.wire import Trajectory

PAGE = 200  # entries per XREVRANGE
MAX_SCAN = 5000  # entries looked at per request, at most, when filters match few


def _mean(reward: Any) -> float:
    if isinstance(reward, dict):
        return sum(reward.values()) / len(reward) if reward else 0.0
    return float(reward or 0.0)


def summary(entry_id: str, t: Trajectory) -> dict:
    versions = sorted({v for s in t.samples for v, m in zip(s.versions, s.mask) if m})
    return {"id": entry_id, "time": int(entry_id.split("-")[0]) / 1000, "task": t.task, "model": t.model,
            "reward": _mean(t.reward), "rewards": t.reward if isinstance(t.reward, dict) else None,
            "failed": t.failed, "error": t.error, "retry": t.retry, "episode_id": t.episode_id,
            "group_id": t.group_id, "index": t.index, "attempt": t.attempt, "samples": len(t.samples),
            "tokens": t.n_tokens, "trained": sum(s.n_trained for s in t.samples),
            "versions": versions, "calls": t.meta.get("calls"), "no_llm_calls": bool(t.meta.get("no_llm_calls")),
            "code_version": t.meta.get("code_version"), "worker": t.meta.get("worker"), "host": t.meta.get("host")}


def _matches(row: dict, f: dict) -> bool:
    if f.get("task") and f["task"].lower() not in row["task"].lower():
        return False
    if f.get("min_reward") is not None and (row["failed"] or row["reward"] < f["min_reward"]):
        return False
    if f.get("max_reward") is not None and (row["failed"] or row["reward"] > f["max_reward"]):
        return False
    if f.get("failed") is not None and row["failed"] != f["failed"]:
        return False
    return not f.get("no_llm_calls") or row["no_llm_calls"]


def _decode(entry_id: str, fields: dict) -> tuple[Trajectory | None, str]:
    try:
        return Trajectory.from_payload(codec.decode(fields, max_bytes=1 << 62)), ""
    except CodecError as e:
        return None, f"{entry_id}: {e}"


async def latest(r, keys: Keys, model: str, *, stream: str = "traj", before: str | None = None,
                 limit: int = 50, filters: dict | None = None, url: str = "") -> dict:
    """{"rows": [...], "next": entry id to pass as `before` for older rows or None, "scanned",
    "unreadable": [reasons]}; newest first."""
    key = keys.shadow(model) if stream == "shadow" else keys.traj(model)
    f = filters or {}
    rows: list[dict] = []
    bad: list[str] = []
    scanned, high, last = 0, f"({before}" if before else "+", None
    with translated(url):
        while len(rows) < limit and scanned < MAX_SCAN:
            entries = await r.xrevrange(key, max=high, min="-", count=PAGE)
            if not entries:
                last = None
                break
            for raw_id, fields in entries:
                entry_id = raw_id.decode()
                scanned += 1
                last = entry_id
                t, why = _decode(entry_id, fields)
                if t is None:
                    bad.append(why)
                elif _matches(row := summary(entry_id, t), f):
                    rows.append(row)
                    if len(rows) >= limit:
                        break
            high = f"({last}"
            if len(entries) < PAGE and len(rows) < limit:
                last = None
                break
    return {"rows": rows, "next": last, "scanned": scanned, "unreadable": bad[:20]}


def token_texts(decode: Callable[[list[int]], str], ids: list[int], context: int = 4) -> list[str]:
    """The text each token adds, so that "".join(result) == decode(ids) for byte-level and
    sentencepiece tokenizers: each token is decoded after a few tokens of context (which settles
    leading spaces) and a token that ends inside a multi-byte character gives its bytes to the next."""
    out: list[str] = []
    done = 0  # tokens [0, done) have been given their text
    for i in range(len(ids)):
        lo = max(0, done - context)
        before = decode(ids[lo:done]) if done > lo else ""
        text = decode(ids[lo:i + 1])
        if text.endswith("\ufffd") and i + 1 < len(ids) and i + 1 - done < 4:
            out.append("")  # an incomplete character: the token that completes it shows it
            continue
        out.append(text[len(before):] if text.startswith(before) else text)
        done = i + 1
    return out


def sample_view(s, decode: Callable[[list[int]], str] | None) -> dict:
    ids = list(s.tokens)
    texts = token_texts(decode, ids) if decode else [f"[{t}]" for t in ids]
    linear = all(p == i - 1 for i, p in enumerate(s.parents))
    return {"tokens": ids, "text": texts, "mask": list(s.mask), "logprobs": [round(x, 4) for x in s.logprobs],
            "versions": list(s.versions), "parents": None if linear else list(s.parents),
            "agents": list(s.agents), "episode_ids": list(s.episode_ids), "rewards": list(s.rewards)}


async def one(r, keys: Keys, model: str, entry_id: str, decoder: Callable[[str], Callable | None], *,
              stream: str = "traj", url: str = "") -> dict | None:
    """One trajectory with its samples decoded ({"error"} if it does not decode); None if absent
    (trimmed, or a wrong id). `decoder(model)` gives a decode function or None (ids shown)."""
    import anyio

    key = keys.shadow(model) if stream == "shadow" else keys.traj(model)
    with translated(url):
        entries = await r.xrange(key, min=entry_id, max=entry_id, count=1)
    if not entries:
        return None
    t, why = _decode(entry_id, entries[0][1])
    if t is None:
        return {"id": entry_id, "unreadable": why}
    decode = await anyio.to_thread.run_sync(decoder, model)
    samples = [await anyio.to_thread.run_sync(sample_view, s, decode) for s in t.samples]
    return {**summary(entry_id, t), "traceback": t.traceback, "meta": t.meta, "group_size": t.group_size,
            "decoded": decode is not None, "samples_view": samples}
