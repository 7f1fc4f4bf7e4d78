"""Hand-checked timeline cases: each merge shape, the wire form, packing and the loss math."""

from __future__ import annotations

import math

import pytest
import torch

from jet.errors import CodecError
from jet.queues import codec
from jet.timeline import Call, Episode, Sample, merge_calls, merge_episodes, split_sample
from jet.trainer.losses import token_logprobs
from jet.trainer.packing import pack, pack_row
from jet.wire import Trajectory

EOS = 99


def call(prompt, completion, version=0, model="m", agent="a", finish="stop"):
    lps = [-(t + 1) / 8 for t in range(len(completion))]
    return Call(prompt, completion, lps, version, model, agent, finish)


def test_a_linear_history_is_one_timeline_with_tool_tokens_masked():
    c1 = call([1, 2], [3, 4])
    c2 = call([1, 2, 3, 4, 5, 6], [7], version=1)  # 5, 6: tool output
    [s] = merge_calls([c1, c2], "exact", episode_id="ep", reward=0.5)
    assert s.tokens == (1, 2, 3, 4, 5, 6, 7)
    assert s.mask == (0, 0, 1, 1, 0, 0, 1)
    assert s.versions == (-1, -1, 0, 0, -1, -1, 1)
    assert s.logprobs == (0.0, 0.0, -0.125, -0.25, 0.0, 0.0, -0.125)
    assert s.parents == (-1, 0, 1, 2, 3, 4, 5) and s.is_linear
    assert (s.episode_ids, s.rewards, s.agents, s.model) == (("ep",), (0.5,), ("a",), "m")


def test_none_is_one_sample_per_call():
    c1, c2 = call([1, 2], [3, 4]), call([1, 2, 3, 4, 5], [6])
    s1, s2 = merge_calls([c1, c2], "none")
    assert (s1.tokens, s1.mask) == ((1, 2, 3, 4), (0, 0, 1, 1))
    assert (s2.tokens, s2.mask) == ((1, 2, 3, 4, 5, 6), (0, 0, 0, 0, 0, 1))


def test_a_truncated_completion_followed_by_an_appended_eos_still_extends():
    c1 = call([1, 2], [3, 4], finish="length")
    c2 = call([1, 2, 3, 4, EOS, 5], [6])
    [s] = merge_calls([c1, c2], "exact")
    assert s.mask == (0, 0, 1, 1, 0, 0, 1)


def test_a_truncated_completion_re_rendered_differently_keeps_its_own_timeline():
    c1 = call([1, 2], [3, 4], finish="length")
    c2 = call([1, 2, 3, 40, 41, EOS, 5], [6])  # "4" re-tokenised as 40 41
    s1, s2 = merge_calls([c1, c2], "exact")
    assert (s1.tokens, s1.mask) == ((1, 2, 3, 4), (0, 0, 1, 1))
    assert (s2.tokens, s2.mask) == ((1, 2, 3, 40, 41, EOS, 5, 6), (0, 0, 0, 0, 0, 0, 0, 1))
    [tree] = merge_calls([c1, c2], "tree")
    assert tree.tokens == (1, 2, 3, 4, 40, 41, EOS, 5, 6)
    assert tree.parents == (-1, 0, 1, 2, 2, 4, 5, 6, 7)
    assert tree.mask == (0, 0, 1, 1, 0, 0, 0, 0, 1)
    assert tree.positions == (0, 1, 2, 3, 3, 4, 5, 6, 7)


def test_two_calls_branching_from_one_prefix():
    c1 = call([1, 2], [3])
    c2 = call([1, 2, 3, 4], [5])
    c3 = call([1, 2, 3, 6], [7])  # a second branch from the same context
    s1, s2 = merge_calls([c1, c2, c3], "exact")
    assert (s1.tokens, s1.mask) == ((1, 2, 3, 4, 5), (0, 0, 1, 0, 1))
    assert (s2.tokens, s2.mask) == ((1, 2, 3, 6, 7), (0, 0, 0, 0, 1))  # 3 is trained in s1 only
    [t] = merge_calls([c1, c2, c3], "tree")
    assert (t.tokens, t.parents) == ((1, 2, 3, 4, 5, 6, 7), (-1, 0, 1, 2, 3, 2, 5))
    assert t.mask == (0, 0, 1, 0, 1, 0, 1)


