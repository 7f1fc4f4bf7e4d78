"""Cutting timeline samples to a token budget: `split_sample` and `truncate_sample`.

What it is: two functions from one `jet.timeline.Sample` to valid samples
that fit a micro-batch of `max_tokens` tokens (the trainer's
`trainer.micro_batch_tokens`):

- `split_sample` cuts a sample whose every root-to-token path fits into
  pieces of at most `max_tokens` (prefix-tree chunking): each piece re-copies
  the ancestors of its first token as untrained context, so every trained
  token keeps its exact context and is trained in exactly one piece. It
  cannot shorten a path: a trained token deeper than `max_tokens - 1` has more
  context than one forward pass can hold.
- `truncate_sample` is the documented policy for such paths: it drops every
  token at depth >= `max_tokens` (and untrained leaves left behind), keeping
  the tokens whose full context fits. What was dropped is the caller's to
  count (`jet.trainer.screen`).

What it is not: a packer (`jet.trainer.packing`) or a merge.

Invariants: outputs satisfy `Sample`'s invariants (preorder, no untrained
leaf); a trained token of an output has the same context and the same value
in every behaviour column (`jet.timeline.model.CARRIED`: logprob, version,
episode, sampling settings) as in the input.
"""

from __future__ import annotations

from typing import Any, Sequence

from jet.timeline.model import CARRIED, Sample, prune


def split_sample(sample: Sample, max_tokens: int) -> list[Sample]:
    """Cut a sample into pieces of at most `max_tokens`, each a valid sample.

    Walks the preorder; when a piece is full the next one starts with a copy
    of the current token's ancestors, untrained (they are trained where they
    first appeared), so every trained token keeps its exact context. Raises
    ValueError when a single root-to-token path is longer than `max_tokens`.
    """
    if len(sample) <= max_tokens:
        return [sample]
    pieces: list[tuple[list[int], list[int], list[bool]]] = []
    path: list[int] = []  # original indices from the root to the current token
    where: dict[int, int] = {}  # original index -> index in the current piece
    for i, p in enumerate(sample.parents):
        while path and path[-1] != p:
            path.pop()
        if not pieces or len(pieces[-1][0]) >= max_tokens:
            if len(path) + 1 > max_tokens:
                raise ValueError(f"token {i} has {len(path)} ancestors: more than max_tokens={max_tokens}")
            pieces.append(([], [], []))
            where = {}
            for a in path:
                _take(pieces[-1], where, a, sample.parents[a], trained=False)
        _take(pieces[-1], where, i, p, trained=bool(sample.mask[i]))
        path.append(i)
    out = (_piece(sample, *piece) for piece in pieces)
    return [s for s in out if s is not None]


def truncate_sample(sample: Sample, max_tokens: int) -> Sample | None:
    """The sample without its tokens at depth >= `max_tokens`; None when no trained token is left.

    Every kept token has a root-to-token path of at most `max_tokens` tokens,
    so the result can always be split to fit (`split_sample`).
    """
    depth = sample.positions
    if max(depth, default=-1) < max_tokens:
        return sample
    kept = [i for i, d in enumerate(depth) if d < max_tokens]  # ancestors of a kept token are kept
    where = {old: new for new, old in enumerate(kept)}
    parents = [where[sample.parents[i]] if sample.parents[i] >= 0 else -1 for i in kept]
    return _piece(sample, kept, parents, [bool(sample.mask[i]) for i in kept])


def _take(piece: tuple[list[int], list[int], list[bool]], where: dict[int, int], i: int, p: int, trained: bool):
    idx, parents, trained_col = piece
    where[i] = len(idx)
    idx.append(i)
    parents.append(where[p] if p >= 0 else -1)
    trained_col.append(trained)


def _piece(s: Sample, idx: list[int], parents: list[int], trained: list[bool]) -> Sample | None:
    keep = prune(parents, [0 if t else -1 for t in trained])
    if not keep:
        return None
    new_index = {old: new for new, old in enumerate(keep)}

    def col(values: Sequence[Any], unset: Any) -> tuple[Any, ...]:
        return tuple(values[idx[j]] if trained[j] else unset for j in keep)

    return Sample(
        tokens=tuple(s.tokens[idx[j]] for j in keep),
        parents=tuple(new_index[parents[j]] if parents[j] >= 0 else -1 for j in keep),
        model=s.model,
        agents=s.agents,
        episode_ids=s.episode_ids,
        rewards=s.rewards,
        **{c.name: col(getattr(s, c.name), c.unset) for c in CARRIED},
    )
