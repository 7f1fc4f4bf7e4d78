"""Per-token RL math as pure tensor functions: logprobs, the clipped PPO objective, KL, the behaviour-gap weight.

What it is: functions of tensors only (no model, no I/O), so tests check them
against hand-computed numbers and the timeline equivalence test checks that
merged and unmerged samples give the same values.

- `token_logprobs`: each token's logprob under the model, read at its parent,
  under the token's own sampling transformation (temperature, top-p nucleus
  renormalised: `jet.sampling`), so it is the quantity inference reported;
- `ppo_loss`: the trainer's objective. Per trained token t, with advantage A,
  the behaviour logprob mu_t (the inference worker's, for the version that
  sampled the token) and the per-token weight w_t:
      pg_t = -min(r A, clip(r, 1 - eps, 1 + eps) A)        (PPO, Schulman 2017)
      kl_t = exp(ref - logprob) - (ref - logprob) - 1      (k3, Schulman 2020)
      loss = sum_t w_t (pg_t + kl_coef * kl_t)
  `ppo` takes r = exp(logprob - mu): the clip is against the behaviour policy.
  `decoupled` (Hilton et al. 2021; Fu et al. 2025, "AReaL") takes three policies:
  behaviour mu, proximal prox and current; r' = exp(logprob - prox) is clipped,
  and the behaviour gap rho_t = exp(prox - mu) enters as a detached weight c_t:
      pg_t = -c_t * min(r' A, clip(r', 1 - eps, 1 + eps) A)
  c_t is `behaviour_weights` (`trainer.rollout_correction`, below). The
  per-token weight w_t carries the aggregation (`jet.trainer.batch`):
  1 / (trained tokens of the step) for token_mean, 1 / (sequences * that
  sequence's tokens) for seq_mean;
- `behaviour_weights`: c_t from rho_t, by mode, with the band [floor, cap]
  (`trainer.is_floor`, `trainer.is_cap`); rho_s is the geometric mean of rho_t
  over the trained tokens of an episode (exp of their mean log ratio, as in
  ms-swift's sequence modes and GSPO; verl's `sequence` level takes the
  product, i.e. the sum of the log ratios, which grows with the length):
      none               c_t = 1
      token_truncate     c_t = min(rho_t, cap)                       (TIS; the default)
      token_mask         c_t = rho_t if floor <= rho_t <= cap else 0  (masked IS, ICE-POP)
      sequence_truncate  c_t = min(rho_s, cap)
      sequence_mask      c_t = rho_t if floor <= rho_s <= cap else 0  (sequence-masked IS)

Jet's decoupled objective against AReaL's (areal `ppo_actor_loss_fn`):
- the same: three policies; the clip is against the proximal policy; the
  behaviour weight is exp(prox - behaviour logprob), detached, and multiplies
  the clipped surrogate per token (Jet's k3 KL term is not weighted); token_mean
  divides the weighted sum by every trained token of the step, the tokens a
  mask drops included (AReaL divides by its loss-mask count, not by the kept
  tokens or the sum of the weights); no renormalisation of the weights.
- the proximal policy: AReaL recomputes prox with an extra forward before its
  `ppo_n_minibatches` updates on a batch (or, in later versions, interpolates
  it between the behaviour and current logprobs), so from the second
  minibatch on r' != 1 and the clip acts. Jet takes ONE optimiser step per
  batch, so prox is the current weights before that step: the same forward's
  logprobs, detached, at no extra cost. Hence r' = 1 in value, the clip never
  acts (`clipped` is 0), and the gradient is -c_t A grad(logprob): decoupled
  PPO here is a weighted (truncated-IS) policy gradient with no trust region
  inside a step; lr and grad_clip bound the step.
- the weight above the cap: AReaL DROPS the token (weight 0 where rho > cap,
  rho kept below it; no lower bound): that is Jet's `token_mask` with
  is_floor 0. Jet's default `token_truncate` keeps the token at weight cap.
- the cap: AReaL's behav_imp_weight_cap defaults to None (no cap); Jet's
  is_cap is 2.0 (ms-swift's and verl's default threshold).
- seq_mean (a sequence's tokens weighted 1 / (sequences x its tokens)) is
  Jet's own aggregation, applied after c_t as for token_mean.

What it is not: a packer (`jet.trainer.packing`) or an optimiser loop. The
step-wide sequence statistic (an episode whose tokens lie in several rows)
is gathered by `jet.trainer.step`; here it is an input.

Invariants:
- a token's logprob is read from the logits at its *parent's* position, which
  is i - 1 in a linear sequence and the tree parent in a prefix tree; tokens
  with no parent (roots, padding) get 0;
- the loss is a sum over trained tokens of per-token terms times caller-given
  weights, so splitting or merging samples, or cutting a step into
  micro-batches (summing their losses), does not change it (a per-row mean
  would); a sequence-level weight is a function of its episode's tokens,
  never of the row layout;
- on fresh data (current == behaviour) every correction gives c_t = 1: the
  band always holds 1 (is_floor <= 1 <= is_cap, `jet.config`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, parent_index: torch.Tensor,
                   settings: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """log q(input_ids[b, j] | its context), read from logits[b, parent_index[b, j]].

    logits [B, L, V] (use float32), input_ids and parent_index [B, L] (int64,
    parent -1 for tokens nothing predicts); `settings` ({name: [B, L] float32}
    of `jet.sampling.PARAMS`, a missing one neutral: a packed row's
    `Row.sampling()`) are each token's sampling settings: q is softmax(logits / T)
    renormalised over the top-p nucleus (`jet.sampling`). Returns [B, L]; 0 where
    parent < 0. Tokens at neutral settings (T = 1, top_p = 1) take the plain
    log_softmax path; only the others pay for gathering their rows.
    """
    from jet import sampling

    src = parent_index.clamp(min=0)
    rows = torch.arange(logits.shape[0], device=logits.device)[:, None]
    picked = logits[rows, src, input_ids] - torch.logsumexp(logits, dim=-1)[rows, src]
    if settings:
        settings = {name: values.to(picked.device) for name, values in settings.items()}
        special = sampling.special(settings) & (parent_index >= 0)
        if bool(special.any()):
            b, j = special.nonzero(as_tuple=True)
            values = sampling.sampled_logprobs(logits[b, src[b, j]], input_ids[b, j],
                                               {name: v[b, j] for name, v in settings.items()})
            flat = picked.flatten().index_copy(0, b * picked.shape[1] + j, values.to(picked.dtype))
            picked = flat.view_as(picked)
    return picked.masked_fill(parent_index < 0, 0.0)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(d) - d - 1 with d = ref - logprob; >= 0."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none")


def sequence_log_ratio(log_ratio: torch.Tensor, trained: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
    """Per token, the mean of `log_ratio` over the trained tokens of its sequence (0 where not trained).

    `sequences` [B, L] numbers each trained token's sequence (any integers; a
    sequence may span batch rows); every token of a sequence must be in the
    call, else the caller gathers the step-wide mean itself (`jet.trainer.step`).
    Summed in float64, so the value does not depend on the order of the tokens.
    """
    out = torch.zeros_like(log_ratio)
    if not bool(trained.any()):
        return out
    ids, inverse = torch.unique(sequences[trained], return_inverse=True)
    sums = torch.zeros(ids.numel(), dtype=torch.float64, device=log_ratio.device)
    sums.index_add_(0, inverse, log_ratio[trained].double())
    counts = torch.bincount(inverse, minlength=ids.numel()).double()
    out[trained] = (sums / counts)[inverse].to(log_ratio.dtype)
    return out


def behaviour_weights(log_ratio: torch.Tensor, trained: torch.Tensor, correction: str, cap: float,
                      floor: float | None = None, seq_log_ratio: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(c, masked, truncated) per token from the detached log ratio log(prox / behaviour), [B, L].

    c is the weight of the module docstring's table (0 where not trained);
    `masked` marks the trained tokens a mask dropped, `truncated` those whose
    weight the cap cut. `floor` None is 1 / cap (verl's default lower bound);
    it bounds the masks only (truncation is from above, as in ms-swift and
    verl). Sequence modes need `seq_log_ratio`: per token, the mean log ratio
    of its sequence (`sequence_log_ratio`).
    """
    if correction not in CORRECTIONS:
        raise ValueError(f"rollout correction must be one of {CORRECTIONS}, got {correction!r}")
    floor = 1.0 / cap if floor is None else floor
    ratio = torch.exp(log_ratio.masked_fill(~trained, 0.0))
    none = torch.zeros_like(trained)
    if correction == "none":
        return torch.ones_like(ratio).masked_fill(~trained, 0.0), none, none
    if correction == "token_truncate":
        return ratio.clamp(max=cap).masked_fill(~trained, 0.0), none, (ratio > cap) & trained
    if correction == "token_mask":
        keep = (ratio >= floor) & (ratio <= cap)
        return ratio.masked_fill(~(keep & trained), 0.0), ~keep & trained, none
    if seq_log_ratio is None:
        raise ValueError(f"rollout correction {correction!r} needs each token's sequence mean log ratio")
    seq_ratio = torch.exp(seq_log_ratio.masked_fill(~trained, 0.0))
    if correction == "sequence_truncate":
        return seq_ratio.clamp(max=cap).masked_fill(~trained, 0.0), none, (seq_ratio > cap) & trained
    keep = (seq_ratio >= floor) & (seq_ratio <= cap)
    return ratio.masked_fill(~(keep & trained), 0.0), ~keep & trained, none


