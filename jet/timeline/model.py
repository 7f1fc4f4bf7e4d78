"""The timeline data model: `Call` (one LLM call, token-in-token-out), `Episode` and `Sample` (what a
trainer trains on: a linear sequence or a prefix tree of tokens with a loss mask and the behaviour
columns), the declaration of a Sample's per-token columns (`Column`, `COLUMNS`), the checks that keep a
Sample valid and `prune` (what a sample keeps of a token tree).

The per-token columns are declared once, on the fields of `Sample` (`column(...)`): each one's kind, its
value on untrained tokens, whether and when it travels on the wire, the trainer's packed tensor that
carries it and the `Call` attribute a trained token takes it from. The merge (`jet.timeline.merge`), the
group prefix trees (`jet.timeline.share`), the split (`jet.timeline.split`), the wire (`jet.wire`'s
Trajectory samples) and the trainer's packing (`jet.trainer.packing`) derive their handling of them from
`COLUMNS`, so a new column is one field here, plus its producer (the Call attribute it is taken from)
and its consumer (whoever reads the packed tensor). The sampling columns follow `jet.sampling.PARAMS`.

What it is not: a merge (`jet.timeline.merge`), a split (`jet.timeline.split`) or a tree builder
(`jet.timeline.tree`); those three build on this module and never on each other's private names.
Invariants: see `jet.timeline.merge`.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field, fields, replace
from itertools import compress
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

from jet import sampling

Mode = Literal["none", "exact", "tree"]
MODES: tuple[str, ...] = ("none", "exact", "tree")
Wire = Literal["always", "if_needed", "never"]


def _f32(values: Iterable[float]) -> tuple[float, ...]:
    """Round to float32, the wire precision, so encode/decode round-trips exactly."""
    return tuple(array("f", values).tolist())


@dataclass(frozen=True, slots=True)
class Call:
    """One LLM call, token-in-token-out. Sequences are normalised to tuples.

    Its sampling settings (temperature, top_p) are those of `jet.sampling.PARAMS`, one field each."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    completion_logprobs: tuple[float, ...]  # behaviour logprob of each completion token
    version: int  # weight version that generated the completion (>= 0)
    model: str
    agent: str = ""
    finish_reason: str = "stop"  # "stop" (EOS) or "length" (cut by max_tokens, no EOS)
    temperature: float = 1.0  # the request's sampling temperature; 0 = greedy (never trained)
    top_p: float = 1.0  # the request's nucleus mass, in (0, 1]

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "completion_ids", tuple(int(t) for t in self.completion_ids))
        object.__setattr__(self, "completion_logprobs", _f32(self.completion_logprobs))
        if not self.prompt_ids:
            raise ValueError("a call needs a non-empty prompt (something must predict its first token)")
        if len(self.completion_logprobs) != len(self.completion_ids):
            raise ValueError(
                f"{len(self.completion_ids)} completion ids but {len(self.completion_logprobs)} logprobs"
            )
        if self.version < 0:
            raise ValueError(f"version must be >= 0, got {self.version}")
        bad = sampling.errors(self)
        if bad:
            raise ValueError(bad)

    @property
    def ids(self) -> tuple[int, ...]:
        """Prompt followed by completion: the full context after this call."""
        return self.prompt_ids + self.completion_ids


@dataclass(frozen=True, slots=True)
class Episode:
    """The calls of one episode, in the order they were made, and its reward."""

    calls: tuple[Call, ...]
    episode_id: str = ""
    reward: float = 0.0


