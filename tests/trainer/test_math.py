"""Advantages, the clipped PPO loss, k3 KL, LR schedule and loss weights against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from jet.config import TrainerConfig
from jet.timeline import Sample
from jet.trainer.advantages import group_advantages, member_advantages
from jet.trainer.groups import no_signal
from jet.trainer.batch import build_step
from jet.trainer.losses import k3_kl, ppo_loss
from jet.trainer.optim import lr_at
from jet.trainer.packing import pack
from tests.trainer.helpers import MODEL, call, traj


def close(a, b, tol=1e-6):
    assert a == pytest.approx(b, abs=tol)


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # mean 0.5, sample std sqrt((4 * 0.25) / 3) = 0.57735
    assert group_advantages(r, "grpo").tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-5)
    # leave-one-out: 1 - (0 + 0 + 1) / 3 = 2/3
    assert group_advantages(r, "rloo").tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], abs=1e-6)
    assert group_advantages(r, "no_std").tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])
    r = torch.tensor([3.0, 1.0, 2.0])  # mean 2, sample std 1
    assert group_advantages(r, "grpo").tolist() == pytest.approx([1.0, -1.0, 0.0], abs=1e-5)
    assert group_advantages(r, "rloo").tolist() == pytest.approx([3 - 1.5, 1 - 2.5, 0.0])
    for mode in ("grpo", "rloo", "no_std"):
        assert group_advantages(torch.tensor([2.0, 2.0, 2.0]), mode).tolist() == [0.0, 0.0, 0.0]
        assert group_advantages(torch.tensor([5.0]), mode).tolist() == [0.0]
    with pytest.raises(ValueError, match="advantage mode"):
        group_advantages(r, "ppo")


def test_per_agent_rewards_get_their_own_baseline():
    out = member_advantages([{"a": 1.0, "b": 0.0}, {"a": 0.0, "b": 2.0}, {"a": 2.0}], "no_std")
    # agent a over three members (mean 1), agent b over the two that have it (mean 1)
    assert out == [{"a": 0.0, "b": -1.0}, {"a": -1.0, "b": 1.0}, {"a": 1.0}]
    assert member_advantages([1.0, 3.0], "rloo") == [{None: -2.0}, {None: 2.0}]


@pytest.mark.parametrize("rewards,expected", [
    ([0.0] * 8, True), ([1.0, 1.0, 1.0], True), ([0.7], True), ([0.0, 0.0, 1.0], False),
    ([{"a": 1.0, "b": 0.0}, {"a": 1.0, "b": 0.0}], True),   # each agent's rewards equal
    ([{"a": 1.0, "b": 0.0}, {"a": 1.0, "b": 1.0}], False),  # agent b differs
    ([{"a": 1.0, "b": 3.0}, {"a": 1.0}], True),             # b has one member: no baseline
    ([{"a": 1.0}, {"a": 2.0}, {"b": 5.0}], False)])
def test_no_signal_is_every_advantage_zero(rewards, expected):
    """`rollout/no_signal_frac` counts the groups whose advantages are all 0, in every estimator."""
    assert no_signal(rewards) is expected
    for mode in ("grpo", "rloo", "no_std"):
        zero = all(abs(a) < 1e-12 for m in member_advantages(rewards, mode) for a in m.values())
        assert zero is expected, mode


def test_ppo_loss_by_hand():
    lp = torch.log(torch.tensor([[1.0, 0.5, 0.2, 0.4]])).requires_grad_(True)
    behaviour = torch.log(torch.tensor([[1.0, 0.5, 0.1, 0.8]]))  # ratios 1, 1, 2, 0.5
    adv = torch.tensor([[9.0, 1.0, 1.0, -1.0]])  # the masked first token's value must not matter
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    w = torch.full((1, 4), 1 / 3)
    t = ppo_loss(lp, behaviour, adv, w, mask, clip_eps=0.2)
    # pg: -min(1*1, 1*1) = -1; -min(2*1, 1.2*1) = -1.2; -min(0.5*-1, 0.8*-1) = 0.8
    close(t.loss.item(), (-1 - 1.2 + 0.8) / 3)
    assert (t.tokens.item(), t.clipped.item()) == (3, 2)
    close(t.ratio_max.item(), 2.0, 1e-5)
    close(t.nll.item(), -math.log(0.5 * 0.2 * 0.4), 1e-5)  # the trained tokens' -logprob, the masked one left out
    t.loss.backward()
    # only the unclipped token carries gradient: d(-r A w)/d lp = -r A w = -1/3
    assert lp.grad.tolist()[0] == pytest.approx([0.0, -1 / 3, 0.0, 0.0], abs=1e-6)


def test_decoupled_ppo_loss_by_hand():
    lp = torch.log(torch.tensor([[1.0, 0.5, 0.2, 0.4]])).requires_grad_(True)
    behaviour = torch.log(torch.tensor([[1.0, 0.5, 0.1, 0.8]]))  # current/behaviour: 1, 1, 2, 0.5
    adv = torch.tensor([[9.0, 1.0, 1.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    w = torch.full((1, 4), 1 / 3)
    t = ppo_loss(lp, behaviour, adv, w, mask, clip_eps=0.2, decoupled=True, is_cap=1.5)
    # the ratio to the proximal (current) policy is 1: nothing is clipped; the staleness weights
    # min(1, 1.5), min(2, 1.5) = 1.5, min(0.5, 1.5) scale each token: -1*1, -1*1.5, +1*0.5
    close(t.loss.item(), (-1 - 1.5 + 0.5) / 3)
    assert (t.tokens.item(), t.clipped.item()) == (3, 0)
    close(t.ratio_max.item(), 2.0, 1e-5)  # current/behaviour, before the cap: the staleness it saw
    t.loss.backward()
    # d/d lp of -c r' A w with r' = exp(lp - lp.detach()) = 1: -c A w
    assert lp.grad.tolist()[0] == pytest.approx([0.0, -1 / 3, -1.5 / 3, 0.5 / 3], abs=1e-6)


def test_k3_kl_and_the_kl_term_by_hand():
    lp = torch.log(torch.tensor([[1.0, 0.5, 0.2, 0.4]])).requires_grad_(True)
    ref = torch.log(torch.tensor([[1.0, 0.25, 0.2, 0.4]]))  # ref - lp = log 0.5 on token 1
    kl = k3_kl(lp.detach(), ref)
    close(kl[0, 1].item(), 0.5 - math.log(0.5) - 1)  # 0.193147
    close(kl[0, 2].item(), 0.0)
    mask, w = torch.tensor([[0.0, 1.0, 1.0, 1.0]]), torch.full((1, 4), 1 / 3)
    zero = torch.zeros(1, 4)
    t = ppo_loss(lp, lp.detach(), zero, w, mask, 0.2, ref_logprobs=ref, kl_coef=0.1)
    close(t.kl.item(), (0.5 - math.log(0.5) - 1) / 3)
    close(t.loss.item(), 0.1 * (0.5 - math.log(0.5) - 1) / 3)
    t.loss.backward()
    # d kl / d lp = 1 - exp(ref - lp) = 0.5 on token 1, times w * kl_coef
    assert lp.grad.tolist()[0] == pytest.approx([0.0, 0.5 * 0.1 / 3, 0.0, 0.0], abs=1e-6)


def test_lr_schedule():
    cfg = TrainerConfig(lr=1.0, warmup_steps=2, steps=6, lr_schedule="linear")
    assert [lr_at(s, cfg) for s in range(7)] == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0])
    cos = TrainerConfig(lr=1.0, steps=4, lr_schedule="cosine")
    assert [lr_at(s, cos) for s in (0, 2, 4)] == pytest.approx([1.0, 0.5, 0.0])
    assert lr_at(99, TrainerConfig(lr=0.1)) == 0.1


def two_turns(version=0):
    # Two turns of one episode: 2 + 1 trained tokens.
    return [call([1, 2], [3, 4], version), call([1, 2, 3, 4, 9], [5], version)]


def test_loss_weights_token_mean_and_seq_mean():
    g = [traj("g", 0, size=2, reward=1.0, calls=two_turns(), mode="none"),
         traj("g", 1, size=2, reward=0.0, calls=[call([1, 2], [7])])]
    tok = build_step([g], advantage="no_std", loss_agg="token_mean", prefix_trees=False)
    assert (tok.n_tokens, tok.n_sequences) == (4, 2)
    # entries: member 0 has two samples (mode none), member 1 one
    assert tok.advantages.tolist() == [0.5, 0.5, -0.5] and tok.weights.tolist() == [0.25] * 3
    seq = build_step([g], advantage="no_std", loss_agg="seq_mean", prefix_trees=False)
    # 2 sequences: member 0's 3 tokens share 1/(2*3), member 1's token 1/(2*1)
    assert seq.weights.tolist() == pytest.approx([1 / 6, 1 / 6, 1 / 2])
    assert seq.rewards == [1.0, 0.0]
    # the per-token tables follow the packed rows' seq column
    rows = pack(seq.samples, 64, share_rows=False)
    total = sum(float((seq.token_values(r.seq)[1] * r.loss_mask).sum()) for r in rows)
    assert total == pytest.approx(1.0)


def test_dict_rewards_map_each_sample_to_its_agent():
    def member(i, ra, rb):
        a = Sample((1, 2), (-1, 0), (0, 1), (0.0, -0.5), (-1, 0), (-1, 0), MODEL, ("a",), (f"e{i}",), (ra,))
        b = Sample((3, 4), (-1, 0), (0, 1), (0.0, -0.5), (-1, 0), (-1, 0), MODEL, ("b",), (f"e{i}",), (rb,))
        return traj("g", i, size=2, reward={"a": ra, "b": rb}, samples=(a, b))

    step = build_step([[member(0, 1.0, 5.0), member(1, 0.0, 1.0)]], advantage="no_std", loss_agg="token_mean",
                      prefix_trees=False)
    assert step.advantages.tolist() == [0.5, 2.0, -0.5, -2.0]


def test_the_samples_with_a_gradient_keep_a_sequence_correction_s_whole_episodes():
    def member(i, ra, rb):
        a = Sample((1, 2), (-1, 0), (0, 1), (0.0, -0.5), (-1, 0), (-1, 0), MODEL, ("a",), (f"e{i}",), (ra,))
        b = Sample((3, 4), (-1, 0), (0, 1), (0.0, -0.5), (-1, 0), (-1, 0), MODEL, ("b",), (f"e{i}",), (rb,))
        return traj("g", i, size=2, reward={"a": ra, "b": rb}, samples=(a, b))

    # agent a scores alike in both episodes (advantage 0), agent b does not
    group = [member(0, 1.0, 5.0), member(1, 1.0, 1.0)]
    every = build_step([group], advantage="no_std", loss_agg="token_mean", prefix_trees=False)
    assert every.advantages.tolist() == [0.0, 2.0, 0.0, -2.0]
    only = build_step([group], advantage="no_std", loss_agg="token_mean", prefix_trees=False, gradient_only=True)
    assert [s.agents for s in only.samples] == [("b",), ("b",)] and only.advantages.tolist() == [2.0, -2.0]
    assert only.weights.tolist() == [0.25, 0.25] and (only.n_tokens, only.rewards) == (4, every.rewards)
    whole = build_step([group], advantage="no_std", loss_agg="token_mean", prefix_trees=False, gradient_only=True,
                       whole_episodes=True)
    assert whole.samples == every.samples and whole.advantages.tolist() == every.advantages.tolist()
    flat = build_step([[member(0, 1.0, 2.0), member(1, 1.0, 2.0)]], advantage="no_std", loss_agg="token_mean",
                      prefix_trees=False, gradient_only=True)
    assert flat.samples == every.samples[:1] and flat.advantages.tolist() == [0.0]  # for a zero gradient