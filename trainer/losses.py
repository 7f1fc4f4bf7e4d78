"""Per-token RL math as pure tensor functions: logprobs and the policy-gradient loss.

What it is: functions of tensors only (no model, no I/O), so tests check them
against hand-computed numbers and the timeline equivalence test checks that
merged and unmerged samples give the same values.

What it is not: a packer (`jet.trainer.packing`) or an optimiser loop.

Invariants:
- a token's logprob is read from the logits at its *parent's* position, which
  is i - 1 in a linear sequence and the tree parent in a prefix tree; tokens
  with no parent (roots, padding) get 0;
- the loss is a sum over trained tokens divided by a caller-given normaliser,
  so splitting or merging samples does not change it (a per-sample mean would).
"""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, parent_index: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[b, j] | its context), read from logits[b, parent_index[b, j]].

    logits [B, L, V] (use float32), input_ids and parent_index [B, L] (int64,
    parent -1 for tokens nothing predicts). Returns [B, L]; 0 where parent < 0.
    """
    src = parent_index.clamp(min=0)
    rows = torch.arange(logits.shape[0], device=logits.device)[:, None]
    picked = logits[rows, src, input_ids] - torch.logsumexp(logits, dim=-1)[rows, src]
    return picked.masked_fill(parent_index < 0, 0.0)


def policy_gradient_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normaliser: float,
    clip: float | None = None,
) -> torch.Tensor:
    """Token-level importance-weighted policy gradient, summed over mask and / normaliser.

    loss = -sum(mask * r * A) / normaliser with r = exp(logprob - behaviour);
    with `clip` it is PPO's pessimistic min(r * A, clip(r, 1 - clip, 1 + clip) * A).
    At r = 1 the gradient is -sum(mask * A * grad logprob) / normaliser (REINFORCE).
    """
    trained = mask > 0
    ratio = torch.exp((logprobs - behaviour_logprobs).masked_fill(~trained, 0.0))
    gain = ratio * advantages
    if clip is not None:
        gain = torch.minimum(gain, ratio.clamp(1.0 - clip, 1.0 + clip) * advantages)
    return -(gain * trained).sum() / normaliser
