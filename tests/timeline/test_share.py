"""Group prefix trees (`jet.timeline.share`, `trainer.prefix_trees`) train exactly like separate samples.

Two GRPO groups of multi-turn episodes sampled from a real (tiny, random) Llama share one system
prompt; each group's members share their task; one member repeats another's first completion token for
token (two claims on one node: a claim leaf) and one call is greedy (context only). Through the
trainer's own path (`prepare`: advantages, loss weights, merging, packing into rows small enough that
trees are split; `accumulate`: the PPO loss and backward), with and without prefix trees, the
per-token logprobs, the step's loss and every parameter's gradient are equal, and the trees forward
fewer real tokens.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from jet.config import TrainerConfig
from jet.timeline import Call, Sample, merge_calls
from jet.timeline.share import share_prefixes
from jet.trainer.guard import prepare
from jet.trainer.packing import row_logprobs
from jet.trainer.step import accumulate
from jet.wire import Trajectory
from tests.timeline.test_model import Sampler, context_keys, tiny_llama

BUDGET = 96


def member(group: str, index: int, calls: list[Call], reward: float) -> Trajectory:
    samples = tuple(merge_calls(calls, "exact", episode_id=f"{group}-{index}", reward=reward))
    return Trajectory(task="t", group_id=group, index=index, episode_id=f"{group}-{index}", model="tiny",
                      reward=reward, samples=samples, group_size=4)


def groups(s: Sampler) -> list[list[Trajectory]]:
    system = s.tokens(30)
    out = []
    for g in range(2):
        task = system + s.tokens(6)
        members = []
        first = s.call(task, 4, version=1)
        for i in range(4):
            c1 = first if i == 1 else s.call(task, 4, version=1)  # member 1 sampled member 0's first tokens
            if i == 0:
                first = c1
            c2 = s.call(list(c1.ids) + s.tokens(3), 4, version=2, greedy=(g, i) == (1, 2))
            c3 = s.call(list(c2.ids) + s.tokens(3), 4, version=2)
            members.append(member(f"g{g}", i, [c1, c2, c3], reward=float((i * 7 + g) % 3)))
        out.append(members)
    return out


def step(model: torch.nn.Module, batch, trees: bool) -> tuple[dict, float, dict, int, int]:
    tc = TrainerConfig.of(micro_batch_tokens=BUDGET, prefix_trees=trees, lr=1e-3)
    inputs, rows = prepare(batch, tc, every_sample=True)  # every token's logprob, in both layouts
    model.zero_grad()
    stats = accumulate(model, rows, inputs, tc, lambda loss, last: loss.backward())
    logprobs: dict[tuple, list[float]] = defaultdict(list)
    with torch.no_grad():
        for row in rows:
            lp = row_logprobs(model, row)
            for b in range(row.input_ids.shape[0]):
                for j, key in enumerate(context_keys(row, b)):
                    if row.loss_mask[b, j] > 0:
                        logprobs[key].append(float(lp[b, j]))
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return ({k: sorted(v) for k, v in logprobs.items()}, stats.loss, grads, int(stats.forward_tokens),
            sum(not r.causal for r in rows))


def test_prefix_trees_train_like_separate_samples():
    model = tiny_llama("sdpa")
    batch = groups(Sampler(model))
    lp_a, loss_a, grads_a, fwd_a, _ = step(model, batch, trees=False)
    lp_b, loss_b, grads_b, fwd_b, tree_rows = step(model, batch, trees=True)
    assert tree_rows > 1, "the trees were not split over micro-batches"
    assert fwd_b < 0.7 * fwd_a, (fwd_b, fwd_a)  # pieces of a split tree re-copy their ancestors
    assert lp_b.keys() == lp_a.keys() and sum(map(len, lp_b.values())) == sum(map(len, lp_a.values()))
    for key, values in lp_b.items():
        assert values == pytest.approx(lp_a[key], abs=1e-5)
    assert loss_b == pytest.approx(loss_a, abs=1e-6) and abs(loss_a) > 1e-4
    for name, g in grads_b.items():
        torch.testing.assert_close(g, grads_a[name], atol=1e-6, rtol=1e-4, msg=name)


def linear(tokens, mask, episode=0, lp=-0.5) -> Sample:
    n = len(tokens)
    return Sample(tokens=tuple(tokens), parents=tuple(range(-1, n - 1)), mask=tuple(mask),
                  logprobs=tuple(lp if m else 0.0 for m in mask), versions=tuple(1 if m else -1 for m in mask),
                  episodes=tuple(episode if m else -1 for m in mask), model="tiny", agents=("a",),
                  episode_ids=("e",), rewards=(1.0,))


def test_shared_prompts_become_one_node_and_a_repeated_completion_a_leaf():
    a = linear([1, 2, 3, 4, 5], [0, 0, 0, 1, 1], lp=-0.1)
    b = linear([1, 2, 3, 4, 6], [0, 0, 0, 1, 1], lp=-0.2)  # the same first trained token as `a`
    c = linear([1, 2, 9], [0, 0, 1])
    d = linear([7, 8], [0, 1])  # another root
    [(tree, entries), (other, other_entries)] = share_prefixes([a, b, c, d])
    assert entries == [0, 1, 2] and other_entries == [3] and other == d
    # 1 2 3 shared; 4 trained by a, b's 4 a leaf beside it, 5 and 6 under a's 4; 9 under 2
    assert tree.tokens == (1, 2, 3, 4, 5, 6, 4, 9)
    assert tree.parents == (-1, 0, 1, 2, 3, 3, 2, 1)
    assert tree.mask == (0, 0, 0, 1, 1, 1, 1, 1)
    assert tree.logprobs[3:7] == pytest.approx([-0.1, -0.1, -0.2, -0.2]) and tree.episodes[3:] == (0, 0, 1, 1, 2)
    assert tree.episode_ids == ("e", "e", "e") and tree.rewards == (1.0, 1.0, 1.0)


def test_an_untrained_token_shares_a_trained_node_and_a_trained_one_claims_an_untrained_node():
    a = linear([1, 2, 3, 4], [0, 0, 1, 1])
    b = linear([1, 2, 3, 4, 5], [0, 0, 0, 0, 1])  # 3 and 4 are context here: they share a's nodes
    c = linear([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 1])  # 5 is context here, b trains it
    [(tree, _)] = share_prefixes([c, b, a])  # c first: its untrained 3, 4, 5 are claimed later
    assert tree.tokens == (1, 2, 3, 4, 5, 6) and tree.mask == (0, 0, 1, 1, 1, 1)
    assert tree.episodes == (-1, -1, 2, 2, 1, 0)
