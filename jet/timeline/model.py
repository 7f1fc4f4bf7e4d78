"""The timeline data model: `Call` (one LLM call, token-in-token-out), `Episode` and `Sample` (what a
trainer trains on: a linear sequence or a prefix tree of tokens with a loss mask and the behaviour
columns), with the checks that keep a Sample valid and `prune` (what a sample keeps of a token tree).

What it is not: a merge (`jet.timeline.merge`), a split (`jet.timeline.split`) or a tree builder
(`jet.timeline.tree`); those three build on this module and never on each other's private names.
Invariants: see `jet.timeline.merge`.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

Mode = Literal["none", "exact", "tree"]
MODES: tuple[str, ...] = ("none", "exact", "tree")


def _f32(values: Iterable[float]) -> tuple[float, ...]:
    """Round to float32, the wire precision, so encode/decode round-trips exactly."""
    return tuple(array("f", values).tolist())


@dataclass(frozen=True, slots=True)
class Call:
    """One LLM call, token-in-token-out. Sequences are normalised to tuples."""

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
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

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


@dataclass(frozen=True, slots=True)
class Sample:
    """A training sample: a linear sequence or a prefix tree in preorder.

    Per-token columns, all of one length. Where mask is 0 the behaviour fields
    are unset: logprob 0.0, version -1, episode -1, temperature 1.0, top_p 1.0
    (the mask says which are valid). On the wire (a Trajectory's samples,
`jet.wire`, the one layout) the mask is not sent: it is
    `version >= 0`; the sampling columns are sent only when some token was
    drawn with temperature or top_p other than 1, so a sample without them
    (an older sender's) decodes as temperature 1, top_p 1. Left empty in the
    constructor, they mean the same.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # -1 for a root; parents[i] == i - 1 throughout a linear sample
    mask: tuple[int, ...]  # 1 only where the model generated the token
    logprobs: tuple[float, ...]  # behaviour logprob (float32 values)
    versions: tuple[int, ...]  # weight version that generated the token
    episodes: tuple[int, ...]  # index into episode_ids of the generating call's episode
    model: str
    agents: tuple[str, ...]  # agents whose calls generated tokens here, in order of first appearance
    episode_ids: tuple[str, ...]
    rewards: tuple[float, ...]  # one per episode_ids entry
    temperatures: tuple[float, ...] = ()  # sampling temperature of each token (> 0 where trained)
    top_ps: tuple[float, ...] = ()  # nucleus mass of each token, in (0, 1]

    def __post_init__(self) -> None:
        n = len(self.tokens)
        object.__setattr__(self, "temperatures", _f32(self.temperatures) if self.temperatures else (1.0,) * n)
        object.__setattr__(self, "top_ps", _f32(self.top_ps) if self.top_ps else (1.0,) * n)
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
    def default_sampling(self) -> bool:
        """Every token at temperature 1, top_p 1: the sampling columns need not travel."""
        return all(t == 1.0 for t in self.temperatures) and all(p == 1.0 for p in self.top_ps)

    @property
    def positions(self) -> tuple[int, ...]:
        """Position id of each token: its depth (0 for a root)."""
        depth: list[int] = []
        for p in self.parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        return tuple(depth)


def _check_sample(s: Sample) -> None:
    n = len(s.tokens)
    columns = (s.parents, s.mask, s.logprobs, s.versions, s.episodes, s.temperatures, s.top_ps)
    if any(len(c) != n for c in columns):
        raise ValueError(f"per-token columns differ in length: {[n, *map(len, columns)]}")
    if len(s.rewards) != len(s.episode_ids):
        raise ValueError(f"{len(s.episode_ids)} episode ids but {len(s.rewards)} rewards")
    rows = zip(s.mask, s.logprobs, s.versions, s.episodes, s.parents, s.temperatures, s.top_ps)
    for i, (m, lp, v, e, p, t, tp) in enumerate(rows):
        if m == 1:
            if v < 0 or p < 0 or not 0 <= e < len(s.episode_ids):
                raise ValueError(f"token {i}: trained tokens need a version, a parent and an episode")
            if not math.isfinite(lp):
                raise ValueError(f"token {i}: behaviour logprob {lp} is not finite")
            if not (0 < t < math.inf and 0 < tp <= 1):
                raise ValueError(f"token {i}: trained tokens need temperature > 0 and top_p in (0, 1], "
                                 f"got {t}, {tp}")
        elif m != 0 or lp != 0.0 or v != -1 or e != -1 or t != 1.0 or tp != 1.0:
            raise ValueError(f"token {i}: untrained tokens carry logprob 0.0, version -1, episode -1, "
                             f"temperature 1.0, top_p 1.0")
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
