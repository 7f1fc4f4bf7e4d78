"""Per-token RL math as pure tensor functions: logprobs, the clipped PPO objective, KL.

What it is: functions of tensors only (no model, no I/O), so tests check them
against hand-computed numbers and the timeline equivalence test checks that
merged and unmerged samples give the same values.

- `token_logprobs`: each token's logprob under the model, read at its parent,
  under the token's own sampling transformation (temperature, top-p nucleus
  renormalised: `jet.sampling`), so it is the quantity inference reported;
- `ppo_loss`: the trainer's objective. Per trained token t, with the
  importance ratio r = exp(logprob - behaviour logprob) against the policy
  that generated it (the inference worker's logprob) and advantage A:
      pg_t = -min(r A, clip(r, 1 - eps, 1 + eps) A)        (PPO, Schulman 2017)
      kl_t = exp(ref - logprob) - (ref - logprob) - 1      (k3, Schulman 2020)
  and loss = sum_t w_t (pg_t + kl_coef * kl_t). With `decoupled=True` (for stale
  samples; Fu et al. 2025, "AReaL", decoupled PPO) the ratio is taken against the
  proximal policy, i.e. the current weights before this step (the trainer takes
  one optimiser step per batch, so that is `logprob` detached), and staleness is
  corrected by the truncated importance weight c = min(exp(prox - behaviour), cap):
      pg_t = -c * min(r' A, clip(r', 1 - eps, 1 + eps) A),  r' = exp(logprob - prox) The per-token weight w_t
  carries the aggregation (`jet.trainer.batch`): 1 / (trained tokens of the
  step) for token_mean, 1 / (sequences * that sequence's tokens) for seq_mean.

What it is not: a packer (`jet.trainer.packing`) or an optimiser loop.

Invariants:
- a token's logprob is read from the logits at its *parent's* position, which
  is i - 1 in a linear sequence and the tree parent in a prefix tree; tokens
  with no parent (roots, padding) get 0;
- the loss is a sum over trained tokens of per-token terms times caller-given
  weights, so splitting or merging samples, or cutting a step into
  micro-batches (summing their losses), does not change it (a per-row mean
  would).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, parent_index: torch.Tensor,
                   temperature: torch.Tensor | None = None, top_p: torch.Tensor | None = None) -> torch.Tensor:
    """log q(input_ids[b, j] | its context), read from logits[b, parent_index[b, j]].

    logits [B, L, V] (use float32), input_ids and parent_index [B, L] (int64,
    parent -1 for tokens nothing predicts); `temperature` and `top_p` [B, L]
    (float32, default 1) are each token's sampling settings: q is
    softmax(logits / T) renormalised over the top-p nucleus (`jet.sampling`).
    Returns [B, L]; 0 where parent < 0. Tokens at T = 1, top_p = 1 take the
    plain log_softmax path; only the others pay for gathering their rows.
    """
    from jet import sampling

    src = parent_index.clamp(min=0)
    rows = torch.arange(logits.shape[0], device=logits.device)[:, None]
    picked = logits[rows, src, input_ids] - torch.logsumexp(logits, dim=-1)[rows, src]
    if temperature is not None or top_p is not None:
        temperature = torch.ones_like(picked) if temperature is None else temperature.to(picked.device)
        top_p = torch.ones_like(picked) if top_p is None else top_p.to(picked.device)
        special = ((temperature != 1) | (top_p < 1)) & (parent_index >= 0)
        if bool(special.any()):
            b, j = special.nonzero(as_tuple=True)
            values = sampling.sampled_logprobs(logits[b, src[b, j]], input_ids[b, j], temperature[b, j], top_p[b, j])
            flat = picked.flatten().index_copy(0, b * picked.shape[1] + j, values.to(picked.dtype))
            picked = flat.view_as(picked)
    return picked.masked_fill(parent_index < 0, 0.0)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(d) - d - 1 with d = ref - logprob; >= 0."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


@dataclass(frozen=True, slots=True)
class LossTerms:
    """One micro-batch's loss (with grad) and its parts as weighted sums and counts (detached)."""

    loss: torch.Tensor  # sum_t w_t (pg_t + kl_coef * kl_t)
    pg: torch.Tensor  # sum_t w_t pg_t
    kl: torch.Tensor  # sum_t w_t kl_t (0 without a reference)
    tokens: torch.Tensor  # trained tokens
    clipped: torch.Tensor  # trained tokens whose clip was active (their pg gradient is 0)
    ratio_max: torch.Tensor  # largest ratio current/behaviour over trained tokens (0 if none), either objective


def ppo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    decoupled: bool = False,
    is_cap: float = 2.0,
) -> LossTerms:
    """Token-level clipped PPO objective with an optional k3 KL penalty; all inputs [B, L].

    `advantages` and `weights` are per token (0 or anything where `mask` is 0:
    masked tokens contribute nothing, not even NaN).
    """
    trained = mask > 0
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    anchor = logprobs.detach() if decoupled else behaviour_logprobs
    log_ratio = (logprobs - anchor).masked_fill(~trained, 0.0)
    ratio = torch.exp(log_ratio)
    adv = advantages.masked_fill(~trained, 0.0)
    w = weights.masked_fill(~trained, 0.0)
    clipped_ratio = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    pg = -torch.minimum(ratio * adv, clipped_ratio * adv)
    behaviour_ratio = torch.exp((logprobs.detach() - behaviour_logprobs).masked_fill(~trained, 0.0))
    if decoupled:
        pg = pg * behaviour_ratio.clamp(max=is_cap).masked_fill(~trained, 0.0)
    loss_t = pg
    kl_sum = zero
    if ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs).masked_fill(~trained, 0.0)
        loss_t = pg + kl_coef * kl
        kl_sum = (w * kl).sum().detach()
    active = ((ratio > 1.0 + clip_eps) & (adv > 0)) | ((ratio < 1.0 - clip_eps) & (adv < 0))
    return LossTerms(
        loss=(w * loss_t).sum(),
        pg=(w * pg).sum().detach(),
        kl=kl_sum,
        tokens=trained.sum().detach(),
        clipped=(active & trained).sum().detach(),
        ratio_max=behaviour_ratio.masked_fill(~trained, 0.0).max() if trained.any() else zero,
    )