def test_exact_extends_the_longest_matching_timeline():
    c1, c2 = call([1], [2]), call([1, 2, 3], [4])
    c3 = call([1, 9], [8])
    c4 = call([1, 2, 3, 4, 5], [6])
    samples = merge_calls([c1, c2, c3, c4], "exact")
    assert [s.tokens for s in samples] == [(1, 2, 3, 4, 5, 6), (1, 9, 8)]


def test_different_models_never_share_a_timeline_or_tree():
    c1 = call([1, 2], [3], model="a")
    c2 = call([1, 2, 3, 4], [5], model="b")
    for mode in ("exact", "tree"):
        s1, s2 = merge_calls([c1, c2], mode)
        assert (s1.model, s1.tokens) == ("a", (1, 2, 3))
        assert (s2.model, s2.tokens, s2.mask) == ("b", (1, 2, 3, 4, 5), (0, 0, 0, 0, 1))


def test_agents_on_one_model_merge_only_on_a_real_prefix():
    planner = call([1, 2], [3], agent="planner")
    coder = call([1, 2, 3, 4], [5], agent="coder")  # sees the planner's exact tokens
    [s] = merge_calls([planner, coder], "exact")
    assert s.agents == ("planner", "coder") and s.mask == (0, 0, 1, 0, 1)
    other = call([7, 3, 4], [5], agent="coder")  # its own system prompt: no prefix
    assert len(merge_calls([planner, other], "exact")) == 2


def test_a_grpo_group_shares_its_prompt_once_in_tree_mode():
    prompt = [1, 2, 3]
    group = [Episode((call(prompt, [10 + i, 20 + i]),), f"e{i}", float(i)) for i in range(3)]
    assert sum(map(len, merge_episodes(group, "exact"))) == 15
    [t] = merge_episodes(group, "tree")
    assert t.tokens == (1, 2, 3, 10, 20, 11, 21, 12, 22)
    assert t.episode_ids == ("e0", "e1", "e2") and t.rewards == (0.0, 1.0, 2.0)
    assert t.episodes == (-1, -1, -1, 0, 0, 1, 1, 2, 2)


def test_identical_samples_of_a_group_are_both_trained():
    a, b = call([1, 2], [3, 4]), call([1, 2], [3, 4])
    [t] = merge_calls([a, b], "tree")
    assert (t.tokens, t.parents, t.mask) == ((1, 2, 3, 4, 3, 4), (-1, 0, 1, 2, 1, 4), (0, 0, 1, 1, 1, 1))


def test_calls_with_nothing_generated_leave_no_sample():
    assert merge_calls([call([1, 2], [])], "none") == []
    c1, c2 = call([1, 2], [3]), call([1, 2, 3, 4, 5], [])
    assert [s.tokens for s in merge_calls([c1, c2], "exact")] == [(1, 2, 3)]


def test_calls_are_validated():
    with pytest.raises(ValueError, match="non-empty prompt"):
        call([], [1])
    with pytest.raises(ValueError, match="logprobs"):
        Call([1], [2, 3], [-1.0], 0, "m")
    with pytest.raises(ValueError, match="version"):
        Call([1], [2], [-1.0], -1, "m")
    with pytest.raises(ValueError, match="mode"):
        merge_calls([call([1], [2])], "fuzzy")


def wire(s: Sample) -> dict[bytes, bytes]:
    """A sample on the wire: inside a Trajectory (jet.wire's layout, the only one)."""
    return Trajectory("t", "g", 0, "e", s.model, 1.0, (s,)).to_fields()


def unwire(fields: dict[bytes, bytes]) -> Sample:
    [s] = Trajectory.from_payload(codec.decode(fields)).samples
    return s


def test_wire_form_is_compact_and_round_trips():
    linear = merge_calls([call([1, 2], [3, 4]), call([1, 2, 3, 4, 5], [6])], "exact")[0]
    fields = wire(linear)
    assert b"i4:parents" not in fields and b"i4:episodes" not in fields and b"i4:mask" not in fields
    assert len(fields[b"i4:tokens"]) == len(fields[b"i4:versions"]) == len(fields[b"f4:logprobs"]) == 4 * 6
    assert unwire(fields) == linear
    tree = merge_episodes([Episode((call([1], [2]),), "a", 1.0), Episode((call([1], [3]),), "b", 0.0)], "tree")[0]
    fields = wire(tree)
    assert b"i4:parents" in fields and b"i4:episodes" in fields
    assert unwire(fields) == tree


