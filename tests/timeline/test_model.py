"""Merged timelines train exactly like unmerged calls, on a real (tiny) transformer.

Episodes are sampled from a randomly initialised Llama, token-in-token-out,
recording each token's behaviour logprob; the calls cycle through sampling
settings (temperature 0.6 / 1.0 / 1.4, top_p 1.0 / 0.9, and one greedy call),
so the sampling columns travel through every merge mode and the packing. They cover a multi-turn tool loop, a
completion cut by max_tokens and then re-rendered differently, parallel
sub-agents branching from one context, a second agent on the same model and a
GRPO group sharing its task prompt. For `none`, `exact` and `tree` samples we
pack rows (small enough that trees are split), run the model and check:
per-token logprobs equal the `none` ones and the sampler's (float32, atol
1e-5); the policy-gradient loss and every parameter's gradient equal the
`none` ones (atol 1e-6, rtol 1e-4).
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from jet import sampling
from jet.timeline import Call, Episode, merge_episodes
from jet.trainer.losses import ppo_loss, token_logprobs
from jet.trainer.packing import Row, pack, row_logprobs

VOCAB, EOS, BUDGET = 96, 95, 80
SETTINGS = [(0.6, 1.0), (1.0, 0.9), (1.4, 1.0), (0.6, 0.9), (1.0, 1.0), (1.4, 0.9)]  # (temperature, top_p)


def tiny_llama(attn: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config).float().eval()


class Sampler:
    """Samples completions from the model, full recompute per step (no KV cache)."""

    def __init__(self, model: torch.nn.Module, seed: int = 0):
        self.model = model
        self.gen = torch.Generator().manual_seed(seed)
        self.n = 0  # calls so far: call n samples at SETTINGS[n % 6]

    def tokens(self, n: int) -> list[int]:
        return torch.randint(0, EOS, (n,), generator=self.gen).tolist()

    @torch.no_grad()
    def call(self, prompt: list[int], max_tokens: int, agent: str = "main", version: int = 0,
             greedy: bool = False) -> Call:
        temperature, top_p = (0.0, 1.0) if greedy else SETTINGS[self.n % len(SETTINGS)]
        self.n += not greedy
        t, p = torch.tensor([temperature or 1.0]), torch.tensor([top_p])
        ids, lps = list(prompt), []
        for _ in range(max_tokens):
            logp = sampling.tempered_logprobs(self.model(input_ids=torch.tensor([ids])).logits[:, -1], t)
            keep = sampling.nucleus_mask(logp, p)
            probs = logp.exp().masked_fill(~keep, 0.0)[0]
            tok = int(probs.argmax()) if greedy else int(torch.multinomial(probs, 1, generator=self.gen))
            ids.append(tok)
            lps.append(float(sampling.renormalised(logp, torch.tensor([tok]), p < 1, keep)[0]))
            if tok == EOS:
                break
        finish = "stop" if ids[-1] == EOS else "length"
        return Call(prompt, ids[len(prompt) :], lps, version, "tiny", agent, finish, temperature, top_p)


def episodes(s: Sampler) -> list[Episode]:
    system = s.tokens(12)
    # A tool loop; the second completion is cut by max_tokens and the client appends EOS.
    loop = [s.call(system + s.tokens(5), 6)]
    loop.append(s.call(list(loop[-1].ids) + s.tokens(4), 3, version=1))
    loop.append(s.call(list(loop[-1].ids) + [EOS] + s.tokens(6), 6, version=1))
    # Truncated, then re-rendered differently: its last token becomes two others.
    cut = s.call(list(loop[-1].ids) + s.tokens(3), 4, version=2)
    rerendered = list(cut.ids[:-1]) + s.tokens(2) + [EOS] + s.tokens(3)
    loop += [cut, s.call(rerendered, 5, version=2)]
    # Two parallel sub-agents branching from the same context, and a second agent.
    base = list(loop[-1].ids)
    loop += [s.call(base + s.tokens(3), 5, agent="sub"), s.call(base + s.tokens(3), 5, agent="sub")]
    critic = [s.call(s.tokens(7) + list(loop[0].completion_ids), 5, agent="critic")]
    critic.append(s.call(list(critic[0].ids) + s.tokens(3), 4, agent="critic", greedy=True))  # context only
    critic.append(s.call(list(critic[1].ids) + s.tokens(3), 5, agent="critic"))
    # A GRPO group sharing a task prompt.
    task = system + s.tokens(10)
    group = [Episode((s.call(task, 6, version=3),), f"g{i}", float(i) - 1.0) for i in range(3)]
    return [Episode(tuple(loop), "loop", 1.0), Episode(tuple(critic), "critic", -0.5), *group]


def context_keys(row: Row, b: int = 0) -> list[tuple]:
    """(context token ids, token id) of every token of batch row `b`."""
    ids, parents = row.input_ids[b].tolist(), row.parent_index[b].tolist()
    keys = []
    for j in range(len(ids)):
        path, p = [], parents[j]
        while p >= 0:
            path.append(ids[p])
            p = parents[p]
        keys.append((tuple(reversed(path)), ids[j]))
    return keys


def run(model: torch.nn.Module, rows: list[Row], n_trained: int) -> tuple[dict, float, dict]:
    """Per-context logprobs, the loss and the gradients, from one forward/backward over rows of any layout
    ([B, L] padded batches as well as packed rows)."""
    model.zero_grad()
    logprobs: dict[tuple, list[float]] = defaultdict(list)
    total = 0.0
    for row in rows:
        lp = row_logprobs(model, row)
        loss = ppo_loss(lp, row.behaviour_logprobs, row.rewards, row.loss_mask / n_trained, row.loss_mask,
                        clip_eps=0.2).loss
        loss.backward()
        total += loss.item()
        for b in range(row.input_ids.shape[0]):
            values, behaviour = lp.detach()[b].tolist(), row.behaviour_logprobs[b].tolist()
            for j, key in enumerate(context_keys(row, b)):
                if row.loss_mask[b, j] > 0:
                    logprobs[key].append(values[j])
                    assert values[j] == pytest.approx(behaviour[j], abs=1e-5)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return {k: sorted(v) for k, v in logprobs.items()}, total, grads


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_exact_and_tree_train_like_none(attn):
    model = tiny_llama(attn)
    eps = episodes(Sampler(model))
    n_trained = sum(len(c.completion_ids) for e in eps for c in e.calls if c.temperature > 0)
    results, sizes = {}, {}
    for mode in ("none", "exact", "tree"):
        samples = merge_episodes(eps, mode)
        seen = {(t, p) for s in samples for t, p, m in zip(s.temperatures, s.top_ps, s.mask) if m}
        assert len(seen) == len(SETTINGS), "every sampling setting is trained, the greedy call is not"
        rows = pack(samples, BUDGET)
        sizes[mode] = (len(samples), max(map(len, samples)), sum(r.n_tokens for r in rows))
        results[mode] = run(model, rows, n_trained)
    assert sizes["tree"][1] > BUDGET, "the tree was not large enough to be split"
    assert sizes["tree"][2] < sizes["exact"][2] < sizes["none"][2]
    ref_lp, ref_loss, ref_grads = results["none"]
    assert sum(map(len, ref_lp.values())) == n_trained
    for mode in ("exact", "tree"):
        lp, loss, grads = results[mode]
        assert lp.keys() == ref_lp.keys()
        for key, values in lp.items():
            assert values == pytest.approx(ref_lp[key], abs=1e-5)
        assert loss == pytest.approx(ref_loss, abs=1e-6)
        assert any(g.abs().max() > 1e-4 for g in ref_grads.values())
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-6, rtol=1e-4, msg=f"{mode}: {name}")


@pytest.mark.parametrize("mode", ["none", "exact"])
def test_padded_batches_of_linear_samples_train_like_packed_rows(mode):
    """The trainer's layout (`batch_linear`: linear samples right-padded into [B, L] batches, causal
    attention, no mask) gives the packed rows' logprobs, loss and gradients."""
    model = tiny_llama("sdpa")
    eps = episodes(Sampler(model))
    samples = merge_episodes(eps, mode)
    assert all(s.is_linear for s in samples)
    n_trained = sum(s.n_trained for s in samples)
    packed = pack(samples, BUDGET)
    batched = pack(samples, BUDGET, batch_linear=True)
    assert all(r.causal for r in batched) and any(r.input_ids.shape[0] > 1 for r in batched)
    assert all(r.n_tokens <= BUDGET for r in batched)
    assert sum(r.n_samples for r in batched) == sum(r.n_samples for r in packed) == len(samples)
    lp_a, loss_a, grads_a = run(model, packed, n_trained)
    lp_b, loss_b, grads_b = run(model, batched, n_trained)
    assert sum(map(len, lp_b.values())) == n_trained and lp_b.keys() == lp_a.keys()
    for key, values in lp_b.items():
        assert values == pytest.approx(lp_a[key], abs=1e-5)
    assert loss_b == pytest.approx(loss_a, abs=1e-6)
    for name, g in grads_b.items():
        torch.testing.assert_close(g, grads_a[name], atol=1e-6, rtol=1e-4, msg=name)


def test_row_logprobs_reads_only_the_logits_it_needs():
    """`logits_to_keep`: the output head runs on the parents of trained tokens only, and the logprobs are
    those of a full forward."""
    model = tiny_llama("sdpa")
    samples = merge_episodes(episodes(Sampler(model)), "tree")
    kept = []
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, args, out: kept.append(args[0].shape[1]))
    try:
        for row in pack(samples, BUDGET):
            trained = row.loss_mask > 0
            with torch.no_grad():
                lp = row_logprobs(model, row)
                full = model(input_ids=row.input_ids, position_ids=row.position_ids,
                             attention_mask=None if row.causal else row.attention_mask()).logits.float()
            reference = token_logprobs(full, row.input_ids, row.parent_index, row.sampling())
            assert torch.allclose(lp[trained], reference[trained], atol=1e-5)
            assert bool((lp[~trained] == 0).all())
            n_parents = len(set(row.parent_index[trained].tolist()))
            assert kept[-2] == n_parents < row.n_tokens  # kept[-1]: the full forward above
    finally:
        handle.remove()
