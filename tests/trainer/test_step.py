"""A real optimiser step on a tiny model: every parameter moves; merged samples train like unmerged ones;
a checkpoint round-trips the model, the optimiser and the RNG."""

from __future__ import annotations

import copy

import pytest
import torch

from jet.config import TrainerConfig
from jet.timeline import merge_calls
from jet.trainer.backend_torch import TorchBackend
from jet.trainer.batch import build_step
from jet.trainer.guard import prepare
from jet.trainer.packing import pack
from jet.trainer.step import accumulate
from jet.wire import Trajectory
from tests.timeline.test_model import BUDGET, Sampler, episodes, tiny_llama
from tests.trainer.helpers import call, traj


def small_batch():
    calls_a = [call([1, 2, 3], [10, 11, 12]), call([1, 2, 3, 10, 11, 12, 7], [13, 14])]
    return [[traj("g", 0, size=2, reward=1.0, calls=calls_a), traj("g", 1, size=2, reward=0.0,
                                                                    calls=[call([1, 2, 3], [20, 21])])]]


def test_one_step_changes_every_trainable_parameter(tiny_model):
    cfg = TrainerConfig(lr=1e-3, kl_coef=0.1, grad_clip=1.0)
    b = TorchBackend(str(tiny_model), cfg)
    before = {n: p.detach().clone() for n, p in b.model.named_parameters()}
    inputs = build_step(small_batch(), advantage="grpo", loss_agg="token_mean", prefix_trees=False)
    stats = b.train_step(pack(inputs.samples, 64), inputs, lr=cfg.lr)
    assert stats.tokens == 7 and stats.rows >= 1 and stats.grad_norm > 0
    unchanged = [n for n, p in b.model.named_parameters() if p.requires_grad and torch.equal(p, before[n])]
    assert unchanged == [], f"parameters not updated: {unchanged}"
    assert all(not p.requires_grad for p in b.ref.parameters())
    assert all(torch.equal(p, before[n]) for n, p in b.ref.named_parameters())


def test_a_bfloat16_step_on_cpu_changes_every_parameter_and_publishes_bfloat16_weights(tiny_model, tmp_path):
    from safetensors.torch import load_file

    from jet.trainer.weights import write_weights
    from jet.workers.inference.hf import HFBackend

    cfg = TrainerConfig(lr=1e-3, dtype="bfloat16", device="cpu")
    b = TorchBackend(str(tiny_model), cfg)
    before = {n: p.detach().clone() for n, p in b.model.named_parameters()}
    inputs = build_step(small_batch(), advantage="grpo", loss_agg="token_mean", prefix_trees=False)
    stats = b.train_step(pack(inputs.samples, 64), inputs, lr=cfg.lr)
    assert stats.tokens == 7 and stats.grad_norm > 0 and torch.isfinite(torch.tensor(stats.loss))
    unchanged = [n for n, p in b.model.named_parameters() if p.requires_grad and torch.equal(p, before[n])]
    assert unchanged == [], f"parameters not updated: {unchanged}"
    assert {p.dtype for p in b.model.parameters()} == {torch.float32}, "master weights stay float32"

    sha = write_weights(b.model, tmp_path / "v1", cfg.dtype)
    full = write_weights(b.model, tmp_path / "f32", "float32")
    published = load_file(tmp_path / "v1" / "model.safetensors")
    assert {t.dtype for t in published.values()} == {torch.bfloat16}, "published weights follow trainer.dtype"
    size = {v: (tmp_path / v / "model.safetensors").stat().st_size for v in ("v1", "f32")}
    assert size["v1"] < 0.6 * size["f32"]
    assert sha != full
    worker = HFBackend(tiny_model)  # a float32 inference worker loads them, cast to its dtype
    worker.load_weights(tmp_path / "v1", sha, 1)
    live = dict(b.model.named_parameters())
    for name, t in worker.model.state_dict().items():
        if name in live:
            assert torch.equal(t, live[name].detach().to(torch.bfloat16).float()), name


