"""Continuous batching for the hf backend: an iteration-level scheduler and its async front.

What it is: `Scheduler` keeps every request being decoded as a row of ONE batch
with one KV cache. Each `step()` first admits waiting requests (their prompts
prefilled together, left-padded, in a cache of their own, which is then merged
into the batch's by left-padding the shorter of the two), then runs one
decoding forward for all rows. A row that stops leaves the batch at once, and
cache columns no row attends to any more are cropped, so the batch never grows
wider than its longest live row. `Engine` puts it behind
`await agenerate_one(prompt, params)`: concurrent callers share the steps
(one waiting caller at a time drives them, each step in a worker thread), so
requests join and leave between steps. `HFBackend.generate` (the batch API) is
the same scheduler with every request admitted at the first step.

Prefix reuse: admission starts each prompt from the longest head the backend's
prefix cache holds (`jet.workers.inference.prefix_cache`): those keys and values,
left-padded to one width, go first in the new rows' cache and only the rest of
each prompt is forwarded, at its true positions. Waiting prompts that share a
head nothing cached covers (the members of a GRPO group) get it computed once
first. A row that finishes leaves its prompt and completion in the cache, where
the next turn of its episode finds them. The cache is emptied at every weight
load, so reused keys and values always come from the weights serving the row.

Several models on one base (the backend's slots, `jet.workers.inference.lora`): each row
carries its slot; every forward tells the backend's `RowLoRA` the slot of each row, so
rows of different models share a batch; prefix reuse stays within a slot (its own
cache: keys and values depend on the adapter), and so do shared heads.

Weight loads: `Engine.aload_weights` passes `jet.workers.inference.gate.WeightGate`:
it holds new requests back, waits for the rows in flight to finish, loads, and
lets the held requests in (pause admission, drain, load, resume). So a
request's tokens all come from one weight version, the one its output names.

What it is not: a server or a queue reader (`jet.workers.inference.worker`), nor the
sampling math (`jet.workers.inference.hf.pick_tokens`, one place for both APIs).

Invariants: padding is never attended (mask 0) and positions are explicit per
row, so a row's logits do not depend on its batch neighbours (nor on whether its
head came from the prefix cache) beyond float noise;
each row owns its generator and draws one uniform per token (batch invariance
as in hf_backend); a cancelled caller's row is dropped at the next step. Models
whose cache has sliding-window layers are served without merging: new requests
wait until the batch is empty (batch-synchronous, still correct). A step that
raises (out of memory, say) ends every request in the scheduler with an error
reply and the next step starts from an empty batch: never a crash, never a hang.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from jet.workers.inference.backend import GenOutput, SamplingParams, generator, pick_tokens
from jet.workers.inference.gate import WeightGate
from jet.workers.inference.prefix_cache import shared_heads

if TYPE_CHECKING:
    import torch

    from jet.workers.inference.hf import HFBackend

log = logging.getLogger(__name__)

SHARED_MIN_TOKENS = 16  # a head several waiting prompts share is prefilled once from this length on


@dataclass(eq=False)
class Row:
    """One request in the scheduler: its settings and what it generated so far."""

    prompt: list[int]
    sp: SamplingParams
    limit: int  # tokens at most (max_tokens clipped to the context left)
    stops: frozenset[int]
    gen: "torch.Generator"
    version: int  # the weight version serving it (loads wait for rows to finish)
    slot: int = 0  # which model of a shared base it is (the backend's slots)
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None  # set with finish "error": the step that decoded it failed
    cancelled: bool = False  # set by a caller that gave up; the row leaves at the next step
    wake: anyio.Event | None = None  # Engine: set when finished, or when this caller should drive

    def output(self) -> GenOutput:
        if self.finish == "error":
            return GenOutput([], [], "error", self.error, self.version)
        return GenOutput(self.tokens, self.logps, self.finish, None, self.version)  # type: ignore[arg-type]


class Scheduler:
    """The rows of one batch and their KV cache; `step` is not thread-safe (one driver at a time)."""

    def __init__(self, backend: HFBackend, max_rows: int = 256):
        self.b, self.max_rows = backend, max_rows
        self.waiting: deque[Row] = deque()
        self.rows: list[Row] = []  # batch order: row r of cache / mask / pos / next_ids
        self.cache = self.mask = self.pos = self.next_ids = None
        self.mergeable = True  # False once a sliding-window cache layer is seen
        self.cache_kwarg = cache_kwarg(backend.model)
        self.forwards = 0  # model calls so far (prefills + decoding steps)
        self.peak_rows = 0  # most rows decoded in one step

    def new_row(self, prompt: list[int], sp: SamplingParams, slot: int = 0) -> Row:
        """A row for a request that passed `HFBackend._request_error`."""
        limit = min(sp.max_tokens, self.b.context_length - len(prompt))
        return Row(list(prompt), sp, limit, self.b.eos_ids | frozenset(sp.stop_token_ids), generator(sp.seed),
                   self.b.versions[slot], slot=slot)

    def fail_all(self, error: str) -> list[Row]:
        """After a step raised: every row in the scheduler ends with `error`, and the batch starts empty."""
        failed = [*self.rows, *self.waiting]
        for row in failed:
            row.finish, row.error = "error", error
        self.rows, self.waiting, self.cache = [], deque(), None
        return failed

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    def run(self, rows: list[Row]) -> None:
        """Admit `rows` and step until every row of the scheduler has finished."""
        self.step(rows)
        while self.busy:
            self.step()

    def step(self, new: list[Row] = ()) -> list[Row]:
        """Admit what fits, then decode one token for every row; returns the rows that finished."""
        import torch

        self.waiting.extend(new)
        self._drop_cancelled()
        done: list[Row] = []
        with torch.inference_mode():
            room = self.max_rows - len(self.rows)
            if self.waiting and room > 0 and (self.mergeable or not self.rows):
                fresh = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
                done += self._admit(fresh)
            if self.rows:
                done += self._decode()
        return done

    # -- the two kinds of forward ---------------------------------------------

    def _admit(self, fresh: list[Row]) -> list[Row]:
        """Prefill the fresh rows' prompts (each from the longest head the prefix cache holds) and sample
        their first tokens."""
        import torch
        from transformers import DynamicCache

        caches = self.b.prefix_caches  # one per slot
        use_cache = caches[0].max_bytes > 0 and self.mergeable
        hits = [caches[r.slot].match(r.prompt) if use_cache else (None, 0) for r in fresh]
        for slot in sorted({r.slot for r in fresh}) if use_cache else ():
            mine = [i for i, r in enumerate(fresh) if r.slot == slot]
            heads = shared_heads([fresh[i].prompt for i in mine], [hits[i][1] for i in mine], SHARED_MIN_TOKENS)
            if heads:  # several waiting prompts share a head nothing cached covers: compute it once
                self._prefill_heads(heads, slot)
                for i in mine:
                    hits[i] = caches[slot].match(fresh[i].prompt)
        for r, (_, n) in zip(fresh, hits):
            caches[r.slot].stats.prompt_tokens += len(r.prompt)
            caches[r.slot].stats.reused_tokens += n
        ids, mask, pos = self.b._left_pad([r.prompt[n:] for r, (_, n) in zip(fresh, hits)])
        cache = DynamicCache(config=self.b.model.config)
        width = max(n for _, n in hits)
        if width:  # the cached heads, left-padded to one width, before the rest of each prompt
            starts = torch.tensor([[n] for _, n in hits], dtype=pos.dtype, device=pos.device)
            pos = pos + starts
            heads = [caches[r.slot].get(key, n) if key else None for r, (key, n) in zip(fresh, hits)]
            like = next(h for h in heads if h)
            for layer in range(len(like)):
                keys = torch.cat([_left_kv(h[layer][0] if h else None, like[layer][0], width) for h in heads])
                values = torch.cat([_left_kv(h[layer][1] if h else None, like[layer][1], width) for h in heads])
                cache.update(keys, values, layer)
            held = torch.arange(width, device=mask.device)[None, :] >= width - starts
            mask = torch.cat([held.to(mask.dtype), mask], dim=1)
        logits = self._forward(ids, mask, pos, cache, [r.slot for r in fresh])
        done, keep = self._sample(fresh, logits)
        self._remember(cache, mask, fresh, keep)
        if keep:
            self._merge(*self._kept(cache, mask, pos[:, -1:] + 1, fresh, keep))
        return done

    def _prefill_heads(self, heads: list[tuple[int, ...]], slot: int) -> None:
        """Compute the keys and values of `heads` (one batch, no sampling) into `slot`'s prefix cache."""
        from transformers import DynamicCache

        pc = self.b.prefix_caches[slot]
        ids, mask, pos = self.b._left_pad([list(h) for h in heads])
        cache = DynamicCache(config=self.b.model.config)
        self._forward(ids, mask, pos, cache, [slot] * len(heads))
        self.mergeable = _plain_layers(cache)
        if self.mergeable:
            for i, head in enumerate(heads):
                pc.put(head, self._row_kv(cache, mask, i))
        pc.stats.shared_prefills += len(heads)

    def _row_kv(self, cache, mask, i: int):
        """Row i's keys and values at its unmasked columns, copied: [1, kv_heads, n, head_dim] per layer."""
        cols = mask[i].nonzero().squeeze(1)
        return [(layer.keys[i:i + 1, :, cols].clone(), layer.values[i:i + 1, :, cols].clone())
                for layer in cache.layers]

    def _remember(self, cache, mask, rows: list[Row], keep: list[int]) -> None:
        """Put each finished row's prompt and completion (all but the last token, never fed) in the prefix
        cache: the next turn of its episode starts with them."""
        caches = self.b.prefix_caches
        if caches[0].max_bytes <= 0 or len(keep) == len(rows) or not _plain_layers(cache):
            return
        kept = set(keep)
        for i, row in enumerate(rows):
            if i not in kept and row.finish != "error":
                kv = self._row_kv(cache, mask, i)
                tokens = row.prompt + row.tokens[:-1]
                if kv[0][0].shape[2] == len(tokens):  # the row's columns are exactly its tokens
                    caches[row.slot].put(tokens, kv)

    def _decode(self) -> list[Row]:
        logits = self._forward(self.next_ids, self.mask, self.pos, self.cache, [r.slot for r in self.rows])
        done, keep = self._sample(self.rows, logits)
        self._remember(self.cache, self.mask, self.rows, keep)
        self.cache, self.mask, self.pos, self.next_ids, self.rows = self._kept(
            self.cache, self.mask, self.pos + 1, self.rows, keep)
        if self.rows:
            self._crop()
        else:
            self.cache = None
        return done

    def _forward(self, ids, mask, pos, cache, slots: list[int]):
        self.forwards += 1
        self.peak_rows = max(self.peak_rows, ids.shape[0])
        if self.b.lora is not None:
            self.b.lora.select(slots, ids.device)
        out = self.b.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                           **{self.cache_kwarg: cache})
        return out.logits[:, -1, :].float()

    def _sample(self, rows: list[Row], logits) -> tuple[list[Row], list[int]]:
        """Append one token to each row; returns (finished rows, batch indices of the others)."""
        picks = pick_tokens(logits, [r.sp for r in rows], [r.gen for r in rows])
        done, keep = [], []
        for i, (row, (tok, logp)) in enumerate(zip(rows, picks)):
            row.tokens.append(tok)
            row.logps.append(logp)
            if tok in row.stops:
                row.finish = "stop"
            elif len(row.tokens) >= row.limit:
                row.finish = "length"
            if row.finish:
                done.append(row)
            else:
                keep.append(i)
        return done, keep

    # -- batch state ------------------------------------------------------------

    def _kept(self, cache, mask, next_pos, rows: list[Row], keep: list[int]):
        """(cache, mask, positions, input ids, rows) of the rows in `keep` after a sample: the
        sampled token is the next input, so the mask gains a column."""
        import torch

        if len(keep) < len(rows):
            idx = torch.tensor(keep, dtype=torch.long, device=self.b.device)
            cache.batch_select_indices(idx)
            mask, next_pos = mask[idx], next_pos[idx]
        kept = [rows[r] for r in keep]
        return cache, self._one_more_column(mask), next_pos, self._last_tokens(kept), kept

    def _merge(self, cache, mask, pos, next_ids, rows: list[Row]) -> None:
        """Join freshly prefilled rows to the batch: left-pad the narrower side, concatenate rows."""
        import torch

        if not self.rows:
            self.cache, self.mask, self.pos, self.next_ids, self.rows = cache, mask, pos, next_ids, rows
            self.mergeable = _plain_layers(cache)
            return
        width = max(self.mask.shape[1], mask.shape[1])
        self._pad_left(self.cache, width - self.mask.shape[1])
        self._pad_left(cache, width - mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([mine.keys, theirs.keys])
            mine.values = torch.cat([mine.values, theirs.values])
        self.mask = torch.cat([_left(self.mask, width), _left(mask, width)])
        self.pos = torch.cat([self.pos, pos])
        self.next_ids = torch.cat([self.next_ids, next_ids])
        self.rows = self.rows + rows

    def _pad_left(self, cache, n: int) -> None:
        import torch.nn.functional as F

        if n:
            for layer in cache.layers:
                layer.keys = F.pad(layer.keys, (0, 0, n, 0))
                layer.values = F.pad(layer.values, (0, 0, n, 0))

    def _crop(self) -> None:
        """Drop the leading cache columns that every row masks out."""
        live = self.mask.any(dim=0).nonzero()
        start = int(live[0]) if len(live) else 0
        if start and self.mergeable:
            self.mask = self.mask[:, start:]
            for layer in self.cache.layers:
                layer.keys = layer.keys[..., start:, :]
                layer.values = layer.values[..., start:, :]

    def _last_tokens(self, rows: list[Row]):
        import torch

        return torch.tensor([[r.tokens[-1]] for r in rows], dtype=torch.long, device=self.b.device)

    @staticmethod
    def _one_more_column(mask):
        import torch

        return torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)

    def _drop_cancelled(self) -> None:
        import torch

        if any(r.cancelled for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if not r.cancelled)
        keep = [i for i, r in enumerate(self.rows) if not r.cancelled]
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.cache = [], None
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.b.device)
        self.cache.batch_select_indices(idx)
        self.mask, self.pos, self.next_ids = self.mask[idx], self.pos[idx], self.next_ids[idx]
        self.rows = [self.rows[i] for i in keep]
        self._crop()


