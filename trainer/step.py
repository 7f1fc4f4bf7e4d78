"""The forward/backward of one optimiser step over packed rows, shared by every backend.

What it is: `accumulate(model, rows, inputs, ...)` runs each micro-batch (one
packed row) through the model, computes `jet.trainer.losses.ppo_loss` with
that row's per-token advantages and weights (`StepInputs.token_values`), and
hands `loss * scale` to the backend's `backward` (gradient accumulation:
the step's loss is the SUM of its micro-batch losses, the aggregation lives
in the weights). A `None` row is padding for a data-parallel rank with fewer
rows than the others: it runs `pad_row` with scale 0, so every rank makes the
same number of backward calls (ZeRO's collectives need that) and adds nothing.

A stop asked for during a step (`stop()` true before a micro-batch) abandons it:
`StepAbandoned` is raised before the next micro-batch, nothing is applied, and
the loop leaves the step's trajectories unacked (a restart trains them), so a
stop never waits for a long step (one micro-batch at most).

What it is not: an optimiser step (the backend's), or I/O.
"""

from __future__ import annotations

import os
import time
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
    row_tokens: float = 0.0  # tokens forwarded (prompt and context included), padding included
    forward_tokens: float = 0.0  # the real tokens among them (train/forward_tokens)
    rows: float = 0.0  # micro-batches
    ratio_max: float = 0.0
    grad_norm: float = 0.0  # global L2 norm before clipping
    micro_batch_s: float = 0.0  # the longest micro-batch's forward/backward (s)

    SUMMED = ("loss", "pg", "kl", "tokens", "clipped", "row_tokens", "forward_tokens", "rows")

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, k) for k in self.SUMMED], dtype=torch.float64)

    def set_from(self, summed: torch.Tensor) -> None:
        for k, v in zip(self.SUMMED, summed.tolist()):
            setattr(self, k, v)

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


Backward = Callable[[torch.Tensor, bool], None]  # (loss, is the last micro-batch)
DELAY_ENV = "JET_TRAINER_MICRO_BATCH_DELAY_S"  # test-only: seconds each micro-batch also sleeps (a long step)


class StepAbandoned(Exception):
    """A stop came during a step: it was left before its next micro-batch, nothing applied."""


def accumulate(model, rows: Sequence[Row | None], inputs: StepInputs, cfg: TrainerConfig, backward: Backward, *,
               ref_model=None, scale: float = 1.0, pad_row: Row | None = None,
               stop: Callable[[], bool] | None = None) -> StepStats:
    """Forward/backward every micro-batch of `rows`; returns this rank's sums. Raises StepAbandoned when
    `stop()` is true before a micro-batch."""
    stats = StepStats()
    for i, row in enumerate(rows):
        if stop is not None and stop():
            raise StepAbandoned(f"stopped before micro-batch {i + 1} of {len(rows)}")
        t0 = time.monotonic()
        pad = row is None
        row = pad_row if pad else row
        assert row is not None, "a padding micro-batch needs pad_row"
        terms = micro_batch(model, row, inputs, cfg, ref_model)
        backward(terms.loss * (0.0 if pad else scale), i == len(rows) - 1)
        time.sleep(float(os.environ.get(DELAY_ENV) or 0))
        stats.micro_batch_s = max(stats.micro_batch_s, time.monotonic() - t0)
        if pad:
            continue
        stats.loss += float(terms.loss.detach())
        stats.pg += float(terms.pg)
        stats.kl += float(terms.kl)
        stats.tokens += float(terms.tokens)
        stats.clipped += float(terms.clipped)
        stats.row_tokens += row.n_tokens
        stats.forward_tokens += row.n_real
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
