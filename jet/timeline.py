"""Timelines: merge an episode's LLM calls into training samples, token-exact.

What it is: `Call` (one LLM call as the client saw it: prompt ids, completion
ids and logprobs, weight version, model, agent, finish reason, and the
sampling settings temperature and top_p), `Sample` (what a trainer trains on:
a linear sequence or a prefix tree of tokens with a loss mask, behaviour
logprobs, versions and each token's sampling settings) and `merge_calls` /
`merge_episodes`:

- ``none``: one sample per call, the baseline: O(T^2) tokens for T turns.
- ``exact``: a call extends the timeline of its model whose tokens are the
  longest exact token prefix of its prompt; the appended prompt tokens (tool
  output, user turns, other agents' messages) get mask 0, the completion mask
  1. A call that extends nothing (history rewritten, a truncated completion
  re-rendered differently, a second branch from one prefix) starts a new
  timeline whose whole prompt is mask 0, so the tokens an earlier timeline
  already trains are never trained twice.
- ``tree``: all calls of one model go into one prefix tree (trie); every
  distinct token position is stored once (see `jet.timeline_tree`).

Cutting a sample to a token budget (`split_sample`, `truncate_sample`) lives in
`jet.timeline_split` and is re-exported here.

Greedy calls (temperature 0) are context, never trained: their completion
tokens get mask 0 like prompt tokens. A greedy token was not drawn from any
distribution the trainer could evaluate (its behaviour probability is 1, the
PPO ratio against it is meaningless), and training it under temperature 1
would push the policy towards its own argmax as if it had been sampled.

What it is not: no tokenisation, no chat templates, no torch. Prompts must be
built token-in-token-out (docs/design.md, "Timelines"); this module only compares
token ids, so it cannot be fooled by text that re-tokenises differently.

Invariants (tests/test_timeline_props.py checks them on random episodes):
- every completion token of every sampled (temperature > 0) call appears in
  exactly one sample with mask 1, its logprob, its version, its call's
  temperature and top_p and exactly its call's context: its ancestors are the
  call's prompt followed by the completion tokens before it;
- mask-0 tokens carry logprob 0.0, version -1, episode -1, temperature 1.0 and
  top_p 1.0; a root is never trained (nothing predicts it), and no sample ends
  in an untrained leaf;
- tokens are in depth-first preorder: parents[i] < i and every subtree is a
  contiguous range, so "k is an ancestor-or-self of q" is k <= q < end[k];
- one model per sample; position id = depth in the tree.
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


# --- building samples ---------------------------------------------------------
#
# Builders describe a sample as flat preorder columns: token, parent, and who
# generated it (`who` = index of the call, -1 for prompt tokens, `k` = offset
# in that call's completion). `_build` prunes and fills the behaviour columns.


def _prune(parents: Sequence[int], who: Sequence[int]) -> list[int]:
    """Indices to keep: every token with a trained token at or below it."""
    live = [w >= 0 for w in who]
    for i in range(len(parents) - 1, -1, -1):
        if live[i] and parents[i] >= 0:
            live[parents[i]] = True
    return [i for i, keep in enumerate(live) if keep]


def _build(
    tokens: Sequence[int],
    parents: Sequence[int],
    who: Sequence[int],
    k: Sequence[int],
    calls: Sequence[Call],
    episode_of: Sequence[int],
    episodes: Sequence[Episode],
) -> Sample | None:
    who = [w if w < 0 or calls[w].temperature > 0 else -1 for w in who]  # greedy tokens are context
    keep = _prune(parents, who)
    if not keep:
        return None
    new_index = {old: new for new, old in enumerate(keep)}
    local_episode: dict[int, int] = {}
    agents: dict[str, None] = {}
    lps, vers, eps, temps, top_ps = [], [], [], [], []
    for i in keep:
        c = who[i]
        if c < 0:
            lps.append(0.0)
            vers.append(-1)
            eps.append(-1)
            temps.append(1.0)
            top_ps.append(1.0)
        else:
            agents.setdefault(calls[c].agent)
            lps.append(calls[c].completion_logprobs[k[i]])
            vers.append(calls[c].version)
            eps.append(local_episode.setdefault(episode_of[c], len(local_episode)))
            temps.append(calls[c].temperature)
            top_ps.append(calls[c].top_p)
    return Sample(
        tokens=tuple(tokens[i] for i in keep),
        parents=tuple(new_index[parents[i]] if parents[i] >= 0 else -1 for i in keep),
        mask=tuple(int(who[i] >= 0) for i in keep),
        logprobs=tuple(lps),
        versions=tuple(vers),
        episodes=tuple(eps),
        model=calls[next(who[i] for i in keep if who[i] >= 0)].model,
        agents=tuple(agents),
        episode_ids=tuple(episodes[e].episode_id for e in local_episode),
        rewards=tuple(float(episodes[e].reward) for e in local_episode),
        temperatures=tuple(temps),
        top_ps=tuple(top_ps),
    )


class _Line:
    """A linear timeline being built (exact and none modes)."""

    __slots__ = ("model", "tokens", "who", "k")

    def __init__(self, model: str):
        self.model = model
        self.tokens: list[int] = []
        self.who: list[int] = []
        self.k: list[int] = []

    def is_prefix_of(self, prompt: tuple[int, ...]) -> bool:
        n = len(self.tokens)
        return n <= len(prompt) and list(prompt[:n]) == self.tokens

    def append(self, index: int, call: Call) -> None:
        extra = call.prompt_ids[len(self.tokens) :]
        self.tokens += extra
        self.who += [-1] * len(extra)
        self.k += [0] * len(extra)
        self.tokens += call.completion_ids
        self.who += [index] * len(call.completion_ids)
        self.k += range(len(call.completion_ids))


def _lines(calls: Sequence[Call], mode: str) -> list[_Line]:
    lines: list[_Line] = []
    for index, call in enumerate(calls):
        best = None
        if mode == "exact":
            for line in lines:
                longer = best is None or len(line.tokens) > len(best.tokens)
                if line.model == call.model and longer and line.is_prefix_of(call.prompt_ids):
                    best = line
        if best is None:
            best = _Line(call.model)
            lines.append(best)
        best.append(index, call)
    return lines


def merge_episodes(episodes: Sequence[Episode], mode: Mode = "exact") -> list[Sample]:
    """Merge the calls of several episodes (a GRPO group, say) into samples.

    Episodes are merged together, so the members of a group that share a task
    prompt can share it in `tree` mode; each trained token still carries its
    own episode (Sample.episodes) and so its reward.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    calls = [c for e in episodes for c in e.calls]
    episode_of = [i for i, e in enumerate(episodes) for _ in e.calls]
    if mode == "tree":
        from jet.timeline_tree import tree_columns

        columns = tree_columns(calls)
    else:
        columns = [
            (line.tokens, list(range(-1, len(line.tokens) - 1)), line.who, line.k)
            for line in _lines(calls, mode)
        ]
    built = (_build(*cols, calls, episode_of, episodes) for cols in columns)
    return [s for s in built if s is not None]


def merge_calls(
    calls: Sequence[Call], mode: Mode = "exact", *, episode_id: str = "", reward: float = 0.0
) -> list[Sample]:
    """Merge one episode's calls, in the order they were made, into samples."""
    return merge_episodes([Episode(tuple(calls), episode_id, reward)], mode)


# Cutting samples to a budget lives in jet.timeline_split; re-exported here, where callers found it.
from jet.timeline_split import split_sample, truncate_sample  # noqa: E402
