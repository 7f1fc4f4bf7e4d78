"""The forward/backward of one optimiser step over packed rows, shared by every backend.

What it is: `accumulate(model, rows, inputs, ...)` runs each micro-batch (one
packed row) through the model, computes `jet.trainer.losses.ppo_loss` with
that row's per-token advantages and weights (`StepInputs.token_values`), and
hands `loss * scale` to the backend's `backward` (gradient accumulation:
the step's loss is the SUM of its micro-batch losses, the aggregation lives
in the weights). A `None` row is padding for a data-parallel rank with fewer
rows than the others: it runs `pad_row` with scale 0, so every rank makes the
same number of backward calls (ZeRO's collectives need that) and adds nothing.

What it is not: an optimiser step (the backend's), or I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Sequence

import torch

from jet.config import TrainerConfig
from jet.trainer.batch import StepInputs
from jet.trainer.losses import ppo_loss
from jet.trainer.packing import Row, row_logprobs


@dataclass(slots=True)
class StepStats:
    """Sums over a step's micro-batches (all ranks, once reduced)."""

    loss: float = 0.0  # the step's objective: sum of micro-batch losses
    pg: float = 0.0  # its policy-gradient part
    kl: float = 0.0  # weighted KL to the reference (same aggregation as the loss)
    tokens: float = 0.0  # trained tokens
    clipped: float = 0.0  # trained tokens whose ratio clip was active
    row_tokens: float = 0.0  # tokens forwarded (prompt and context included)
    rows: float = 0.0  # micro-batches
    ratio_max: float = 0.0
    grad_norm: float = 0.0  # global L2 norm before clipping

    SUMMED = ("loss", "pg", "kl", "tokens", "clipped", "row_tokens", "rows")

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, k) for k in self.SUMMED], dtype=torch.float64)

    def set_from(self, summed: torch.Tensor) -> None:
        for k, v in zip(self.SUMMED, summed.tolist()):
            setattr(self, k, v)

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


Backward = Callable[[torch.Tensor, bool], None]  # (loss, is the last micro-batch)


def accumulate(model, rows: Sequence[Row | None], inputs: StepInputs, cfg: TrainerConfig, backward: Backward, *,
               ref_model=None, scale: float = 1.0, pad_row: Row | None = None) -> StepStats:
    """Forward/backward every micro-batch of `rows`; returns this rank's sums."""
    stats = StepStats()
    for i, row in enumerate(rows):
        pad = row is None
        row = pad_row if pad else row
        assert row is not None, "a padding micro-batch needs pad_row"
        terms = micro_batch(model, row, inputs, cfg, ref_model)
        backward(terms.loss * (0.0 if pad else scale), i == len(rows) - 1)
        if pad:
            continue
        stats.loss += float(terms.loss.detach())
        stats.pg += float(terms.pg)
        stats.kl += float(terms.kl)
        stats.tokens += float(terms.tokens)
        stats.clipped += float(terms.clipped)
        stats.row_tokens += row.n_tokens
        stats.rows += 1
        stats.ratio_max = max(stats.ratio_max, float(terms.ratio_max))
    return stats


def micro_batch(model, row: Row, inputs: StepInputs, cfg: TrainerConfig, ref_model=None):
    """`ppo_loss` of one packed row under `model` (and the frozen `ref_model` when KL is on)."""
    logprobs = row_logprobs(model, row)
    device = logprobs.device
    ref = None
    if ref_model is not None and cfg.kl_coef > 0:
        with torch.no_grad():
            ref = row_logprobs(ref_model, row)
    adv, weights = inputs.token_values(row.seq)
    return ppo_loss(logprobs, row.behaviour_logprobs.to(device), adv.to(device), weights.to(device),
                    row.loss_mask.to(device), cfg.clip_eps, ref, cfg.kl_coef,
                    decoupled=cfg.objective == "decoupled", is_cap=cfg.is_cap)
