"""Every message that crosses a stream: frozen dataclasses with an explicit kind.

Each type encodes to an entry field map with `to_fields()` and decodes with
`from_payload(payload)`; the layout (schema version, orjson metadata, raw
int32/float32 arrays) is `jet.queues.codec`'s. Decoding validates the metadata
against a msgspec schema per kind (strict types, the field named in the error)
and raises `CodecError` only, which consumers turn into a dead letter with the
reason.

Messages are facts:
- `Task`: a unit of rollout work (one member of a GRPO group, one attempt);
- `GenRequest` / `GenResult`: one LLM call, token ids in, token ids out;
- `WeightVersion`: new weights of a model are on disk;
- `Trajectory`: a finished or failed episode: its reward and merged samples.

Token ids and logprobs travel as raw int32 / float32 arrays, never JSON lists.
The request id of a generation is the GenRequest's `msg_id`: it stays the same
across the client's retries, so the inference side's idempotency marker makes a
retried request harmless, and a GenResult names the request it answers.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from jet.errors import CodecError
from jet.queues import codec
from jet.timeline import Sample

FINISH_REASONS = ("stop", "length", "error")


# The metadata of each message kind as a msgspec schema: strict types (a bool is no int, a string no
# number; an int is accepted where a float is asked), None where an optional field is absent. Token
# arrays are not here: they travel as raw int32/float32 fields (`jet.queues.codec`).


class _TaskMeta(msgspec.Struct):
    task: str
    row: dict[str, Any]
    group_id: str
    index: int
    group_size: int
    attempt: int | None = None


class _GenRequestMeta(msgspec.Struct):
    reply_to: str
    model: str
    temperature: float
    top_p: float
    max_tokens: int
    stop_token_ids: list[int]
    episode_id: str | None = None
    agent: str | None = None
    seed: int | None = None
    deadline: float | None = None


class _GenResultMeta(msgspec.Struct):
    request_id: str
    model: str
    finish_reason: str
    version: int
    error: str | None = None
    worker: str | None = None


class _WeightVersionMeta(msgspec.Struct):
    model: str
    version: int
    path: str
    sha256: str
    step: int | None = None


class _TrajectoryMeta(msgspec.Struct):
    task: str
    group_id: str
    index: int
    episode_id: str
    model: str
    group_size: int
    attempt: int
    failed: bool
    retry: bool
    meta: dict[str, Any]
    samples: list[Any]
    reward: Any = None
    error: str | None = None
    traceback: str | None = None


_WHERE = re.compile(r"^(.*?)(?: - at `\$\.?([^`]*)`)?$")
_MISSING = re.compile(r"^Object missing required field `([^`]*)`$")


def _meta(p: codec.Payload, kind: str, schema: type[msgspec.Struct]):
    """`p`'s metadata validated against `schema`; CodecError naming the field otherwise."""
    if p.kind != kind:
        raise CodecError(f"expected a {kind!r} message, got {p.kind!r}")
    try:
        return msgspec.convert(p.meta, schema)
    except msgspec.ValidationError as e:
        what, path = _WHERE.match(str(e)).groups()
        missing = _MISSING.match(what)
        if missing:
            name = f"{path}.{missing.group(1)}" if path else missing.group(1)
            raise CodecError(f"{kind}: missing required field {name!r}") from None
        raise CodecError(f"{kind}: field {path!r}: {what[0].lower()}{what[1:]}") from None


def _array(p: codec.Payload, name: str, kind: str) -> tuple:
    if name not in p.arrays:
        raise CodecError(f"{kind}: missing array {name!r}")
    return tuple(p.arrays[name])


@dataclass(frozen=True, slots=True)
class Task:
    """One rollout to run: a dataset row, one member of a GRPO group."""

    KIND = "task"

    task: str  # task name (the `tasks:<task>` stream and the config's task)
    row: dict[str, Any]  # the dataset row handed to the workflow
    group_id: str  # shared by the `group_size` copies of one row
    index: int = 0  # member index within the group
    group_size: int = 1
    msg_id: str = field(default_factory=codec.new_id)
    attempt: int = 0  # 0 for the first run; a failed episode is re-queued with attempt + 1

    def to_fields(self) -> dict[bytes, bytes]:
        meta = {"task": self.task, "row": self.row, "group_id": self.group_id,
                "index": self.index, "group_size": self.group_size, "attempt": self.attempt}
        return codec.encode(self.KIND, meta, msg_id=self.msg_id)

    @classmethod
    def from_payload(cls, p: codec.Payload) -> "Task":
        m = _meta(p, cls.KIND, _TaskMeta)
        return cls(task=m.task, row=m.row, group_id=m.group_id, index=m.index, group_size=m.group_size,
                   msg_id=p.msg_id, attempt=m.attempt or 0)