def cache_kwarg(model) -> str:
    """The forward's KV-cache argument: `cache` from transformers 5.2x, `past_key_values` before. Either
    way, an unknown keyword is swallowed by `**kwargs` and decoding would silently recompute nothing."""
    import inspect

    params = inspect.signature(model.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise TypeError(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`")


def _left(mask, width: int):
    """`mask` left-padded with zeros to `width` columns."""
    import torch.nn.functional as F

    return F.pad(mask, (width - mask.shape[1], 0))


def _left_kv(t, like, width: int):
    """A row's cached keys or values ([1, kv_heads, n, head_dim]) left-padded with zeros to `width`
    columns; zeros of `like`'s shape for a row with nothing cached."""
    import torch.nn.functional as F

    if t is None:
        return like.new_zeros((1, like.shape[1], width, like.shape[3]))
    return F.pad(t, (0, 0, width - t.shape[2], 0))


def _plain_layers(cache) -> bool:
    """Whether every cache layer is a plain growing one (no sliding window), which merging needs."""
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in cache.layers)


class Engine:
    """`agenerate_one` for many concurrent callers over one Scheduler, and safe weight loads."""

    def __init__(self, backend: HFBackend, max_rows: int = 256):
        self.backend, self.sched, self.gate = backend, Scheduler(backend, max_rows), WeightGate()
        self._new: list[Row] = []  # admitted at the next step
        self._live: set[Row] = set()  # rows whose caller is waiting
        self._driving = False

    async def agenerate_one(self, prompt: list[int], sp: SamplingParams, slot: int = 0) -> GenOutput:
        """Generate one completion (with the adapter of `slot`); concurrent calls are decoded together."""
        problem = self.backend._request_error(prompt, sp)
        if problem:
            return GenOutput([], [], "error", problem, self.backend.versions[slot])
        async with self.gate.request():
            row = self.sched.new_row(prompt, sp, slot)
            row.wake = anyio.Event()
            self._new.append(row)
            self._live.add(row)
            try:
                while row.finish is None:
                    if not self._driving:
                        await self._drive(row)
                    else:
                        await row.wake.wait()
                        row.wake = anyio.Event()
            except BaseException:
                row.cancelled = True
                raise
            finally:
                self._live.discard(row)
                self._hand_over()
        return row.output()

    async def _drive(self, mine: Row) -> None:
        """Step the scheduler for everyone until `mine` finishes (or this caller is cancelled)."""
        self._driving = True
        try:
            while mine.finish is None and not mine.cancelled:
                new, self._new = self._new, []
                with anyio.CancelScope(shield=True):  # a step always completes: the batch stays consistent
                    try:
                        await anyio.to_thread.run_sync(self.sched.step, new)
                    except Exception as e:  # noqa: BLE001 - policy: the rows in flight get error replies
                        log.exception("hf decoding step failed; failing the %d requests in flight", len(self._live))
                        self.sched.fail_all(f"hf backend: {type(e).__name__}: {e}")
                for r in self._live:
                    if r.finish is not None:
                        r.wake.set()
        finally:
            self._driving = False

    def _hand_over(self) -> None:
        """If nobody drives, wake one waiting caller to do it."""
        if self._driving:
            return
        for r in self._live:
            if r.finish is None:
                r.wake.set()
                return

    async def aload_weights(self, path, sha256: str | None = None, version: int | None = None,
                            slot: int = 0) -> None:
        """Load weights (of `slot`) once no request is in flight; requests arriving meanwhile wait, none is
        dropped. With several slots the requests of every slot wait: the load is a few milliseconds' swap
        of one adapter, and a row never sees two versions of its slot."""
        async with self.gate.exclusive():
            await anyio.to_thread.run_sync(self.backend.load_weights, path, sha256, version, slot)

