"""Timelines: merge an episode's LLM calls into training samples, token-exact.

What it is: `merge_calls` / `merge_episodes`, from `Call`s (one LLM call as
the client saw it: prompt ids, completion ids and logprobs, weight version,
model, agent, finish reason, and the sampling settings temperature and top_p)
to `Sample`s (what a trainer trains on: a linear sequence or a prefix tree of
tokens with a loss mask and the per-token behaviour columns; both in
`jet.timeline.model`), in one of three modes:

- ``none``: one sample per call, the baseline: O(T^2) tokens for T turns.
- ``exact``: a call extends the timeline of its model whose tokens are the
  longest exact token prefix of its prompt; the appended prompt tokens (tool
  output, user turns, other agents' messages) get mask 0, the completion mask
  1. A call that extends nothing (history rewritten, a truncated completion
  re-rendered differently, a second branch from one prefix) starts a new
  timeline whose whole prompt is mask 0, so the tokens an earlier timeline
  already trains are never trained twice.
- ``tree``: all calls of one model go into one prefix tree (trie); every
  distinct token position is stored once (see `jet.timeline.tree`).

Cutting a sample to a token budget (`split_sample`, `truncate_sample`) lives in
`jet.timeline.split`; the package `jet.timeline` exports all of them.

Greedy calls (temperature 0) are context, never trained: their completion
tokens get mask 0 like prompt tokens. A greedy token was not drawn from any
distribution the trainer could evaluate (its behaviour probability is 1, the
PPO ratio against it is meaningless), and training it under temperature 1
would push the policy towards its own argmax as if it had been sampled.

What it is not: no tokenisation, no chat templates, no torch. Prompts must be
built token-in-token-out (docs/design.md, "Timelines"); this module only compares
token ids, so it cannot be fooled by text that re-tokenises differently.

Invariants (tests/timeline/test_props.py checks them on random episodes):
- every completion token of every sampled (temperature > 0) call appears in
  exactly one sample with mask 1, every column its call gives it
  (`jet.timeline.model.FROM_CALL`: its logprob, its call's version,
  temperature and top_p) and exactly its call's context: its ancestors are the
  call's prompt followed by the completion tokens before it;
- mask-0 tokens carry each behaviour column's unset value (`Column.unset`:
  logprob 0.0, version -1, episode -1, temperature 1.0, top_p 1.0); a root is
  never trained (nothing predicts it), and no sample ends in an untrained leaf;
- tokens are in depth-first preorder: parents[i] < i and every subtree is a
  contiguous range, so "k is an ancestor-or-self of q" is k <= q < end[k];
- one model per sample; position id = depth in the tree.
"""

from __future__ import annotations

from typing import Sequence

from jet.timeline.model import CARRIED, FROM_CALL, MODES, Call, Episode, Mode, Sample, prune
from jet.timeline.tree import tree_columns

# --- building samples ---------------------------------------------------------
#
# Builders describe a sample as flat preorder columns: token, parent, and who
# generated it (`who` = index of the call, -1 for prompt tokens, `k` = offset
# in that call's completion). `_build` prunes and fills the behaviour columns
# (`jet.timeline.model.CARRIED`): a trained token takes each from its call
# (`Column.source`), its mask and its episode from where it stands.


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
    keep = prune(parents, who)
    if not keep:
        return None
    new_index = {old: new for new, old in enumerate(keep)}
    callers, offsets = [who[i] for i in keep], [k[i] for i in keep]
    local_episode: dict[int, int] = {}
    agents: dict[str, None] = {}
    for c in callers:
        if c >= 0:
            agents.setdefault(calls[c].agent)
            local_episode.setdefault(episode_of[c], len(local_episode))
    cols: dict[str, list] = {
        "mask": [int(c >= 0) for c in callers],
        "episodes": [local_episode[episode_of[c]] if c >= 0 else -1 for c in callers],
    }
    for col in FROM_CALL:  # a Call attribute: one value per completion token (a tuple), or one for the call
        of_call = {c: getattr(calls[c], col.source) for c in set(callers) if c >= 0}
        if isinstance(next(iter(of_call.values())), tuple):
            cols[col.name] = [of_call[c][j] if c >= 0 else col.unset for c, j in zip(callers, offsets)]
        else:
            cols[col.name] = [of_call[c] if c >= 0 else col.unset for c in callers]
    return Sample(
        tokens=tuple(tokens[i] for i in keep),
        parents=tuple(new_index[parents[i]] if parents[i] >= 0 else -1 for i in keep),
        model=calls[next(who[i] for i in keep if who[i] >= 0)].model,
        agents=tuple(agents),
        episode_ids=tuple(episodes[e].episode_id for e in local_episode),
        rewards=tuple(float(episodes[e].reward) for e in local_episode),
        **{name: tuple(values) for name, values in cols.items()},
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