@dataclass(frozen=True, slots=True)
class GenRequest:
    """One LLM call: complete `prompt_ids` and reply to `reply_to`.

    Sampling follows `jet.workers.hf_backend`: temperature 0 is greedy, top_p
    in (0, 1], max_tokens is clipped to the model's context, the model's EOS ids
    always stop. `deadline` (unix seconds, 0 = none) is when the caller stops
    waiting: a worker that reaches the request later drops it undecoded, without
    marking it done, so a copy sent again under the same msg_id is still served.
    """

    KIND = "gen"

    reply_to: str  # the requesting process's reply stream key
    model: str
    prompt_ids: tuple[int, ...]
    episode_id: str = ""
    agent: str = ""
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    deadline: float = 0.0
    msg_id: str = field(default_factory=codec.new_id)  # the request id, kept across retries

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def request_id(self) -> str:
        return self.msg_id

    def to_fields(self, max_bytes: int = codec.DEFAULT_MAX_BYTES) -> dict[bytes, bytes]:
        meta = {"reply_to": self.reply_to, "model": self.model, "episode_id": self.episode_id,
                "agent": self.agent, "temperature": self.temperature, "top_p": self.top_p,
                "max_tokens": self.max_tokens, "stop_token_ids": list(self.stop_token_ids),
                "seed": self.seed, "deadline": self.deadline}
        return codec.encode(self.KIND, meta, ints={"prompt": self.prompt_ids}, msg_id=self.msg_id,
                            max_bytes=max_bytes)

    @classmethod
    def from_payload(cls, p: codec.Payload) -> "GenRequest":
        m = _meta(p, cls.KIND, _GenRequestMeta)
        return cls(reply_to=m.reply_to, model=m.model, prompt_ids=_array(p, "prompt", cls.KIND),
                   episode_id=m.episode_id or "", agent=m.agent or "", temperature=m.temperature, top_p=m.top_p,
                   max_tokens=m.max_tokens, stop_token_ids=tuple(m.stop_token_ids), seed=m.seed,
                   deadline=m.deadline or 0.0, msg_id=p.msg_id)


@dataclass(frozen=True, slots=True)
class GenResult:
    """The answer to one GenRequest.

    `logprobs[i]` is the logprob of the sampled token `token_ids[i]` under the
    temperature-scaled, top-p renormalised distribution it was drawn from, in
    float32 (`jet.sampling` defines it; the trainer recomputes exactly this):

        log_softmax(logits / T)[t] - logsumexp(log_softmax(logits / T)[N])

    where N is the top-p nucleus of softmax(logits / T) (the whole vocabulary
    when top_p = 1, so then it is plain log_softmax(logits / T)[t]). This is
    vLLM's `logprobs_mode="processed_logprobs"` of the sampled token. Greedy
    requests (T = 0) report log_softmax(logits)[t]; their tokens are never
    trained (`jet.timeline`). Top-k is not supported. A stop token that ended
    the completion is included. On error, `finish_reason` is "error", `error`
    says why and the arrays are empty.
    """

    KIND = "gen_result"

    request_id: str  # the GenRequest's msg_id
    model: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" | "length" | "error"
    version: int  # weight version that generated the tokens
    error: str | None = None
    worker: str = ""  # consumer name of the inference worker that answered
    msg_id: str = field(default_factory=codec.new_id)

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        object.__setattr__(self, "logprobs", tuple(self.logprobs))
        if self.finish_reason not in FINISH_REASONS:
            raise CodecError(f"{self.KIND}: finish_reason must be one of {FINISH_REASONS}, "
                             f"got {self.finish_reason!r}")
        if len(self.token_ids) != len(self.logprobs):
            raise CodecError(f"{self.KIND}: {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs")

    def to_fields(self) -> dict[bytes, bytes]:
        meta = {"request_id": self.request_id, "model": self.model, "finish_reason": self.finish_reason,
                "version": self.version, "error": self.error, "worker": self.worker}
        return codec.encode(self.KIND, meta, ints={"tokens": self.token_ids},
                            floats={"logprobs": self.logprobs}, msg_id=self.msg_id)

    @classmethod
    def from_payload(cls, p: codec.Payload) -> "GenResult":
        m, k = _meta(p, cls.KIND, _GenResultMeta), cls.KIND
        return cls(request_id=m.request_id, model=m.model, token_ids=_array(p, "tokens", k),
                   logprobs=_array(p, "logprobs", k), finish_reason=m.finish_reason, version=m.version,
                   error=m.error, worker=m.worker or "",
                   msg_id=p.msg_id)


