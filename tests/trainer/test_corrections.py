"""The decoupled objective's behaviour-gap weights (`trainer.rollout_correction`) against hand-computed values.

Pure tensors first: each mode's loss, gradient and counts by hand; masks drop exactly the tokens or
sequences outside the band; on fresh data (current == behaviour) every mode is the plain policy
gradient; the default reproduces the weight the decoupled objective always had. Then through the
trainer's own step on a tiny Llama moved off its behaviour policy: a sequence-level weight is a function
of the episode, so merging turns (none / exact / tree), prefix trees and rows split by the token budget
(which take the step-wide episode pass) all give the same loss, gradients and counts.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from jet.config import TrainerConfig, load
from jet.errors import ConfigError
from jet.trainer.batch import build_step
from jet.trainer.guard import prepare
from jet.trainer.losses import CORRECTIONS, behaviour_weights, ppo_loss, sequence_log_ratio
from jet.trainer.packing import pack
from jet.trainer.step import Episodes, StepStats, accumulate, episode_index, spans_rows
from tests.timeline.test_model import BUDGET, Sampler, episodes, tiny_llama
from tests.timeline.test_share import groups as share_groups
from tests.trainer.test_step import as_trajectories

# One row: token 0 untrained, then two sequences of two trained tokens each.
# current/behaviour per trained token: 4, 1 (sequence 0: geometric mean 2), 0.25, 1 (sequence 1: 0.5)
CURRENT = [0.5, 0.4, 0.2, 0.05, 0.3]
BEHAVIOUR = [0.5, 0.1, 0.2, 0.2, 0.3]
ADV = [[9.0, 3.0, 2.0, -1.0, -3.0]]  # the untrained token's value must not matter
MASK = [[0.0, 1.0, 1.0, 1.0, 1.0]]
SEQ = [[-1, 0, 0, 1, 1]]
W = 0.25


def by_hand(correction: str, cap: float = 3.0, floor: float | None = None, **kw):
    lp = torch.log(torch.tensor([CURRENT])).requires_grad_(True)
    t = ppo_loss(lp, torch.log(torch.tensor([BEHAVIOUR])), torch.tensor(ADV), torch.full((1, 5), W),
                 torch.tensor(MASK), clip_eps=0.2, decoupled=True, is_cap=cap, correction=correction, is_floor=floor,
                 sequences=torch.tensor(SEQ), **kw)
    t.loss.backward()
    return t, lp.grad[0].tolist()


# (mode, cap, floor) -> the weights c of the four trained tokens, and (masked, truncated)
CASES = [
    (("none", 3.0, None), [1, 1, 1, 1], (0, 0)),
    (("token_truncate", 3.0, None), [3, 1, 0.25, 1], (0, 1)),  # min(rho, 3)
    (("token_mask", 3.0, None), [0, 1, 0, 1], (2, 0)),  # band [1/3, 3]: 4 and 0.25 fall out
    (("token_mask", 3.0, 0.0), [0, 1, 0.25, 1], (1, 0)),  # upper bound only (ms-swift's token_mask)
    (("sequence_truncate", 3.0, None), [2, 2, 0.5, 0.5], (0, 0)),  # min(geometric mean, 3)
    (("sequence_truncate", 1.5, None), [1.5, 1.5, 0.5, 0.5], (0, 2)),
    (("sequence_mask", 3.0, None), [4, 1, 0.25, 1], (0, 0)),  # both means in [1/3, 3]: rho kept
    (("sequence_mask", 3.0, 0.6), [4, 1, 0, 0], (2, 0)),  # sequence 1 (0.5) below the floor
    (("sequence_mask", 1.5, 0.0), [0, 0, 0.25, 1], (2, 0)),  # sequence 0 (2) above the cap
    (("sequence_mask", 1.5, None), [0, 0, 0, 0], (4, 0)),  # and sequence 1 (0.5) below 1 / 1.5
]


@pytest.mark.parametrize("case, weights, counts", CASES, ids=[f"{m}-{c}-{f}" for (m, c, f), _, _ in CASES])
def test_each_mode_by_hand(case, weights, counts):
    t, grad = by_hand(*case)
    adv = ADV[0][1:]
    # r' = exp(lp - lp.detach()) = 1, nothing clipped: pg_t = -c_t A_t, loss = sum_t w pg_t
    assert t.loss.item() == pytest.approx(-W * sum(c * a for c, a in zip(weights, adv)), abs=1e-5)
    assert (t.tokens.item(), t.clipped.item()) == (4, 0)
    assert (t.masked.item(), t.truncated.item()) == counts
    assert t.ratio_max.item() == pytest.approx(4.0, abs=1e-5)  # the gap it saw, before any weight
    # d loss / d lp_t = -w c_t A_t; a masked token gets exactly none
    assert grad == pytest.approx([0.0] + [-W * c * a for c, a in zip(weights, adv)], abs=1e-6)
    assert [g == 0.0 for g in grad[1:]] == [c == 0 for c in weights]


def test_the_default_reproduces_the_decoupled_weight_bit_for_bit():
    lp = torch.randn(3, 7, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    behaviour = lp.detach() + 0.7 * torch.randn(3, 7, generator=torch.Generator().manual_seed(2))
    adv, w = torch.randn(3, 7), torch.rand(3, 7)
    mask = (torch.rand(3, 7, generator=torch.Generator().manual_seed(3)) > 0.3).float()
    new = ppo_loss(lp, behaviour, adv, w, mask, 0.2, decoupled=True, is_cap=1.7)
    assert TrainerConfig().rollout_correction == "token_truncate"
    # the decoupled loss before rollout_correction existed, op for op: sum_t w_t (pg_t * min(rho_t, cap))
    trained = mask > 0
    ratio = torch.exp((lp - lp.detach()).masked_fill(~trained, 0.0))
    a = adv.masked_fill(~trained, 0.0)
    pg = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
    weight = torch.exp((lp.detach() - behaviour).masked_fill(~trained, 0.0)).clamp(max=1.7).masked_fill(~trained, 0.0)
    old = (w.masked_fill(~trained, 0.0) * (pg * weight)).sum()
    assert torch.equal(new.loss, old)
    (g_new,) = torch.autograd.grad(new.loss, lp)
    (g_old,) = torch.autograd.grad(old, lp)
    assert torch.equal(g_new, g_old)
    assert new.truncated.item() == int(((lp.detach() - behaviour).exp() > 1.7)[trained].sum()) > 0


def test_masks_drop_exactly_the_tokens_and_sequences_outside_the_band():
    gen = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, 9, (4, 50), generator=gen)
    # each sequence's log ratios around its own offset (-1.2 to 1.2), so its mean may leave the band
    log_ratio = torch.randn(4, 50, generator=gen) + torch.linspace(-1.2, 1.2, 9)[sequences]
    trained = torch.rand(4, 50, generator=gen) > 0.2
    cap, floor = 2.0, 0.7
    rho = log_ratio.exp()
    c, masked, truncated = behaviour_weights(log_ratio, trained, "token_mask", cap, floor)
    outside = (rho < floor) | (rho > cap)
    assert torch.equal(masked, outside & trained) and not truncated.any()
    assert torch.equal(c == 0, ~trained | outside)
    assert torch.equal(c[trained & ~outside], rho[trained & ~outside])  # kept tokens keep their own ratio
    seq = sequence_log_ratio(log_ratio, trained, sequences)
    geo = {int(s): math.exp(float(log_ratio[trained & (sequences == s)].double().mean()))
           for s in sequences[trained].unique()}
    dropped = {s for s, g in geo.items() if not floor <= g <= cap}
    assert dropped and len(dropped) < len(geo)  # the band splits the sequences
    c, masked, _ = behaviour_weights(log_ratio, trained, "sequence_mask", cap, floor, seq)
    in_dropped = torch.tensor([[int(s) in dropped for s in row] for row in sequences.tolist()])
    assert torch.equal(masked, trained & in_dropped)
    assert torch.equal(c == 0, ~trained | in_dropped)
    c, _, truncated = behaviour_weights(log_ratio, trained, "sequence_truncate", cap, floor, seq)
    for s, g in geo.items():
        on = trained & (sequences == s)
        assert c[on].tolist() == pytest.approx([min(g, cap)] * int(on.sum()), rel=1e-5)
        assert bool(truncated[on].all()) == (g > cap)


def test_a_sequence_statistic_does_not_depend_on_the_layout():
    gen = torch.Generator().manual_seed(4)
    log_ratio, sequences = torch.randn(1, 40, generator=gen), torch.randint(0, 5, (1, 40), generator=gen)
    trained = torch.ones(1, 40, dtype=torch.bool)
    packed = sequence_log_ratio(log_ratio, trained, sequences)
    order = torch.randperm(40, generator=gen)
    as_two_rows = sequence_log_ratio(log_ratio[:, order].view(2, 20), trained.view(2, 20),
                                     sequences[:, order].view(2, 20))
    assert torch.equal(as_two_rows.view(1, 40), packed[:, order])


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_on_fresh_data_every_mode_is_the_plain_policy_gradient(correction):
    gen = torch.Generator().manual_seed(5)
    lp = torch.randn(2, 9, generator=gen).requires_grad_(True)
    adv, w = torch.randn(2, 9, generator=gen), torch.rand(2, 9, generator=gen)
    mask = (torch.rand(2, 9, generator=gen) > 0.3).float()
    seqs = torch.tensor([[0] * 4 + [1] * 5, [2] * 9])
    t = ppo_loss(lp, lp.detach(), adv, w, mask, 0.2, decoupled=True, correction=correction, sequences=seqs)
    (grad,) = torch.autograd.grad(t.loss, lp)
    # -sum_t w_t A_t logprob_t: its gradient is -w A on trained tokens
    torch.testing.assert_close(grad, -(w * adv) * mask, rtol=0, atol=1e-7)
    assert t.loss.item() == pytest.approx(-float((w * adv * mask).sum()), abs=1e-6)
    assert (t.masked.item(), t.truncated.item(), t.clipped.item()) == (0, 0, 0)
    ppo = ppo_loss(lp, lp.detach(), adv, w, mask, 0.2)
    assert torch.equal(ppo.loss, t.loss)


def test_objective_ppo_takes_no_weight():
    lp = torch.log(torch.tensor([CURRENT]))
    args = (torch.log(torch.tensor([BEHAVIOUR])), torch.tensor(ADV), torch.full((1, 5), W), torch.tensor(MASK), 0.2)
    plain = ppo_loss(lp, *args)
    for correction in CORRECTIONS:
        t = ppo_loss(lp, *args, correction=correction, sequences=torch.tensor(SEQ))
        assert torch.equal(t.loss, plain.loss) and (t.masked.item(), t.truncated.item()) == (0, 0)


def test_config_checks_name_the_key():
    def error(trainer: dict) -> str:
        with pytest.raises(ConfigError) as e:
            load({"trainer": trainer})
        return str(e.value)

    assert load({"trainer": {"rollout_correction": "sequence_mask", "is_floor": 0.5}}).trainer.is_floor == 0.5
    assert load({"trainer": {"objective": "ppo", "rollout_correction": "none"}}).trainer.objective == "ppo"
    assert error({"rollout_correction": "tis"}).startswith(
        "trainer.rollout_correction: expected one of 'token_truncate', 'token_mask', 'sequence_truncate', "
        "'sequence_mask', 'none', got 'tis'")
    assert error({"is_cap": 0.9}) == "trainer.is_cap: must be >= 1, got 0.9"
    assert error({"is_floor": 1.5}) == "trainer.is_floor: must be <= 1, got 1.5"
    assert error({"is_floor": -0.1}) == "trainer.is_floor: must be >= 0, got -0.1"
    assert error({"objective": "ppo", "rollout_correction": "token_mask"}).startswith(
        "trainer.rollout_correction: 'token_mask' weights the decoupled objective's behaviour gap; objective 'ppo'")
    assert error({"rollout_correction": "sequence_truncate", "backend": "deepspeed", "nproc": 2}).startswith(
        "trainer.rollout_correction: 'sequence_truncate' needs each token's episode on every rank")
    with pytest.raises(ValueError, match="rollout correction must be one of"):
        behaviour_weights(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), "tis", 2.0)


# ---- through the trainer's step on a real (tiny) transformer


def moved_off(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    """The model after a few imaginary versions: every weight moved, so current/behaviour != 1."""
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * scale)
    return moved


def run_step(model, inputs, rows, cfg: TrainerConfig) -> tuple[StepStats, dict, bool]:
    model.zero_grad()
    spans = spans_rows(Episodes(episode_index(inputs)), rows)  # the step takes the episode pass
    stats = accumulate(model, rows, inputs, cfg, lambda loss, _last: loss.backward())
    return stats, {n: p.grad.detach().clone() for n, p in model.named_parameters()}, spans


def assert_same(a: tuple[StepStats, dict, bool], b: tuple[StepStats, dict, bool], what: str) -> None:
    (sa, ga, _), (sb, gb, _) = a, b
    assert (sb.tokens, sb.masked, sb.truncated) == (sa.tokens, sa.masked, sa.truncated), what
    assert sb.loss == pytest.approx(sa.loss, rel=1e-5, abs=1e-6), what
    for name, g in gb.items():
        torch.testing.assert_close(g, ga[name], atol=1e-6, rtol=1e-4, msg=f"{what}: {name}")


def test_sequence_weights_are_per_episode_however_its_samples_are_merged_or_packed():
    sampler_model = tiny_llama("sdpa")
    eps = episodes(Sampler(sampler_model))
    model = moved_off(sampler_model, 0.05)
    # cap 1, floor 0: the episodes whose geometric-mean ratio is above 1 are masked, the others kept
    cfg = TrainerConfig(clip_eps=0.1, rollout_correction="sequence_mask", is_floor=0.0, is_cap=1.0)
    results = {}
    for mode in ("none", "exact", "tree"):  # "none": the loop episode is one sample per turn, in several rows
        inputs = build_step(as_trajectories(eps, mode), advantage="grpo", loss_agg="seq_mean", prefix_trees=False)
        results[mode] = run_step(model, inputs, pack(inputs.samples, BUDGET), cfg)
    trees = build_step(as_trajectories(eps, "exact"), advantage="grpo", loss_agg="seq_mean", prefix_trees=True)
    results["exact, prefix trees"] = run_step(model, trees, pack(trees.samples, BUDGET), cfg)
    base = results["none"]
    assert 0 < base[0].masked < base[0].tokens, "the band should split the episodes"
    assert abs(base[0].pg) > 1e-4
    for name, result in results.items():
        assert_same(base, result, name)
    assert {spans for _, _, spans in results.values()} == {True, False}, "both the per-row and the step-wide paths"


def test_sequence_weights_with_group_prefix_trees_split_over_micro_batches():
    sampler_model = tiny_llama("sdpa")
    batch = share_groups(Sampler(sampler_model))
    model = moved_off(sampler_model, 0.05)
    out = {}
    for trees in (False, True):
        cfg = TrainerConfig.of(micro_batch_tokens=96, prefix_trees=trees, rollout_correction="sequence_truncate",
                               is_cap=1.0)
        inputs, rows = prepare(batch, cfg, every_sample=True)  # the same tokens in both layouts
        out[trees] = run_step(model, inputs, rows, cfg)
    assert out[True][2], "an episode's tokens should span micro-batches of the split trees"
    assert 0 < out[False][0].truncated < out[False][0].tokens  # cut to 1: the episodes above 1
    assert_same(out[False], out[True], "prefix trees")
