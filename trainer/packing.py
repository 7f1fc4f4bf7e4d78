"""Pack timeline samples (linear ones and prefix trees) into rows a causal LM trains on.

What it is: `pack(samples, max_tokens)` returns `Row`s, each a micro-batch of
one packed row (B = 1, no padding) holding whole samples back to back; a sample
longer than the budget is cut by `jet.timeline.split_sample`. Per token a row
carries input ids, position ids (the depth in its tree), the index of its
parent (whose logits predict it), the end of its subtree, the loss mask, the
behaviour logprob, version, sampling settings (temperature, top_p), reward and `seq`: which (sample, episode) entry of
the `pack` call the token belongs to, numbered sample by sample
(`sum(len(s.episode_ids) for s in samples[:k]) + s.episodes[i]`), so a caller
can look up per-entry values (advantages, loss weights) for any row. `row_logprobs(model, row)` runs a
Hugging Face causal LM on a row and returns each token's logprob under its own sampling settings
(`jet.trainer.losses.token_logprobs`), the quantity inference reported as the behaviour logprob.

What it is not: no loss and no optimiser (`jet.trainer.losses`), no queue I/O,
and no import of jet.workers: samples arrive as `jet.timeline.Sample`.

Invariants:
- attention follows the tree: query q sees key k iff k is an ancestor-or-self
  of q, which in preorder is k <= q < subtree_end[k]; for a linear sample this
  is the causal mask, and samples in one row never see each other;
- `Row.attention_mask()` materialises that as a dense [1, 1, L, L] mask, so a
  tree row costs O(L^2) memory and attention work even where most pairs are
  masked (a GPU trainer would hand `subtree_end` to a block-sparse kernel);
  a row holding one linear sample needs no mask at all (`Row.causal`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from jet.timeline import Sample, split_sample
from jet.trainer.losses import token_logprobs


@dataclass(frozen=True, slots=True)
class Row:
    """One packed micro-batch; every tensor is [1, L]."""

    input_ids: torch.Tensor  # int64
    position_ids: torch.Tensor  # int64, depth of the token in its tree
    parent_index: torch.Tensor  # int64, -1 where nothing predicts the token
    subtree_end: torch.Tensor  # int64, exclusive end of the token's subtree
    loss_mask: torch.Tensor  # float32, 1.0 on tokens the model generated
    behaviour_logprobs: torch.Tensor  # float32, 0.0 where the mask is 0
    versions: torch.Tensor  # int64, -1 where the mask is 0
    temperatures: torch.Tensor  # float32, the token's sampling temperature; 1.0 where the mask is 0
    top_ps: torch.Tensor  # float32, the token's nucleus mass; 1.0 where the mask is 0
    rewards: torch.Tensor  # float32, the reward of the token's episode; 0.0 where the mask is 0
    seq: torch.Tensor  # int64, the token's (sample, episode) entry in the `pack` call; -1 where the mask is 0
    causal: bool  # one linear sample: plain causal attention is exact
    n_samples: int

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def attention_mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense [1, 1, L, L] mask: bool (True = attend) or additive (0 / dtype's min)."""
        return tree_attention_mask(self.subtree_end, dtype)


def tree_attention_mask(subtree_end: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B, L] subtree ends -> [B, 1, L, L] mask where query q sees key k iff k <= q < end[k]."""
    n = subtree_end.shape[-1]
    q = torch.arange(n, device=subtree_end.device)[:, None]
    k = torch.arange(n, device=subtree_end.device)[None, :]
    allowed = (k <= q) & (q < subtree_end[:, None, :])  # [B, L, L]
    allowed = allowed[:, None]
    if dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def pack(samples: Sequence[Sample], max_tokens: int, *, share_rows: bool = True) -> list[Row]:
    """First-fit-decreasing packing of samples into rows of at most `max_tokens`.

    With share_rows=False every sample (or piece) gets its own row, which lets
    linear samples use the causal fast path; with True, rows are filled.
    """
    offsets = seq_offsets(samples)
    pieces = [(piece, first) for s, first in zip(samples, offsets) for piece in split_sample(s, max_tokens)]
    pieces.sort(key=lambda p: len(p[0]), reverse=True)
    bins: list[list[tuple[Sample, int]]] = []
    fill: list[int] = []
    for piece in pieces:
        n = len(piece[0])
        fits = (i for i, used in enumerate(fill) if used + n <= max_tokens) if share_rows else iter(())
        target = next(fits, None)
        if target is None:
            bins.append([piece])
            fill.append(n)
        else:
            bins[target].append(piece)
            fill[target] += n
    return [pack_row([p for p, _ in b], [first for _, first in b]) for b in bins]


def seq_offsets(samples: Sequence[Sample]) -> list[int]:
    """The `seq` number of each sample's first episode entry: entries are numbered sample by sample."""
    out, n = [], 0
    for s in samples:
        out.append(n)
        n += len(s.episode_ids)
    return out


def pack_row(samples: Sequence[Sample], offsets: Sequence[int] | None = None) -> Row:
    """Lay samples out back to back in one row; `offsets` number their entries (default: `seq_offsets`)."""
    offsets = seq_offsets(samples) if offsets is None else offsets
    tokens, parents, mask, lps, versions, rewards, seq, temps, top_ps = [], [], [], [], [], [], [], [], []
    for s, first in zip(samples, offsets):
        offset = len(tokens)
        tokens += s.tokens
        parents += [p + offset if p >= 0 else -1 for p in s.parents]
        mask += s.mask
        lps += s.logprobs
        versions += s.versions
        temps += s.temperatures
        top_ps += s.top_ps
        rewards += [s.rewards[e] if e >= 0 else 0.0 for e in s.episodes]
        seq += [first + e if e >= 0 else -1 for e in s.episodes]
    depth, end = _depth_and_end(parents)

    def long(values: list[int]) -> torch.Tensor:
        return torch.tensor([values], dtype=torch.int64)

    def f32(values: list[float]) -> torch.Tensor:
        return torch.tensor([values], dtype=torch.float32)

    return Row(
        input_ids=long(tokens),
        position_ids=long(depth),
        parent_index=long(parents),
        subtree_end=long(end),
        loss_mask=f32(mask),
        behaviour_logprobs=f32(lps),
        versions=long(versions),
        temperatures=f32(temps),
        top_ps=f32(top_ps),
        rewards=f32(rewards),
        seq=long(seq),
        causal=len(samples) == 1 and samples[0].is_linear,
        n_samples=len(samples),
    )


def _depth_and_end(parents: list[int]) -> tuple[list[int], list[int]]:
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    size = [1] * len(parents)
    for i in range(len(parents) - 1, -1, -1):
        if parents[i] >= 0:
            size[parents[i]] += size[i]
    return depth, [i + n for i, n in enumerate(size)]


def row_logprobs(model: torch.nn.Module, row: Row) -> torch.Tensor:
    """[1, L] logprob of every token of the row under `model` (0 where no parent).

    Passes position ids and, unless the row is causal, a 4D additive mask; in
    transformers 5 a 4D mask is handed to the attention kernel as-is (eager
    adds it, sdpa passes it as attn_mask).
    """
    param = next(model.parameters())
    ids, parents = row.input_ids.to(param.device), row.parent_index.to(param.device)
    kind = param.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else param.dtype
    mask = None if row.causal else row.attention_mask(dtype).to(param.device)
    positions = row.position_ids.to(param.device)
    out = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False)
    return token_logprobs(out.logits.float(), ids, parents, row.temperatures, row.top_ps)