WEIGHTS_FILE = "model.safetensors"  # the weights file in a model or weights folder (trainer writes, backends load)


def file_sha256(path: str | Path) -> str:
    """The hex sha256 of a weights file: what a WeightVersion carries and loaders check."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class WeightVersion:
    """New weights of `model` are on disk at `path` (a safetensors file or a folder holding one)."""

    KIND = "weights"

    model: str
    version: int
    path: str
    sha256: str  # hex digest of the safetensors file
    step: int = 0  # trainer step that produced them
    msg_id: str = field(default_factory=codec.new_id)

    def to_fields(self) -> dict[bytes, bytes]:
        meta = {"model": self.model, "version": self.version, "path": self.path,
                "sha256": self.sha256, "step": self.step}
        return codec.encode(self.KIND, meta, msg_id=self.msg_id)

    @classmethod
    def from_payload(cls, p: codec.Payload) -> "WeightVersion":
        m = _meta(p, cls.KIND, _WeightVersionMeta)
        return cls(model=m.model, version=m.version, path=m.path, sha256=m.sha256, step=m.step or 0,
                   msg_id=p.msg_id)


Reward = float | dict[str, float]  # one number, or one per agent name


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One episode's outcome for one model's trainer (`traj:<model>`).

    A successful episode carries its merged samples (`jet.timeline`): the
    model's tokens, loss mask, behaviour logprobs and per-token weight versions.
    A failed one (`failed`) carries no samples, the reason (`error`) and the
    traceback; `retry` says whether another attempt of the same group member
    was queued (else the group trains without it). `meta` holds what the env
    worker knows of the run (worker, workflow, duration, workflow-reported info).
    """

    KIND = "traj"

    task: str
    group_id: str
    index: int  # member index within the GRPO group
    episode_id: str
    model: str  # whose tokens the samples hold (the stream it is published to)
    reward: Reward = 0.0
    samples: tuple[Sample, ...] = ()
    group_size: int = 1
    attempt: int = 0
    failed: bool = False
    retry: bool = False  # failed, and a new attempt of this member was queued
    error: str | None = None  # one line: why the episode failed
    traceback: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    msg_id: str = field(default_factory=codec.new_id)

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", tuple(self.samples))
        _check_reward(self.reward, self.KIND)
        for s in self.samples:
            if s.model != self.model:
                raise CodecError(f"{self.KIND}: a sample of model {s.model!r} in a trajectory of {self.model!r}")

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.samples)

    def to_fields(self, max_bytes: int = codec.DEFAULT_MAX_BYTES) -> dict[bytes, bytes]:
        meta = {"task": self.task, "group_id": self.group_id, "index": self.index,
                "episode_id": self.episode_id, "model": self.model, "reward": self.reward,
                "group_size": self.group_size, "attempt": self.attempt, "failed": self.failed,
                "retry": self.retry, "error": self.error, "traceback": self.traceback, "meta": self.meta,
                "samples": [_sample_meta(s) for s in self.samples]}
        ints, floats = _sample_arrays(self.samples)
        return codec.encode(self.KIND, meta, ints=ints, floats=floats, msg_id=self.msg_id, max_bytes=max_bytes)

    @classmethod
    def from_payload(cls, p: codec.Payload) -> "Trajectory":
        m = _meta(p, cls.KIND, _TrajectoryMeta)
        return cls(task=m.task, group_id=m.group_id, index=m.index, episode_id=m.episode_id, model=m.model,
                   reward=m.reward, samples=_samples(p, m.samples, m.model), group_size=m.group_size,
                   attempt=m.attempt, failed=m.failed, retry=m.retry, error=m.error, traceback=m.traceback,
                   meta=m.meta, msg_id=p.msg_id)


