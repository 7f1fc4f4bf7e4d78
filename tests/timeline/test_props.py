"""Property tests of timeline merging on random episodes (hypothesis).

Episodes are drawn with a tiny vocabulary so accidental prefix matches are
common, and mix every shape the merger must survive: fresh prompts, prompts
that extend an earlier call, branches cut anywhere into an earlier context
(a truncated completion re-rendered differently, a rewritten history),
repeated calls that sample the very same tokens, empty completions, two
models, two agents and mixed sampling settings (greedy calls among them).
"""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jet.queues import codec
from jet.timeline import MODES, Call, Episode, Sample, merge_calls, merge_episodes, split_sample, truncate_sample
from jet.trainer.packing import pack
from jet.wire import Trajectory

SETTINGS = settings(max_examples=150, deadline=None)


@st.composite
def call_lists(draw, max_calls: int = 10) -> list[Call]:
    vocab = draw(st.integers(2, 5))
    seq = st.lists(st.integers(0, vocab - 1), max_size=5)
    calls: list[Call] = []
    for i in range(draw(st.integers(1, max_calls))):
        shape = draw(st.sampled_from(["fresh", "extend", "branch", "repeat"])) if calls else "fresh"
        base = draw(st.sampled_from(calls)) if calls else None
        if shape == "fresh":
            prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=5))
        elif shape == "extend":
            prompt = list(base.ids) + draw(seq)
        elif shape == "branch":
            prompt = list(base.ids[: draw(st.integers(1, len(base.ids)))]) + draw(seq)
        else:
            prompt = list(base.prompt_ids)
        completion = list(base.completion_ids) if shape == "repeat" and draw(st.booleans()) else draw(seq)
        calls.append(
            Call(
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=[-(i * 10 + k + 1) / 64 for k in range(len(completion))],
                version=draw(st.integers(0, 3)),
                model=draw(st.sampled_from(["m1", "m1", "m2"])),
                agent=draw(st.sampled_from(["a", "b"])),
                finish_reason=draw(st.sampled_from(["stop", "length"])),
                temperature=draw(st.sampled_from([1.0, 1.0, 0.5, 0.0])),
                top_p=draw(st.sampled_from([1.0, 0.75])),
            )
        )
    return calls


def context(sample: Sample, i: int) -> tuple[int, ...]:
    path = []
    p = sample.parents[i]
    while p >= 0:
        path.append(sample.tokens[p])
        p = sample.parents[p]
    return tuple(reversed(path))


def expected_tokens(episodes: list[Episode]) -> Counter:
    """(model, context, token, logprob, version, episode id, temperature, top_p) of every sampled token."""
    out: Counter = Counter()
    for e in episodes:
        for c in e.calls:
            if c.temperature == 0:  # greedy: context only
                continue
            for k, (t, lp) in enumerate(zip(c.completion_ids, c.completion_logprobs)):
                out[(c.model, c.prompt_ids + c.completion_ids[:k], t, lp, c.version, e.episode_id,
                     c.temperature, c.top_p)] += 1
    return out


def trained_tokens(samples: list[Sample]) -> Counter:
    out: Counter = Counter()
    for s in samples:
        for i, m in enumerate(s.mask):
            if m:
                episode = s.episode_ids[s.episodes[i]]
                out[(s.model, context(s, i), s.tokens[i], s.logprobs[i], s.versions[i], episode,
                     s.temperatures[i], s.top_ps[i])] += 1
    return out


def check_samples(samples: list[Sample]) -> None:
    for s in samples:
        has_child = set(p for p in s.parents if p >= 0)
        for i in range(len(s)):
            if not s.mask[i]:
                assert (s.logprobs[i], s.versions[i], s.episodes[i]) == (0.0, -1, -1)
                assert (s.temperatures[i], s.top_ps[i]) == (1.0, 1.0)
            if i not in has_child:
                assert s.mask[i] == 1, "an untrained leaf was kept"
        assert s.n_trained > 0
        assert Trajectory.from_payload(codec.decode(Trajectory("t", "g", 0, "e", s.model, 1.0, (s,)).to_fields())).samples == (s,)


