"""Every message that crosses a stream, each declared once: a msgspec Struct with an explicit kind.

A message's fields are its wire format: `to_fields()` writes every field into an entry
(`jet.queues.codec`'s layout: schema version, orjson metadata, raw int32/float32 arrays) and
`from_payload(payload)` reads one back, validating the metadata against the same declaration
(msgspec: strict types, a bool is no int, a string no number, an int is accepted where a float is
asked; absent fields take their defaults, so an older sender's entry still reads) and raising
`CodecError` only, naming the field, which consumers turn into a dead letter with the reason. A field
annotated `Array("name")` travels as the raw array `name` (int32, or float32 for `tuple[float, ...]`),
never as a JSON list; `Trajectory`'s samples travel as concatenated columns (below).

Messages are facts:
- `Task`: a unit of rollout work (one member of a GRPO group, one attempt);
- `GenRequest` / `GenResult`: one LLM call, token ids in, token ids out;
- `WeightVersion`: new weights of a model are on disk;
- `Trajectory`: a finished or failed episode: its reward and merged samples.

The request id of a generation is the GenRequest's `msg_id`: it stays the same across the client's
retries, so the inference side's idempotency marker makes a retried request harmless, and a GenResult
names the request it answers.
"""

from __future__ import annotations

import hashlib
import re
import typing
from pathlib import Path
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec.structs import force_setattr

from jet.errors import CodecError
from jet.queues import codec
from jet.timeline import COLUMNS, Sample
from jet.timeline.model import columns_of

FINISH_REASONS = ("stop", "length", "error")