def test_malformed_samples_raise_codec_errors():
    s = merge_calls([call([1, 2], [3, 4])], "exact")[0]
    fields = wire(s)
    with pytest.raises(CodecError, match="array 'tokens' has 3 values, the samples need 4"):
        unwire({**fields, b"i4:tokens": fields[b"i4:tokens"][:-4]})
    with pytest.raises(CodecError, match="preorder"):
        unwire({**fields, b"i4:parents": codec.encode("x", {}, ints={"p": [-1, 0, 3, 2]})[b"i4:p"]})
    with pytest.raises(CodecError, match="trained tokens need"):
        unwire({**fields, b"i4:versions": codec.encode("x", {}, ints={"v": [0, -1, 0, 0]})[b"i4:v"]})
    with pytest.raises(CodecError, match="expected a 'traj'"):
        unwire(codec.encode("task", {}))
    with pytest.raises(CodecError, match="malformed sample"):
        unwire({**fields, b"m": fields[b"m"].replace(b'"n":4', b'"n":"4"')})


def test_split_copies_ancestors_untrained():
    prompt = [1, 2, 3]
    [t] = merge_calls([call(prompt, [10, 11]), call(prompt, [20, 21]), call(prompt, [30, 31])], "tree")
    pieces = split_sample(t, 7)
    assert [p.tokens for p in pieces] == [(1, 2, 3, 10, 11, 20, 21), (1, 2, 3, 30, 31)]
    assert pieces[1].mask == (0, 0, 0, 1, 1)
    with pytest.raises(ValueError, match="ancestors"):
        split_sample(t, 4)


def test_tree_attention_mask_and_positions():
    [t] = merge_calls([call([1, 2], [3]), call([1, 2, 3, 4], [5]), call([1, 2, 6], [7])], "tree")
    assert t.tokens == (1, 2, 3, 4, 5, 6, 7)
    row = pack_row([t])
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3]]
    assert row.parent_index.tolist() == [[-1, 0, 1, 2, 3, 1, 5]]
    allowed = row.attention_mask(torch.bool)[0, 0].int().tolist()
    assert allowed[6] == [1, 1, 0, 0, 0, 1, 1]  # 7 sees 1 2 6 and itself, not the other branch
    assert allowed[4] == [1, 1, 1, 1, 1, 0, 0]
    additive = row.attention_mask(torch.float32)[0, 0]
    assert additive[6, 2] == torch.finfo(torch.float32).min and additive[6, 5] == 0
    assert not row.causal and pack_row([merge_calls([call([1], [2])])[0]]).causal


def test_packing_fills_rows_without_crossing_samples():
    samples = merge_calls([call([i], [i + 1, i + 2]) for i in range(0, 30, 3)], "none")
    rows = pack(samples, 7)
    assert [r.n_tokens for r in rows] == [6, 6, 6, 6, 6] and all(r.n_samples == 2 for r in rows)
    allowed = rows[0].attention_mask(torch.bool)[0, 0]
    assert not allowed[3:, :3].any()
    assert len(pack(samples, 7, share_rows=False)) == 10


def test_token_logprobs_reads_each_token_from_its_parent():
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [0.0, math.log(3.0)]]])
    ids = torch.tensor([[0, 1, 0]])
    parents = torch.tensor([[-1, 0, 1]])
    assert torch.allclose(token_logprobs(logits, ids, parents), torch.tensor([[0.0, math.log(0.5), math.log(0.75)]]))
    tree_parents = torch.tensor([[-1, 0, 0]])  # token 2 is a sibling of token 1
    assert torch.allclose(token_logprobs(logits, ids, tree_parents)[0, 2], torch.tensor(math.log(0.5)))


def test_a_greedy_call_claims_no_node_so_tree_mode_never_costs_more_than_exact():
    """The case hypothesis found (tests/timeline/test_props.py): a greedy call's completion token used to
    claim its trie node, so a sampled call with the same token made a sibling, and a later prompt went
    down the greedy branch, keeping it alive: 6 tokens in tree mode against 5 in exact mode."""
    def c(prompt, completion, model="m1", temperature=1.0):
        return Call(prompt, completion, [-0.5] * len(completion), 0, model, "a", "stop", temperature)

    calls = [c((0,), (0,), temperature=0.0), c((0,), (0,)), c((0,), (0,), model="m2"), c((0, 0, 0), ()),
             c((0, 0), ()), c((0, 0), (0,))]
    size = {mode: sum(map(len, merge_calls(calls, mode))) for mode in ("tree", "exact")}
    assert size == {"tree": 5, "exact": 5}