@SETTINGS
@given(call_lists(), st.sampled_from(MODES))
def test_every_generated_token_trained_exactly_once_in_its_context(calls, mode):
    samples = merge_calls(calls, mode, episode_id="e", reward=1.0)
    assert trained_tokens(samples) == expected_tokens([Episode(tuple(calls), "e")])
    check_samples(samples)
    agent_of = {lp: c.agent for c in calls for lp in c.completion_logprobs}  # logprobs are unique here
    assert all(t > 0 for s in samples for t, m in zip(s.temperatures, s.mask) if m), "greedy is never trained"
    for s in samples:
        assert set(s.agents) == {agent_of[lp] for lp, m in zip(s.logprobs, s.mask) if m}
        assert s.rewards == (1.0,)
    if mode != "tree":
        assert all(s.is_linear for s in samples)


@SETTINGS
@given(call_lists())
def test_merging_never_costs_tokens(calls):
    size = {mode: sum(map(len, merge_calls(calls, mode))) for mode in MODES}
    assert size["tree"] <= size["exact"] <= size["none"]


@SETTINGS
@given(st.lists(st.lists(st.integers(0, 3), max_size=6), min_size=1, max_size=8), st.integers(0, 3))
def test_a_linear_history_is_one_timeline(turns, first):
    calls, prompt = [], [first]
    for i, completion in enumerate(turns):
        calls.append(Call(prompt, completion, [-1.0] * len(completion), i, "m"))
        prompt = list(calls[-1].ids) + [first]
    last = max((c for c in calls if c.completion_ids), key=lambda c: len(c.ids), default=None)
    samples = merge_calls(calls, "exact")
    if last is None:
        assert samples == []
    else:
        assert len(samples) == 1 and samples[0].tokens == last.ids
        assert samples == merge_calls(calls, "tree")


@SETTINGS
@given(st.lists(call_lists(max_calls=4), min_size=1, max_size=4), st.sampled_from(MODES))
def test_group_merge_keeps_each_token_with_its_episode_reward(groups, mode):
    episodes = [Episode(tuple(calls), f"ep{i}", float(i)) for i, calls in enumerate(groups)]
    samples = merge_episodes(episodes, mode)
    assert trained_tokens(samples) == expected_tokens(episodes)
    for s in samples:
        assert s.rewards == tuple(float(e[2:]) for e in s.episode_ids)
    check_samples(samples)


@SETTINGS
@given(call_lists(), st.integers(1, 12))
def test_split_keeps_every_trained_token_and_its_context(calls, budget):
    for s in merge_calls(calls, "tree"):
        deepest = max(s.positions) + 1
        if deepest > budget:
            continue
        pieces = split_sample(s, budget)
        assert all(len(p) <= budget for p in pieces)
        assert trained_tokens(pieces) == trained_tokens([s])
        check_samples(pieces)


@SETTINGS
@given(call_lists(), st.sampled_from(MODES), st.integers(1, 12))
def test_truncation_keeps_exactly_the_trained_tokens_whose_context_fits(calls, mode, budget):
    for s in merge_calls(calls, mode):
        cut = truncate_sample(s, budget)
        fits = Counter({k: n for k, n in trained_tokens([s]).items() if len(k[1]) < budget})
        if cut is None:
            assert not fits
            continue
        assert max(cut.positions) < budget and trained_tokens([cut]) == fits
        check_samples([cut])
        assert trained_tokens(split_sample(cut, budget)) == fits, "a truncated sample always splits"


def naive_ancestor_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        k = q
        while k >= 0:
            mask[q, k] = True
            k = parents[k]
    return mask


@SETTINGS
@given(call_lists(), st.sampled_from(MODES), st.integers(6, 30))
def test_packed_rows_attend_exactly_to_ancestors(calls, mode, budget):
    samples = [s for s in merge_calls(calls, mode) if max(s.positions) < budget]
    rows = pack(samples, budget)
    assert sum(int(r.loss_mask.sum()) for r in rows) == sum(s.n_trained for s in samples)
    for row in rows:
        parents = row.parent_index[0].tolist()
        assert row.n_tokens <= budget
        assert torch.equal(row.attention_mask(torch.bool)[0, 0], naive_ancestor_mask(parents))
        depth: list[int] = []
        for p in parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        assert row.position_ids[0].tolist() == depth
        trained = row.loss_mask[0] > 0
        assert bool((row.parent_index[0][trained] >= 0).all())
        assert bool((row.versions[0][~trained] == -1).all()) and bool((row.behaviour_logprobs[0][~trained] == 0).all())