@pytest.mark.parametrize("correction", ["token_truncate", "sequence_truncate"])
@pytest.mark.parametrize("prefix_trees", [False, True])
def test_samples_without_a_gradient_are_not_forwarded_and_the_steps_are_the_same(tiny_model, prefix_trees,
                                                                                 correction):
    """A group whose rewards are all equal has advantage 0 on every token: the trainer's rows leave it out
    (without KL), and the step is the one that forwarding everything gives; a step with no signal at all
    still backpropagates (one sample) so AdamW's moments move the weights as before."""
    # the two groups share a prompt prefix (a chat template's), so with trees every sample is in ONE tree
    signal = [traj("s", 0, size=2, reward=1.0, calls=[call([1, 2, 3, 7], [10, 11, 12])]),
              traj("s", 1, size=2, reward=0.0, calls=[call([1, 2, 3, 7], [20, 21])])]
    none = [traj("n", 0, size=2, reward=0.0, calls=[call([1, 2, 3, 8], [30, 31, 32])]),
            traj("n", 1, size=2, reward=0.0, calls=[call([1, 2, 3, 8], [40, 41])])]
    cfg = TrainerConfig(lr=1e-2, prefix_trees=prefix_trees, rollout_correction=correction)
    fast, full = TorchBackend(str(tiny_model), cfg), TorchBackend(str(tiny_model), cfg)
    start = {n: p.detach().clone() for n, p in fast.model.named_parameters()}
    for batch in ([signal, none], [none]):
        inputs, rows = prepare(batch, cfg)
        all_inputs, every = prepare(batch, cfg, every_sample=True)
        assert (inputs.n_tokens, inputs.rewards) == (all_inputs.n_tokens, all_inputs.rewards)
        forwarded = tuple(sum(r.n_real for r in rs) for rs in (rows, every))
        # tokens forwarded, (trainer's rows, every sample): a group is 7 + 6 tokens, or 9 as a tree, and 15
        # for both groups' tree; with no signal at all the rows hold one sample (7 tokens)
        assert forwarded == {(2, False): (13, 26), (2, True): (9, 15), (1, False): (7, 13),
                             (1, True): (7, 9)}[len(batch), prefix_trees]
        a, b = fast.train_step(rows, inputs, lr=cfg.lr), full.train_step(every, all_inputs, lr=cfg.lr)
        assert a.loss == pytest.approx(b.loss, abs=1e-7) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
        assert (a.grad_norm > 0) == (len(batch) == 2)
        for (n, p), q in zip(fast.model.named_parameters(), full.model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-8, msg=n)
            torch.testing.assert_close(p, q, rtol=0, atol=1e-3 * cfg.lr, msg=n)  # AdamW scales rounding up to ~lr
    moved = [n for n, p in fast.model.named_parameters() if not torch.equal(p, start[n])]
    assert len(moved) == len(start)
    with_kl = TrainerConfig(kl_coef=0.1, prefix_trees=prefix_trees)  # KL has a gradient at any advantage
    assert sum(r.n_real for r in prepare([signal, none], with_kl)[1]) == sum(
        r.n_real for r in prepare([signal, none], with_kl, every_sample=True)[1])


def test_a_checkpoint_round_trips_model_optimiser_and_rng(tiny_model, tmp_path):
    cfg = TrainerConfig(lr=1e-3)
    inputs = build_step(small_batch(), advantage="grpo", loss_agg="token_mean", prefix_trees=False)
    rows = pack(inputs.samples, 64)
    a = TorchBackend(str(tiny_model), cfg)
    a.train_step(rows, inputs, lr=1e-3)
    a.save(tmp_path)
    expected_rand = torch.rand(3)
    after_a = a.train_step(rows, inputs, lr=1e-3)
    b = TorchBackend(str(tiny_model), cfg)
    b.load(tmp_path)
    assert torch.equal(torch.rand(3), expected_rand)
    after_b = b.train_step(rows, inputs, lr=1e-3)
    assert after_b.loss == after_a.loss
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n