class Array:
    """Annotation marker: this tuple field travels as the raw array `name` of the entry."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


_WHERE = re.compile(r"^(.*?)(?: - at `\$\.?([^`]*)`)?$")
_MISSING = re.compile(r"^Object missing required field `([^`]*)`$")


class Message(msgspec.Struct, frozen=True, kw_only=True):
    """The wire behaviour every message shares; subclasses declare `KIND` and their fields."""

    KIND: ClassVar[str] = ""
    _arrays: ClassVar[dict[type, tuple[tuple[str, str, str], ...]]] = {}  # class -> (field, array, code)

    msg_id: str = msgspec.field(default_factory=codec.new_id)

    @classmethod
    def arrays(cls) -> tuple[tuple[str, str, str], ...]:
        """(field, array name, 'i' or 'f') of each `Array` field, from the declaration (once per class)."""
        found = Message._arrays.get(cls)
        if found is None:
            hints = typing.get_type_hints(cls, include_extras=True)
            found = tuple((name, marker.name, "f" if float in typing.get_args(typing.get_args(hint)[0]) else "i")
                          for name, hint in hints.items() if typing.get_origin(hint) is Annotated
                          for marker in hint.__metadata__ if isinstance(marker, Array))
            Message._arrays[cls] = found
        return found

    def to_fields(self, max_bytes: int = codec.DEFAULT_MAX_BYTES) -> dict[bytes, bytes]:
        meta = {name: getattr(self, name) for name in self.__struct_fields__ if name != "msg_id"}
        ints, floats = {}, {}
        for name, wire, code in self.arrays():
            (floats if code == "f" else ints)[wire] = meta.pop(name)
        self._encode_more(meta, ints, floats)
        return codec.encode(self.KIND, meta, ints=ints, floats=floats, msg_id=self.msg_id, max_bytes=max_bytes)

    @classmethod
    def from_payload(cls, p: codec.Payload):
        if p.kind != cls.KIND:
            raise CodecError(f"expected a {cls.KIND!r} message, got {p.kind!r}")
        meta = dict(p.meta)
        meta["msg_id"] = p.msg_id
        more = cls._decode_more(p, meta)
        arrays = cls.arrays()
        for name, _, _ in arrays:
            meta[name] = ()  # set below, from the raw arrays
        try:
            out = msgspec.convert(meta, cls)
        except msgspec.ValidationError as e:
            raise _codec_error(cls.KIND, e) from None
        for name, wire, _ in arrays:
            if wire not in p.arrays:
                raise CodecError(f"{cls.KIND}: missing array {wire!r}")
            force_setattr(out, name, tuple(p.arrays[wire]))
        for name, value in more.items():
            force_setattr(out, name, value)
        if arrays or more:
            out.__post_init__()  # its checks again, now with the arrays
        return out

    def _encode_more(self, meta: dict, ints: dict, floats: dict) -> None:
        """Fields with a wire layout of their own (a subclass's hook)."""

    @classmethod
    def _decode_more(cls, p: codec.Payload, meta: dict) -> dict[str, Any]:
        """The values of fields with a layout of their own, taken out of `meta` (a subclass's hook)."""
        return {}

    def __post_init__(self) -> None:
        pass


def _codec_error(kind: str, e: msgspec.ValidationError) -> CodecError:
    what, path = _WHERE.match(str(e)).groups()
    missing = _MISSING.match(what)
    if missing:
        name = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return CodecError(f"{kind}: missing required field {name!r}")
    return CodecError(f"{kind}: field {path!r}: {what[0].lower()}{what[1:]}")


class Task(Message, frozen=True):
    """One rollout to run: a dataset row, one member of a GRPO group."""

    KIND = "task"

    task: str  # task name (the `tasks:<task>` stream and the config's task)
    row: dict[str, Any]  # the dataset row handed to the workflow
    group_id: str  # shared by the `group_size` copies of one row
    index: int = 0  # member index within the group
    group_size: int = 1
    attempt: int = 0  # 0 for the first run; a failed episode is re-queued with attempt + 1


class GenRequest(Message, frozen=True):
    """One LLM call: complete `prompt_ids` and reply to `reply_to`.

    Sampling follows `jet.workers.inference.backend`: temperature 0 is greedy, top_p in (0, 1],
    max_tokens is clipped to the model's context, the model's EOS ids always stop. `deadline` (unix
    seconds, 0 = none) is when the caller stops waiting: a worker that reaches the request later drops
    it undecoded, without marking it done, so a copy sent again under the same msg_id is still served.
    """

    KIND = "gen"

    reply_to: str  # the requesting process's reply stream key
    model: str
    prompt_ids: Annotated[tuple[int, ...], Array("prompt")] = ()
    episode_id: str = ""
    agent: str = ""
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    deadline: float = 0.0

    def __post_init__(self) -> None:
        force_setattr(self, "prompt_ids", tuple(self.prompt_ids))
        force_setattr(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def request_id(self) -> str:
        return self.msg_id


class GenResult(Message, frozen=True):
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
    token_ids: Annotated[tuple[int, ...], Array("tokens")]
    logprobs: Annotated[tuple[float, ...], Array("logprobs")]
    finish_reason: str  # "stop" | "length" | "error"
    version: int  # weight version that generated the tokens
    error: str | None = None
    worker: str = ""  # consumer name of the inference worker that answered

    def __post_init__(self) -> None:
        force_setattr(self, "token_ids", tuple(self.token_ids))
        force_setattr(self, "logprobs", tuple(self.logprobs))
        if self.finish_reason not in FINISH_REASONS:
            raise CodecError(f"{self.KIND}: finish_reason must be one of {FINISH_REASONS}, "
                             f"got {self.finish_reason!r}")
        if len(self.token_ids) != len(self.logprobs):
            raise CodecError(f"{self.KIND}: {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs")


WEIGHTS_FILE = "model.safetensors"  # the weights file in a model or weights folder (trainer writes, backends load)


def file_sha256(path: str | Path) -> str:
    """The hex sha256 of a weights file: what a WeightVersion carries and loaders check."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class WeightVersion(Message, frozen=True):
    """New weights of `model` are on disk at `path` (a safetensors file or a folder holding one; a LoRA
    adapter version is a folder of `jet.adapters` files). A small version also travels through Redis:
    `blob` is the id of its first chunk on `wblob:<model>` and `blob_chunks` their count (`jet.queues.blobs`),
    so a worker that cannot read `path` loads it from there."""

    KIND = "weights"

    model: str
    version: int
    path: str
    sha256: str  # hex digest of the safetensors file
    step: int = 0  # trainer step that produced them
    blob: str = ""  # first entry id of the version's chunks on wblob:<model>; "" = on disk only
    blob_chunks: int = 0


Reward = float | dict[str, float]  # one number, or one per agent name


class Trajectory(Message, frozen=True):
    """One episode's outcome for one model's trainer (`traj:<model>`).

    A successful episode carries its merged samples (`jet.timeline`): the
    model's tokens and every per-token column `jet.timeline.COLUMNS` declares
    (loss mask, behaviour logprobs, weight versions, sampling settings, ...).
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
    samples: tuple[Sample, ...] = ()  # travel as concatenated columns (`_encode_more`, `_decode_more`)
    group_size: int = 1
    attempt: int = 0
    failed: bool = False
    retry: bool = False  # failed, and a new attempt of this member was queued
    error: str | None = None  # one line: why the episode failed
    traceback: str | None = None
    meta: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        force_setattr(self, "samples", tuple(self.samples))
        _check_reward(self.reward, self.KIND)
        for s in self.samples:
            if s.model != self.model:
                raise CodecError(f"{self.KIND}: a sample of model {s.model!r} in a trajectory of {self.model!r}")

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.samples)

    def _encode_more(self, meta: dict, ints: dict, floats: dict) -> None:
        samples = meta.pop("samples")
        meta["samples"] = [_sample_meta(s) for s in samples]
        more_ints, more_floats = _sample_arrays(samples)
        ints.update(more_ints)
        floats.update(more_floats)

    @classmethod
    def _decode_more(cls, p: codec.Payload, meta: dict) -> dict[str, Any]:
        specs = meta.pop("samples", None)
        if not isinstance(specs, list):
            raise CodecError(f"{cls.KIND}: " + ("missing required field 'samples'" if specs is None else
                                                f"field 'samples': expected `array`, got `{type(specs).__name__}`"))
        model = meta.get("model")
        return {"samples": _samples(p, specs, model if isinstance(model, str) else "")}


def _check_reward(reward: Any, kind: str) -> None:
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if number(reward):
        return
    if isinstance(reward, dict) and all(isinstance(a, str) and number(r) for a, r in reward.items()):
        return
    raise CodecError(f"{kind}: reward must be a number or a dict of agent name -> number, got {reward!r}")


# Samples travel concatenated: one int32 / float32 array per per-token column
# (named as the column) for all samples, cut by the per-sample lengths in the
# metadata. What travels is `jet.timeline.COLUMNS`' declaration (`Column.wire`):
# a column a receiver can derive is left out, for every sample of the entry,
# when it equals the derivation throughout (the mask is `version >= 0`, parents
# of a linear sample are i - 1, a one-episode sample's episode column is
# mask - 1, a sampling column is neutral throughout), so an older sender's entry
# without a column decodes as those values.


def _sample_meta(s: Sample) -> dict[str, Any]:
    return {"n": len(s), "agents": list(s.agents), "episode_ids": list(s.episode_ids),
            "rewards": list(s.rewards), "linear": s.is_linear}


def _sample_arrays(samples: tuple[Sample, ...]) -> tuple[dict, dict]:
    ints: dict[str, list] = {}
    floats: dict[str, list] = {}
    per_sample = [columns_of(s) for s in samples]
    for c in COLUMNS:
        if c.wire == "never":
            continue
        if c.wire == "if_needed" and all(cols[c.name] == c.derived(cols, len(cols["tokens"])) for cols in per_sample):
            continue
        (floats if c.kind is float else ints)[c.name] = [v for cols in per_sample for v in cols[c.name]]
    return ints, floats


# Decoding order: what is always sent first, so a derivation can read it (the mask reads the versions).
_DECODE_ORDER = sorted(COLUMNS, key=lambda c: c.wire != "always")


def _samples(p: codec.Payload, specs: list, model: str) -> tuple[Sample, ...]:
    total = 0
    for spec in specs:
        if not isinstance(spec, dict) or not isinstance(spec.get("n"), int) or spec["n"] < 0:
            raise CodecError(f"traj: malformed sample entry {str(spec)[:80]}")
        total += spec["n"]
    for c in COLUMNS:
        if (c.wire == "always" or (c.wire == "if_needed" and c.name in p.arrays)) \
                and len(p.arrays.get(c.name, ())) != total:
            got = len(p.arrays.get(c.name, ()))
            raise CodecError(f"traj: array {c.name!r} has {got} values, the samples need {total}")
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
    cols: dict[str, tuple] = {}
    for c in _DECODE_ORDER:
        sent = c.wire == "always" or (c.wire == "if_needed" and c.name in a)  # "always": a KeyError when missing
        cols[c.name] = tuple(a[c.name][start:end]) if sent else c.derived(cols, end - start)
    return Sample(model=model, agents=tuple(str(x) for x in spec["agents"]),
                  episode_ids=tuple(str(x) for x in spec["episode_ids"]),
                  rewards=tuple(float(r) for r in spec["rewards"]), **cols)
