"""The forward/backward of one optimiser step over packed rows, shared by every backend.

What it is: `accumulate(model, rows, inputs, ...)` runs each micro-batch (one
packed row) through the model, computes `jet.trainer.losses.ppo_loss` with
that row's per-token advantages and weights (`StepInputs.token_values`), and
hands `loss * scale` to the backend's `backward` (gradient accumulation:
the step's loss is the SUM of its micro-batch losses, the aggregation lives
in the weights). A `None` row is padding for a data-parallel rank with fewer
rows than the others: it runs `pad_row` with scale 0, so every rank makes the
same number of backward calls (ZeRO's collectives need that) and adds nothing.

A sequence-level rollout correction (`trainer.rollout_correction: sequence_*`,
objective decoupled) weighs a token by a statistic of its whole episode: the
mean log ratio current/behaviour over the episode's trained tokens, whatever
samples, trees and rows they lie in (`episode_log_ratios`). When every
episode's tokens lie in one row, each micro-batch computes it from its own
tokens; when one spans rows (a tree or a multi-turn episode split by the
token budget), a no-grad forward over the step's rows gathers it first (one
extra forward per such step; the logprobs are the same weights', so the
proximal policy is unchanged). Episodes are keyed by their episode id
(`StepInputs.samples`; seq_mean keys by trajectory and episode id, which one
trainer's step cannot tell apart: a model has one trajectory per episode).

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
    masked: float = 0.0  # trained tokens the rollout correction's mask dropped (policy/is_masked_frac)
    truncated: float = 0.0  # trained tokens whose behaviour weight was cut at is_cap (policy/is_truncated_frac)
    nll: float = 0.0  # sum of -logprob over trained tokens: / tokens, the sampled entropy estimate (train/entropy)
    grad_norm: float = 0.0  # global L2 norm before clipping
    micro_batch_s: float = 0.0  # the longest micro-batch's forward/backward (s)

    SUMMED = ("loss", "pg", "kl", "tokens", "clipped", "row_tokens", "forward_tokens", "rows", "masked", "truncated",
              "nll")

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
    episodes = episode_log_ratios(model, rows, inputs, cfg, stop) if sequence_level(cfg) else None
    for i, row in enumerate(rows):
        if stop is not None and stop():
            raise StepAbandoned(f"stopped before micro-batch {i + 1} of {len(rows)}")
        t0 = time.monotonic()
        pad = row is None
        row = pad_row if pad else row
        assert row is not None, "a padding micro-batch needs pad_row"
        terms = micro_batch(model, row, inputs, cfg, ref_model, episodes)
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
        stats.masked += float(terms.masked)
        stats.truncated += float(terms.truncated)
        stats.nll += float(terms.nll)
        stats.row_tokens += row.n_tokens
        stats.forward_tokens += row.n_real
        stats.rows += 1
        stats.ratio_max = max(stats.ratio_max, float(terms.ratio_max))
    return stats


def micro_batch(model, row: Row, inputs: StepInputs, cfg: TrainerConfig, ref_model=None,
                episodes: Episodes | None = None):
    """`ppo_loss` of one packed row under `model` (and the frozen `ref_model` when KL is on); a
    sequence-level correction reads `episodes` (None: each episode's statistic from this row alone)."""
    logprobs = row_logprobs(model, row)
    device = logprobs.device
    ref = None
    if ref_model is not None and cfg.kl_coef > 0:
        with torch.no_grad():
            ref = row_logprobs(ref_model, row)
    adv, weights = inputs.token_values(row.seq)
    sequences = seq_log_ratio = None
    if sequence_level(cfg):
        episodes = episodes or Episodes(episode_index(inputs))
        sequences = episodes.of_tokens(row.seq).to(device)
        if episodes.mean_log_ratio is not None:
            seq_log_ratio = episodes.mean_log_ratio.to(device, logprobs.dtype)[sequences.clamp(min=0)]
    return ppo_loss(logprobs, row.behaviour_logprobs.to(device), adv.to(device), weights.to(device),
                    row.loss_mask.to(device), cfg.clip_eps, ref, cfg.kl_coef,
                    decoupled=cfg.objective == "decoupled", is_cap=cfg.is_cap, correction=cfg.rollout_correction,
                    is_floor=cfg.is_floor, sequences=sequences, seq_log_ratio=seq_log_ratio)


def sequence_level(cfg: TrainerConfig) -> bool:
    return cfg.objective == "decoupled" and cfg.rollout_correction.startswith("sequence")


@dataclass(slots=True)
class Episodes:
    """Each (sample, episode) entry's episode index, and each episode's step-wide mean log ratio (None: per row)."""

    index: torch.Tensor  # [E] int64: entry -> episode
    mean_log_ratio: torch.Tensor | None = None  # [episodes] float64

    def of_tokens(self, seq: torch.Tensor) -> torch.Tensor:
        """A row's per-token episode index (-1 where `seq` is -1)."""
        if self.index.numel() == 0:
            return torch.full_like(seq, -1)
        return self.index[seq.clamp(min=0)].masked_fill(seq < 0, -1)


def episode_index(inputs: StepInputs) -> torch.Tensor:
    """[E] the episode of each (sample, episode) entry, numbered in order of appearance, keyed by episode id."""
    ids = [e for s in inputs.samples for e in s.episode_ids]
    if len(ids) != inputs.advantages.numel():
        raise ValueError(f"a sequence-level rollout correction needs the step's samples ({len(ids)} episode "
                         f"entries for {inputs.advantages.numel()} table entries); a data-parallel rank without "
                         "them cannot key its tokens by episode")
    number: dict[str, int] = {}
    return torch.tensor([number.setdefault(e, len(number)) for e in ids], dtype=torch.int64)


def spans_rows(episodes: Episodes, rows: Sequence[Row | None]) -> bool:
    """Whether the trained tokens of some episode lie in more than one of `rows`."""
    n = int(episodes.index.max()) + 1 if episodes.index.numel() else 0
    seen = torch.zeros(n, dtype=torch.int64)
    for row in rows:
        if row is not None:
            mine = episodes.of_tokens(row.seq)[row.loss_mask > 0]
            seen[torch.unique(mine[mine >= 0])] += 1
    return n > 0 and int(seen.max()) > 1


def episode_log_ratios(model, rows: Sequence[Row | None], inputs: StepInputs, cfg: TrainerConfig,
                       stop: Callable[[], bool] | None = None) -> Episodes:
    """The step's `Episodes`: with the mean log ratio of every episode when one spans several rows (a
    no-grad forward over `rows`), else without (each row holds its episodes whole)."""
    episodes = Episodes(episode_index(inputs))
    if not spans_rows(episodes, rows):
        return episodes
    n = int(episodes.index.max()) + 1
    sums = torch.zeros(n, dtype=torch.float64)
    counts = torch.zeros(n, dtype=torch.float64)
    with torch.no_grad():
        for i, row in enumerate(rows):
            if stop is not None and stop():
                raise StepAbandoned(f"stopped before the episode pass over micro-batch {i + 1} of {len(rows)}")
            if row is None:
                continue
            trained = (row.loss_mask > 0) & (row.seq >= 0)
            log_ratio = row_logprobs(model, row).cpu() - row.behaviour_logprobs
            idx = episodes.of_tokens(row.seq)[trained]
            sums.index_add_(0, idx, log_ratio[trained].double())
            counts.index_add_(0, idx, torch.ones(idx.numel(), dtype=torch.float64))
    episodes.mean_log_ratio = sums / counts.clamp(min=1.0)
    return episodes
