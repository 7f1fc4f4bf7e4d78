"""Pack timeline samples (linear ones and prefix trees) into rows a causal LM trains on.

What it is: `pack(samples, max_tokens)` returns `Row`s, each a micro-batch. A
packed row (B = 1, no padding) holds whole samples back to back under a tree
attention mask; a sample longer than the budget is cut by
`jet.timeline.split_sample`. With `batch_linear=True` (what the trainer uses)
linear samples go instead into padded batches (B samples of similar length,
right-padded, B x L within the budget) that need no mask at all: causal
attention never looks right, so a real token never sees a pad, and the
attention kernel runs its causal fast path instead of a dense L x L mask
(measured on SmolLM2-135M, 32 samples of ~70 tokens on CPU: about half the
forward/backward time of one packed row of 2,200 tokens); trees stay packed. Per token a row
carries input ids, position ids (the depth in its tree), the index of its
parent (whose logits predict it), the end of its subtree, the reward, `seq`
and one tensor per packed column of its samples (`jet.timeline.model.PACKED`,
derived from the columns' declaration: the loss mask, the behaviour logprob,
the weight version, the sampling settings). `seq` says which (sample, episode) entry of
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

from jet import sampling
from jet.timeline import Sample, split_sample
from jet.timeline.model import PACKED
from jet.trainer.losses import token_logprobs

_OWN = ("input_ids", "position_ids", "parent_index", "subtree_end", "rewards", "seq")  # built by the packer
_OWN_FLOAT = ("rewards",)
INT_TENSORS: tuple[str, ...] = (*(n for n in _OWN if n not in _OWN_FLOAT),
                                *(c.row for c in PACKED if c.row_kind is not float))  # every int64 [B, L] of a Row
FLOAT_TENSORS: tuple[str, ...] = (*_OWN_FLOAT, *(c.row for c in PACKED if c.row_kind is float))  # every float32 one


@dataclass(frozen=True, slots=True)
class Row:
    """One micro-batch; every tensor is [B, L]: B = 1 for a packed row, B samples for a padded batch.

    Besides the tensors the packer builds from a sample's tokens, parents and episodes (below), a row
    carries one tensor per packed column of the samples (`jet.timeline.model.PACKED`, named by its
    `Column.row`), read as an attribute: `loss_mask` (float32, 1.0 on tokens the model generated),
    `behaviour_logprobs` (float32), `versions` (int64, the weight version that generated the token),
    `temperatures` and `top_ps` (float32, the token's sampling settings); each holds the column's unset
    value where the mask is 0 (0.0, -1, 1.0) and on padding.
    """

    input_ids: torch.Tensor  # int64
    position_ids: torch.Tensor  # int64, depth of the token in its tree
    parent_index: torch.Tensor  # int64, -1 where nothing predicts the token
    subtree_end: torch.Tensor  # int64, exclusive end of the token's subtree
    rewards: torch.Tensor  # float32, the reward of the token's episode; 0.0 where the mask is 0
    seq: torch.Tensor  # int64, the token's (sample, episode) entry in the `pack` call; -1 where the mask is 0
    columns: dict[str, torch.Tensor]  # the packed columns, by `Column.row` (see above)
    causal: bool  # linear samples only, one per batch row: plain causal attention is exact
    n_samples: int

    def __getattr__(self, name: str) -> torch.Tensor:
        if name != "columns":  # (not set yet: no recursion)
            found = self.columns.get(name)
            if found is not None:
                return found
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor], causal: bool, n_samples: int) -> "Row":
        """A row from every tensor by name (`INT_TENSORS`, `FLOAT_TENSORS`), as `jet.trainer.dist` sends them."""
        own = {name: tensors[name] for name in _OWN}
        return cls(**own, columns={c.row: tensors[c.row] for c in PACKED}, causal=causal, n_samples=n_samples)

    def sampling(self) -> dict[str, torch.Tensor]:
        """{setting name: [B, L]} of the tokens' sampling settings (`jet.sampling.PARAMS`)."""
        return {p.name: self.columns[p.column] for p in sampling.PARAMS}

    @property
    def n_tokens(self) -> int:
        """Tokens forwarded, padding included."""
        return int(self.input_ids.numel())

    @property
    def n_real(self) -> int:
        """Tokens forwarded, padding excluded: every token with a parent, and the roots (depth 0). A pad
        has no parent and sits at its column's position (>= 1: a padded row starts with a real token)."""
        return int(((self.parent_index >= 0) | (self.position_ids == 0)).sum())

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


def pack(samples: Sequence[Sample], max_tokens: int, *, share_rows: bool = True,
         batch_linear: bool = False) -> list[Row]:
    """First-fit-decreasing packing of samples into rows of at most `max_tokens`.

    With share_rows=False every sample (or piece) gets its own row, which lets
    linear samples use the causal fast path; with True, rows are filled. With
    batch_linear=True, linear samples go into padded batches (`batch_rows`) and
    only trees are packed.
    """
    offsets = seq_offsets(samples)
    pieces = [(piece, first) for s, first in zip(samples, offsets) for piece in split_sample(s, max_tokens)]
    pieces.sort(key=lambda p: len(p[0]), reverse=True)
    batched: list[Row] = []
    if batch_linear and share_rows:
        batched = batch_rows([p for p in pieces if p[0].is_linear], max_tokens)
        pieces = [p for p in pieces if not p[0].is_linear]
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
    return batched + [pack_row([p for p, _ in b], [first for _, first in b]) for b in bins]


def batch_rows(pieces: Sequence[tuple[Sample, int]], max_tokens: int) -> list[Row]:
    """Linear samples (with their first `seq` number), longest first, in padded batches of B x L <= max_tokens."""
    out, start = [], 0
    while start < len(pieces):
        width = len(pieces[start][0])
        end = start + max(1, max_tokens // max(1, width))
        out.append(padded_row(pieces[start:end]))
        start = end
    return out


def padded_row(pieces: Sequence[tuple[Sample, int]]) -> Row:
    """Linear samples as one [B, L] batch, right-padded (pads: untrained, no parent, never attended to)."""
    width = max(len(s) for s, _ in pieces)
    own: dict[str, list[list]] = {k: [] for k in ("input_ids", "position_ids", "parent_index", "subtree_end",
                                                  "rewards", "seq")}
    cols: dict[str, list[list]] = {c.name: [] for c in PACKED}
    for s, first in pieces:
        n, pad = len(s), width - len(s)
        own["input_ids"].append([*s.tokens] + [0] * pad)
        own["position_ids"].append(list(range(width)))
        own["parent_index"].append(list(range(-1, n - 1)) + [-1] * pad)
        own["subtree_end"].append([n] * n + list(range(n + 1, width + 1)))
        own["rewards"].append([s.rewards[e] if e >= 0 else 0.0 for e in s.episodes] + [0.0] * pad)
        own["seq"].append([first + e if e >= 0 else -1 for e in s.episodes] + [-1] * pad)
        for c in PACKED:
            cols[c.name].append([*getattr(s, c.name)] + [c.unset] * pad)
    return _row(own, cols, causal=True, n_samples=len(pieces))


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
    tokens, parents, rewards, seq = [], [], [], []
    cols: dict[str, list] = {c.name: [] for c in PACKED}
    for s, first in zip(samples, offsets):
        offset = len(tokens)
        tokens += s.tokens
        parents += [p + offset if p >= 0 else -1 for p in s.parents]
        for c in PACKED:
            cols[c.name] += getattr(s, c.name)
        rewards += [s.rewards[e] if e >= 0 else 0.0 for e in s.episodes]
        seq += [first + e if e >= 0 else -1 for e in s.episodes]
    depth, end = _depth_and_end(parents)
    own = {"input_ids": [tokens], "position_ids": [depth], "parent_index": [parents], "subtree_end": [end],
           "rewards": [rewards], "seq": [seq]}
    return _row(own, {name: [values] for name, values in cols.items()},
                causal=len(samples) == 1 and samples[0].is_linear, n_samples=len(samples))


def _row(own: dict[str, list], cols: dict[str, list], causal: bool, n_samples: int) -> Row:
    """A Row from nested lists: the packer's own tensors and each packed column's, by column name."""
    def tensor(values: list, kind: type) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32 if kind is float else torch.int64)

    return Row(**{name: tensor(values, float if name in _OWN_FLOAT else int) for name, values in own.items()},
               columns={c.row: tensor(cols[c.name], c.row_kind) for c in PACKED}, causal=causal, n_samples=n_samples)


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
    """[B, L] logprob of every trained token of the row under `model` (0 elsewhere).

    Passes position ids and, unless the row is causal, a 4D additive mask; in
    transformers 5 a 4D mask is handed to the attention kernel as-is (eager
    adds it, sdpa passes it as attn_mask). Only the positions whose logits
    predict a trained token go through the output head (`logits_to_keep`): the
    vocabulary projection and its softmax are a large part of a step on a
    small model with a large vocabulary, and most positions are prompt.
    """
    param = next(model.parameters())
    ids, parents = row.input_ids.to(param.device), row.parent_index.to(param.device)
    kind = param.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else param.dtype
    mask = None if row.causal else row.attention_mask(dtype).to(param.device)
    positions = row.position_ids.to(param.device)
    trained = (row.loss_mask > 0).to(param.device) & (parents >= 0)
    keep = torch.unique(parents[trained])  # sorted positions whose logits are read
    if keep.numel() == 0:
        keep = torch.zeros(1, dtype=torch.int64, device=param.device)  # a graph for the backward all the same
    where = torch.full((ids.shape[1],), -1, dtype=torch.int64, device=param.device)
    where[keep] = torch.arange(keep.numel(), device=param.device)
    read_at = torch.where(trained, where[parents.clamp(min=0)], torch.full_like(parents, -1))
    try:
        out = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False, logits_to_keep=keep)
    except TypeError:  # a model without logits_to_keep: every position's logits
        out = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False)
        read_at = parents.masked_fill(~trained, -1)
    return token_logprobs(out.logits.float(), ids, read_at, row.sampling())