@dataclass(frozen=True, slots=True)
class LossTerms:
    """One micro-batch's loss (with grad) and its parts as weighted sums and counts (detached)."""

    loss: torch.Tensor  # sum_t w_t (pg_t + kl_coef * kl_t)
    pg: torch.Tensor  # sum_t w_t pg_t
    kl: torch.Tensor  # sum_t w_t kl_t (0 without a reference)
    tokens: torch.Tensor  # trained tokens
    clipped: torch.Tensor  # trained tokens whose clip was active (their pg gradient is 0)
    ratio_max: torch.Tensor  # largest ratio current/behaviour over trained tokens (0 if none), either objective
    masked: torch.Tensor  # trained tokens the rollout correction's mask dropped (decoupled only)
    truncated: torch.Tensor  # trained tokens whose behaviour weight the cap cut (decoupled only)
    nll: torch.Tensor  # sum over trained tokens of -logprob under the current weights (detached)


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
    correction: str = "token_truncate",
    is_floor: float | None = None,
    sequences: torch.Tensor | None = None,
    seq_log_ratio: torch.Tensor | None = None,
) -> LossTerms:
    """Token-level clipped PPO objective with an optional k3 KL penalty; all inputs [B, L].

    `advantages` and `weights` are per token (0 or anything where `mask` is 0:
    masked tokens contribute nothing, not even NaN). With `decoupled`, the
    behaviour gap is weighted by `behaviour_weights(correction, is_cap,
    is_floor)`; a sequence mode reads `seq_log_ratio` (per token, its
    sequence's mean log ratio over the whole step) or, without it, takes the
    mean over this call's tokens of each `sequences` id. `ppo` ignores the
    correction: its ratio is against the behaviour policy already.
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
    behaviour_log_ratio = (logprobs.detach() - behaviour_logprobs).masked_fill(~trained, 0.0)
    behaviour_ratio = torch.exp(behaviour_log_ratio)
    masked = truncated = torch.zeros_like(trained)
    if decoupled:
        if correction.startswith("sequence") and seq_log_ratio is None:
            if sequences is None:
                raise ValueError(f"rollout correction {correction!r} needs the tokens' sequence ids")
            seq_log_ratio = sequence_log_ratio(behaviour_log_ratio, trained, sequences)
        c, masked, truncated = behaviour_weights(behaviour_log_ratio, trained, correction, is_cap, is_floor,
                                                 seq_log_ratio)
        pg = pg * c
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
        masked=masked.sum(),
        truncated=truncated.sum(),
        nll=-(logprobs.detach().masked_fill(~trained, 0.0)).sum(),
    )
