"""The hf backend's prefix cache: the KV cache of token sequences already computed, for the next prompts
that start with them.

What it is: `PrefixCache(max_bytes)` keeps, per token sequence it was given (`put`: a finished request's
prompt and completion, or a prefix several waiting prompts share), every layer's keys and values for
those tokens. `match(prompt)` finds the stored sequence sharing the longest prefix with a prompt (a whole
entry or any head of one: the keys and values of a sequence's first n tokens depend on those n tokens
alone, attention being causal), so the scheduler (`jet.workers.inference.hf_engine`) prefills only the
rest of the prompt: a GRPO group's system prompt and task once for its members, an episode's previous
turns once for its next turn.

Bounds and eviction: entries are kept while their tensors fit in `max_bytes`; the least recently used
entry goes first. A sequence that is a prefix of a stored one adds nothing (it is not stored), and a
stored entry that is a prefix of a new one is replaced by it. `clear()` empties it: the backend calls it on
every weight load, since keys and values depend on the weights. A backend serving several models on one
base holds one per model, each of its model's size (`models[].prefix_cache_mb`).

What it is not: a scheduler, and no paged memory: entries are plain tensors copied out of a batch's
cache ([1, kv_heads, n, head_dim] per layer), so a batch never pins them.

Invariants: an entry's tensors hold exactly its tokens' keys and values at positions 0..n-1 under the
weights loaded when it was put (no padding); `match` never returns the whole prompt (at least its last
token is forwarded, for the logits of the first new token).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

KV = list[tuple["torch.Tensor", "torch.Tensor"]]  # noqa: F821 - (keys, values) per layer


@dataclass(slots=True)
class Stats:
    prompt_tokens: int = 0  # prompt tokens admitted
    reused_tokens: int = 0  # of those, taken from the cache instead of computed
    shared_prefills: int = 0  # prefixes prefilled once for several waiting prompts

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self.bytes = 0
        self.stats = Stats()

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def enabled(self) -> bool:
        """Whether it keeps anything (`max_bytes` > 0)."""
        return self.max_bytes > 0

    def match(self, prompt: Sequence[int]) -> tuple[tuple[int, ...] | None, int]:
        """(the entry, n): the stored sequence sharing the longest head with `prompt`, and that length,
        at most len(prompt) - 1; (None, 0) when nothing is shared."""
        best, best_n, limit = None, 0, len(prompt) - 1
        for key in self.entries:
            n = _common(key, prompt, limit)
            if n > best_n:
                best, best_n = key, n
                if n == limit:
                    break
        return best, best_n

    def get(self, key: tuple[int, ...], n: int) -> KV:
        """The first `n` tokens' keys and values of entry `key` (views); marks the entry used."""
        self.entries.move_to_end(key)
        return [(k[:, :, :n], v[:, :, :n]) for k, v in self.entries[key]]

    def put(self, tokens: Sequence[int], kv: KV) -> None:
        """Store `kv` (contiguous, [1, kv_heads, len(tokens), head_dim] per layer) for `tokens`."""
        key = tuple(tokens)
        if self.max_bytes <= 0 or not key:
            return
        for stored in self.entries:
            if len(stored) >= len(key) and stored[:len(key)] == key:
                self.entries.move_to_end(stored)
                return  # already covered by a longer (or equal) entry
        for stored in [s for s in self.entries if len(s) < len(key) and key[:len(s)] == s]:
            self._drop(stored)  # a head of the new entry: subsumed
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if size > self.max_bytes:
            return
        self.entries[key] = kv
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def _drop(self, key: tuple[int, ...]) -> None:
        kv = self.entries.pop(key)
        self.bytes -= sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def _common(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the longest common head of `a` and `b`, at most `limit` (a binary search over slices)."""
    a, b = tuple(a), tuple(b)
    lo, hi = 0, min(len(a), len(b), limit)
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi - 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def shared_heads(prompts: Sequence[Sequence[int]], hits: Sequence[int], min_gain: int) -> list[tuple[int, ...]]:
    """Heads worth prefilling once for several of `prompts` (waiting together, `hits` their cached
    lengths): each prompt's longest head shared with another prompt (at most its length - 1), when that
    is at least `min_gain` tokens past its hit; distinct, each once."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    out: dict[tuple[int, ...], None] = {}
    for pos, i in enumerate(order):
        p = prompts[i]
        near = [order[q] for q in (pos - 1, pos + 1) if 0 <= q < len(order)]
        n = max((_common(p, prompts[j], len(p) - 1) for j in near), default=0)
        if n >= hits[i] + min_gain:
            out[tuple(p[:n])] = None
    return list(out)