def _check_reward(reward: Any, kind: str) -> None:
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if number(reward):
        return
    if isinstance(reward, dict) and all(isinstance(a, str) and number(r) for a, r in reward.items()):
        return
    raise CodecError(f"{kind}: reward must be a number or a dict of agent name -> number, got {reward!r}")


# Samples travel concatenated: one int32 / float32 array per column for all
# samples, cut by the per-sample lengths in the metadata. Columns a sample can
# derive are left out as `Sample.encode` does: the mask is `version >= 0`,
# parents of a linear sample are i - 1, a one-episode sample's episode column is
# mask - 1, and the sampling columns (temperatures, top_ps) are 1.0 throughout
# when absent (every token at the default settings, or an older sender).


def _sample_meta(s: Sample) -> dict[str, Any]:
    return {"n": len(s), "agents": list(s.agents), "episode_ids": list(s.episode_ids),
            "rewards": list(s.rewards), "linear": s.is_linear}


def _sample_arrays(samples: tuple[Sample, ...]) -> tuple[dict, dict]:
    ints: dict[str, list[int]] = {"tokens": [], "versions": []}
    floats: dict[str, list[float]] = {"logprobs": []}
    for s in samples:
        ints["tokens"] += s.tokens
        ints["versions"] += s.versions
        floats["logprobs"] += s.logprobs
    if any(not s.is_linear for s in samples):
        ints["parents"] = [p for s in samples for p in s.parents]
    if any(len(s.episode_ids) > 1 for s in samples):
        ints["episodes"] = [e for s in samples for e in s.episodes]
    if any(not s.default_sampling for s in samples):
        floats["temperatures"] = [t for s in samples for t in s.temperatures]
        floats["top_ps"] = [p for s in samples for p in s.top_ps]
    return ints, floats


def _samples(p: codec.Payload, specs: list, model: str) -> tuple[Sample, ...]:
    total = 0
    for spec in specs:
        if not isinstance(spec, dict) or not isinstance(spec.get("n"), int) or spec["n"] < 0:
            raise CodecError(f"traj: malformed sample entry {str(spec)[:80]}")
        total += spec["n"]
    for name in ("tokens", "versions", "logprobs", "parents", "episodes", "temperatures", "top_ps"):
        required = name in ("tokens", "versions", "logprobs")
        if (required or name in p.arrays) and len(p.arrays.get(name, ())) != total:
            got = len(p.arrays.get(name, ()))
            raise CodecError(f"traj: array {name!r} has {got} values, the samples need {total}")
    out, start = [], 0
    for spec in specs:
        end = start + spec["n"]
        try:
            out.append(_one_sample(p, spec, model, start, end))
        except (KeyError, TypeError, ValueError) as e:
            raise CodecError(f"traj: malformed sample: {e}") from None
        start = end
    return tuple(out)


def _one_sample(p: codec.Payload, spec: dict, model: str, start: int, end: int) -> Sample:
    a = p.arrays
    versions = tuple(a["versions"][start:end])
    mask = tuple(int(v >= 0) for v in versions)
    parents = tuple(a["parents"][start:end]) if "parents" in a else tuple(range(-1, end - start - 1))
    episodes = tuple(a["episodes"][start:end]) if "episodes" in a else tuple(x - 1 for x in mask)
    temps = tuple(a["temperatures"][start:end]) if "temperatures" in a else ()
    top_ps = tuple(a["top_ps"][start:end]) if "top_ps" in a else ()
    return Sample(tokens=tuple(a["tokens"][start:end]), parents=parents, mask=mask,
                  logprobs=tuple(a["logprobs"][start:end]), versions=versions, episodes=episodes,
                  model=model, agents=tuple(str(x) for x in spec["agents"]),
                  episode_ids=tuple(str(x) for x in spec["episode_ids"]),
                  rewards=tuple(float(r) for r in spec["rewards"]), temperatures=temps, top_ps=top_ps)