# --- the per-token columns -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Column:
    """One per-token column of a Sample, as `column()` declares it on the field."""

    name: str  # the Sample field and the wire array: the column's one spelling
    kind: type  # int (int32 on the wire) or float (float32 values: rounded on construction)
    unset: int | float | None  # an untrained token's value; None: every token has its own (tokens, parents)
    wire: Wire  # "always": sent; "if_needed": sent when some sample's values differ from `derived`;
    #             "never": the receiver derives it (`derived`; the Sample invariants make that exact)
    derive: Callable[[Mapping[str, tuple], int], tuple] | None  # the receiver's values when not sent (None: unset)
    row: str | None  # the trainer's packed tensor that carries it; None: the packer makes its own from it
    row_kind: type  # that tensor's kind: int (int64) or float (float32)
    source: str | None  # the Call attribute a trained token takes it from (a tuple: the token's entry);
    #                     None: the merge sets it itself (mask, episodes)
    need: tuple[Callable[[Any], bool], str] | None  # what a trained token's value satisfies, and the phrase
    optional: bool  # may be left empty in the constructor: unset throughout (an older caller's, or sender's)

    def derived(self, cols: Mapping[str, tuple], n: int) -> tuple:
        """The column of an n-token sample whose other columns are `cols`, when it was not sent."""
        return self.derive(cols, n) if self.derive is not None else (self.unset,) * n

    def take(self, call: Call, k: int) -> Any:
        """The value of the `k`-th completion token of `call`."""
        value = getattr(call, self.source)
        return value[k] if isinstance(value, tuple) else value


def column(kind: type, *, unset: int | float | None = None, wire: Wire = "always",
           derive: Callable[[Mapping[str, tuple], int], tuple] | None = None, row: str | None = None,
           row_kind: type | None = None, source: str | None = None,
           need: tuple[Callable[[Any], bool], str] | None = None, optional: bool = False) -> Any:
    """A Sample field that is a per-token column (see `Column` for each argument)."""
    spec = Column("", kind, unset, wire, derive, row, row_kind or kind, source, need, optional)
    return field(default=(), metadata={"column": spec}) if optional else field(metadata={"column": spec})


def sampling_column(name: str, need: tuple[Callable[[Any], bool], str] | None = None) -> Any:
    """The column of the sampling setting `name` of `jet.sampling.PARAMS`: each token's value, neutral where
    untrained, sent only when some token differs, packed under the column's name."""
    p = sampling.BY_NAME[name]
    return column(float, unset=p.neutral, wire="if_needed", row=p.column, source=p.name, optional=True,
                  need=need or (p.ok, f"{p.name} {p.rule}"))


def _linear(cols: Mapping[str, tuple], n: int) -> tuple[int, ...]:
    return tuple(range(-1, n - 1))


def _mask_of_versions(cols: Mapping[str, tuple], n: int) -> tuple[int, ...]:
    return tuple(int(v >= 0) for v in cols["versions"])


def _episodes_of_mask(cols: Mapping[str, tuple], n: int) -> tuple[int, ...]:
    return tuple(m - 1 for m in cols["mask"])