def test_the_fused_adamw_gives_the_per_tensor_update_and_a_checkpoint_of_either_loads_into_it(tiny_model, tmp_path):
    """The trainer's AdamW is fused on a CPU; three steps give the weights torch's per-tensor AdamW gives,
    and a checkpoint the per-tensor one wrote resumes into the fused one, which stays fused."""
    from jet.trainer import optim

    cfg = TrainerConfig(lr=1e-3, weight_decay=0.1)
    inputs = build_step(small_batch(), advantage="grpo", loss_agg="token_mean", prefix_trees=False)
    rows = pack(inputs.samples, 64)
    fused, plain = TorchBackend(str(tiny_model), cfg), TorchBackend(str(tiny_model), cfg)
    assert fused.optimizer.param_groups[0]["fused"] is True
    plain.optimizer = optim.make_adamw(plain.params, cfg, fused=False)
    assert not plain.optimizer.param_groups[0]["fused"]

    def same(a, b):
        moved = 0
        for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-3 * cfg.lr, msg=n)  # rounding, scaled up to ~lr
            moved += not torch.equal(p, start[n])
        assert moved == len(start)

    start = {n: p.detach().clone() for n, p in fused.model.named_parameters()}
    for _ in range(3):
        fused.train_step(rows, inputs, lr=cfg.lr), plain.train_step(rows, inputs, lr=cfg.lr)
    same(fused, plain)
    plain.save(tmp_path)
    resumed = TorchBackend(str(tiny_model), cfg)
    resumed.load(tmp_path)
    assert resumed.optimizer.param_groups[0]["fused"] is True
    assert set(optim.KERNEL) <= set(resumed.optimizer.param_groups[0])
    resumed.train_step(rows, inputs, lr=cfg.lr), plain.train_step(rows, inputs, lr=cfg.lr)
    same(resumed, plain)


def as_trajectories(eps, mode: str) -> list[list[Trajectory]]:
    """Episodes 0-1 and 2-4 as two GRPO groups; each episode merged on its own, as env workers do."""
    out = []
    for group, members in (("a", eps[:2]), ("b", eps[2:])):
        out.append([Trajectory(task="t", group_id=group, index=i, episode_id=e.episode_id, model="tiny",
                               reward=e.reward, samples=tuple(merge_calls(e.calls, mode, episode_id=e.episode_id,
                                                                          reward=e.reward)),
                               group_size=len(members)) for i, e in enumerate(members)])
    return out


@pytest.mark.parametrize("objective", ["ppo", "decoupled"])
@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean"])
def test_merged_and_unmerged_samples_give_the_same_loss_and_gradients(loss_agg, objective):
    model = tiny_llama("sdpa")
    eps = episodes(Sampler(model))
    ref = copy.deepcopy(model)
    with torch.no_grad():  # move the policy off the behaviour policy: ratios != 1, some clipped, KL > 0
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    cfg = TrainerConfig(clip_eps=0.1, kl_coef=0.5, objective=objective)
    results = {}
    for mode in ("none", "exact", "tree"):
        model.zero_grad()
        inputs = build_step(as_trajectories(eps, mode), advantage="grpo", loss_agg=loss_agg, prefix_trees=False)
        rows = pack(inputs.samples, BUDGET)
        stats = accumulate(model, rows, inputs, cfg, lambda loss, _last: loss.backward(), ref_model=ref)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        results[mode] = (stats, grads, sum(r.n_tokens for r in rows))
    ref_stats, ref_grads, ref_tokens = results["none"]
    assert ref_stats.kl > 0 and abs(ref_stats.pg) > 1e-4
    # ppo clips against the behaviour policy; decoupled against the current weights, never in a step's one pass
    assert (ref_stats.clipped > 0) == (objective == "ppo") and ref_stats.ratio_max > 1.1
    assert results["tree"][2] < results["exact"][2] < ref_tokens
    for mode in ("exact", "tree"):
        stats, grads, _ = results[mode]
        assert (stats.tokens, stats.clipped) == (ref_stats.tokens, ref_stats.clipped)
        assert stats.loss == pytest.approx(ref_stats.loss, rel=1e-5, abs=1e-6)
        assert stats.kl == pytest.approx(ref_stats.kl, rel=1e-5, abs=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-6, rtol=1e-4, msg=f"{mode}: {name}")