@dataclass(frozen=True, slots=True)
class Sample:
    """A training sample: a linear sequence or a prefix tree in preorder.

    Per-token columns, all of one length, declared with `column()` (what each
    is on the wire and in the trainer's packed rows: `Column`). Where mask is
    0 the behaviour columns are unset (logprob 0.0, version -1, episode -1,
    temperature 1.0, top_p 1.0): the mask says which are valid. On the wire (a
    Trajectory's samples, `jet.wire`) the mask is not sent: it is
    `version >= 0`; parents travel only for trees, episodes only for samples
    of several episodes, and a sampling column only when some token was drawn
    with a setting other than neutral, so a sample without them (an older
    sender's) decodes as temperature 1, top_p 1. Left empty in the
    constructor, the sampling columns mean the same.
    """

    tokens: tuple[int, ...] = column(int)  # packed as the row's input ids
    # -1 for a root; parents[i] == i - 1 throughout a linear sample (the packer derives positions from it)
    parents: tuple[int, ...] = column(int, wire="if_needed", derive=_linear)
    mask: tuple[int, ...] = column(int, unset=0, wire="never", derive=_mask_of_versions, row="loss_mask",
                                   row_kind=float)  # 1 only where the model generated the token
    logprobs: tuple[float, ...] = column(float, unset=0.0, row="behaviour_logprobs", source="completion_logprobs",
                                         need=(math.isfinite, "a finite behaviour logprob"))
    versions: tuple[int, ...] = column(int, unset=-1, row="versions", source="version",
                                       need=(lambda v: v >= 0, "a weight version >= 0"))  # that generated it
    # index into episode_ids of the generating call's episode (the packer turns it into rewards and `seq`)
    episodes: tuple[int, ...] = column(int, unset=-1, wire="if_needed", derive=_episodes_of_mask)
    model: str
    agents: tuple[str, ...]  # agents whose calls generated tokens here, in order of first appearance
    episode_ids: tuple[str, ...]
    rewards: tuple[float, ...]  # one per episode_ids entry
    # the sampling settings of each token (`jet.sampling.PARAMS`)
    temperatures: tuple[float, ...] = sampling_column(
        "temperature", need=(lambda t: 0 < t < math.inf, "temperature > 0 (finite: greedy tokens are never trained)"))
    top_ps: tuple[float, ...] = sampling_column("top_p")

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for c in COLUMNS:
            values = getattr(self, c.name)
            if c.optional and not values:
                object.__setattr__(self, c.name, (c.unset,) * n)
            elif c.kind is float:
                object.__setattr__(self, c.name, _f32(values))
        _check_sample(self)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_trained(self) -> int:
        return sum(self.mask)

    @property
    def is_linear(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @property
    def positions(self) -> tuple[int, ...]:
        """Position id of each token: its depth (0 for a root)."""
        depth: list[int] = []
        for p in self.parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        return tuple(depth)


COLUMNS: tuple[Column, ...] = tuple(replace(f.metadata["column"], name=f.name) for f in fields(Sample)
                                    if "column" in f.metadata)
CARRIED: tuple[Column, ...] = tuple(c for c in COLUMNS if c.unset is not None)  # set on trained tokens only
FROM_CALL: tuple[Column, ...] = tuple(c for c in CARRIED if c.source)  # what a trained token takes from its call
PACKED: tuple[Column, ...] = tuple(c for c in COLUMNS if c.row)  # a tensor of its own in the trainer's rows
_UNSET = ", ".join(f"{c.name} {c.unset}" for c in CARRIED)


def columns_of(s: Sample) -> dict[str, tuple]:
    """{name: values} of every per-token column of `s`."""
    return {c.name: getattr(s, c.name) for c in COLUMNS}


def _check_sample(s: Sample) -> None:
    n = len(s.tokens)
    lengths = {c.name: len(getattr(s, c.name)) for c in COLUMNS}
    if any(m != n for m in lengths.values()):
        raise ValueError(f"per-token columns differ in length: {lengths}")
    if len(s.rewards) != len(s.episode_ids):
        raise ValueError(f"{len(s.episode_ids)} episode ids but {len(s.rewards)} rewards")
    for i, (m, p, e) in enumerate(zip(s.mask, s.parents, s.episodes)):
        if m == 1 and (p < 0 or not 0 <= e < len(s.episode_ids)):
            raise ValueError(f"token {i}: trained tokens need a parent and an episode, got parent {p}, "
                             f"episode {e} of {len(s.episode_ids)}")
    trained = [m == 1 for m in s.mask]
    untrained = [not t for t in trained]
    for c in CARRIED:  # column by column, each distinct value checked once (most repeat)
        values = getattr(s, c.name)
        ok, phrase = c.need or (None, "")
        bad_trained = ok is not None and not all(map(ok, set(compress(values, trained))))
        if bad_trained or not set(compress(values, untrained)) <= {c.unset}:
            for i, (m, v) in enumerate(zip(s.mask, values)):
                if m == 1 and ok is not None and not ok(v):
                    raise ValueError(f"token {i}: trained tokens need {phrase}, got {c.name} {v}")
                if m != 1 and v != c.unset:
                    raise ValueError(f"token {i}: untrained tokens carry {_UNSET} (got {c.name} {v})")
    _check_preorder(s.parents)


def _check_preorder(parents: Sequence[int]) -> None:
    """Raise unless every parent is on the path from the root to the previous token."""
    path: list[int] = []
    for i, p in enumerate(parents):
        while path and path[-1] != p:
            path.pop()
        if p != -1 and not path:
            raise ValueError(f"token {i}: parent {p} breaks depth-first preorder")
        path.append(i)


def prune(parents: Sequence[int], who: Sequence[int]) -> list[int]:
    """Indices to keep: every token with a trained token at or below it."""
    live = [w >= 0 for w in who]
    for i in range(len(parents) - 1, -1, -1):
        if live[i] and parents[i] >= 0:
            live[parents[i]] = True
    return [i for i, keep in enumerate(live) if keep]
