"""The hf engine: continuous batching and sampling on a transformers model, token ids in, token ids + logprobs out.

What it is, top to bottom: `LM`, all the engine needs of the backend that owns the model
(`jet.workers.inference.hf.HFBackend`, public members only); `Row`, one request being decoded;
`Scheduler`, which keeps every request being decoded as a row of ONE batch with one KV cache: each
`step()` first admits waiting requests (their prompts prefilled together, left-padded, in a cache of
their own, which is then merged into the batch's by left-padding the shorter of the two), then runs
one decoding forward for all rows; a row that stops leaves the batch at once, and cache columns no row
attends to any more are cropped, so the batch never grows wider than its longest live row. `Engine`
puts it behind `await agenerate_one(prompt, params)`: concurrent callers share the steps (one waiting
caller at a time drives them, each step in a worker thread), so requests join and leave between
steps. `generate` (the batch API) is the same scheduler with every request admitted at the first
step. Last, the sampling step both share (`pick_tokens`, one seeded `generator` per request) and the
batch's tensor helpers.

Prefix reuse: admission starts each prompt from the longest head its model's prefix cache holds
(`jet.workers.inference.prefix_cache`): those keys and values, left-padded to one width, go first in
the new rows' cache and only the rest of each prompt is forwarded, at its true positions. Waiting
prompts that share a head nothing cached covers (the members of a GRPO group) get it computed once
first. A row that finishes leaves its prompt and completion in the cache, where the next turn of its
episode finds them. The backend empties a cache at every weight load of its model, so reused keys and
values always come from the weights serving the row.

Several models on one base (the backend's slots): each row carries its slot and the backend's forward
applies each row's adapter, so rows of different models share a batch; prefix reuse stays within a
slot (its own cache: keys and values depend on the adapter), and so do shared heads.

Weight loads: `Engine.aload_weights` passes `jet.workers.inference.gate.WeightGate`: it holds new
requests back, waits for the rows in flight to finish, loads, and lets the held requests in (pause
admission, drain, load, resume). So a request's tokens all come from one weight version, the one its
output names.

What it is not: a server or a queue reader (`jet.workers.inference.worker`), nor the owner of the
weights (`HFBackend`), nor the definition of a logprob (`jet.sampling`).

Invariants:
- Logprobs are what the trainer recomputes: for each sampled token, its logprob under the distribution
  it was drawn from, the temperature-scaled softmax renormalised over the top-p nucleus, in float32
  (`jet.sampling` defines it and finds the nucleus; both sides call it). Temperature 0 means greedy
  (argmax); its logprob is then under temperature 1 (informational: greedy tokens are never trained).
- Batch invariance: padding is never attended (mask 0) and positions are explicit per row, so a row's
  logits do not depend on its batch neighbours (nor on whether its head came from the prefix cache)
  beyond float noise; each request owns a torch.Generator seeded with its seed and draws exactly one
  uniform number per sampled token, and sampling inverts the CDF in token-id order (top-p only decides
  which ids are kept, row by row). So a request samples the same tokens alone or in any batch, up to
  float noise in the logits at a CDF boundary; greedy matches exactly.
- A stop token (the request's stop ids plus the model's EOS ids) ends the request with finish_reason
  "stop" and IS included in token_ids with its logprob; reaching max_tokens (clipped to the context
  left after the prompt) ends it with "length". Finished rows leave the batch; a cancelled caller's
  row is dropped at the next step.
- A bad request (`jet.workers.inference.backend.request_error`) gets finish_reason "error" with a
  message, never an exception, and does not disturb the others. A step that raises (out of memory,
  say) ends every request in the scheduler with an error reply and the next step starts from an empty
  batch: never a crash, never a hang.
- Models whose cache has sliding-window layers are served without merging: new requests wait until
  the batch is empty (batch-synchronous, still correct).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import anyio

from jet import sampling
from jet.workers.inference.backend import GenOutput, SamplingParams, request_error
from jet.workers.inference.gate import WeightGate
from jet.workers.inference.prefix_cache import PrefixCache, shared_heads

if TYPE_CHECKING:
    from pathlib import Path

    import torch

log = logging.getLogger(__name__)

SHARED_MIN_TOKENS = 16  # a head several waiting prompts share is prefilled once from this length on


class LM(Protocol):
    """The model as the engine decodes with it: what `jet.workers.inference.hf.HFBackend` offers it."""

    device: torch.device
    pad_id: int  # the id under the left padding (never attended)
    eos_ids: frozenset[int]  # stop every request
    vocab_size: int
    versions: list[int]  # the weight version each slot serves
    prefix_caches: list[PrefixCache]  # one per slot

    @property
    def context_length(self) -> int: ...

    def new_cache(self): ...  # an empty KV cache

    def forward(self, ids, mask, pos, cache, slots: list[int]) -> torch.Tensor: ...  # next-token logits

    def load_weights(self, path: str | Path, sha256: str | None, version: int | None, slot: int) -> None: ...


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

    def __init__(self, lm: LM, max_rows: int = 256):
        self.lm, self.max_rows = lm, max_rows
        self.waiting: deque[Row] = deque()
        self.rows: list[Row] = []  # batch order: row r of cache / mask / pos / next_ids
        self.cache = self.mask = self.pos = self.next_ids = None
        self.mergeable = True  # False once a sliding-window cache layer is seen
        self.forwards = 0  # model calls so far (prefills + decoding steps)
        self.peak_rows = 0  # most rows decoded in one step

    def new_row(self, prompt: list[int], sp: SamplingParams, slot: int = 0) -> Row:
        """A row for a request without a `refusal`."""
        limit = min(sp.max_tokens, self.lm.context_length - len(prompt))
        return Row(list(prompt), sp, limit, self.lm.eos_ids | frozenset(sp.stop_token_ids), generator(sp.seed),
                   self.lm.versions[slot], slot=slot)

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
        """Prefill the fresh rows' prompts (each from the longest head its prefix cache holds) and sample
        their first tokens."""
        import torch

        caches = self.lm.prefix_caches  # one per slot
        reuse = self.mergeable  # (a sliding-window cache is neither merged nor reused)
        hits = [caches[r.slot].match(r.prompt) if reuse else (None, 0) for r in fresh]
        for slot in sorted({r.slot for r in fresh if caches[r.slot].enabled}) if reuse else ():
            mine = [i for i, r in enumerate(fresh) if r.slot == slot]
            heads = shared_heads([fresh[i].prompt for i in mine], [hits[i][1] for i in mine], SHARED_MIN_TOKENS)
            if heads:  # several waiting prompts share a head nothing cached covers: compute it once
                self._prefill_heads(heads, slot)
                for i in mine:
                    hits[i] = caches[slot].match(fresh[i].prompt)
        for r, (_, n) in zip(fresh, hits):
            caches[r.slot].stats.prompt_tokens += len(r.prompt)
            caches[r.slot].stats.reused_tokens += n
        ids, mask, pos = left_padded([r.prompt[n:] for r, (_, n) in zip(fresh, hits)], self.lm.pad_id, self.lm.device)
        cache = self.lm.new_cache()
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
        pc = self.lm.prefix_caches[slot]
        ids, mask, pos = left_padded([list(h) for h in heads], self.lm.pad_id, self.lm.device)
        cache = self.lm.new_cache()
        self._forward(ids, mask, pos, cache, [slot] * len(heads))
        self.mergeable = _plain_layers(cache)
        if self.mergeable:
            for i, head in enumerate(heads):
                pc.put(head, _row_kv(cache, mask, i))
        pc.stats.shared_prefills += len(heads)

    def _remember(self, cache, mask, rows: list[Row], keep: list[int]) -> None:
        """Put each finished row's prompt and completion (all but the last token, never fed) in its prefix
        cache: the next turn of its episode starts with them."""
        caches = self.lm.prefix_caches
        if len(keep) == len(rows) or not _plain_layers(cache):
            return
        kept = set(keep)
        for i, row in enumerate(rows):
            if i not in kept and row.finish != "error" and caches[row.slot].enabled:
                kv = _row_kv(cache, mask, i)
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
        return self.lm.forward(ids, mask, pos, cache, slots)

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
            idx = torch.tensor(keep, dtype=torch.long, device=self.lm.device)
            cache.batch_select_indices(idx)
            mask, next_pos = mask[idx], next_pos[idx]
        kept = [rows[r] for r in keep]
        last = torch.tensor([[r.tokens[-1]] for r in kept], dtype=torch.long, device=self.lm.device)
        return cache, torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1), next_pos, last, kept

    def _merge(self, cache, mask, pos, next_ids, rows: list[Row]) -> None:
        """Join freshly prefilled rows to the batch: left-pad the narrower side, concatenate rows."""
        import torch

        if not self.rows:
            self.cache, self.mask, self.pos, self.next_ids, self.rows = cache, mask, pos, next_ids, rows
            self.mergeable = _plain_layers(cache)
            return
        width = max(self.mask.shape[1], mask.shape[1])
        _pad_left(self.cache, width - self.mask.shape[1])
        _pad_left(cache, width - mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([mine.keys, theirs.keys])
            mine.values = torch.cat([mine.values, theirs.values])
        self.mask = torch.cat([_left(self.mask, width), _left(mask, width)])
        self.pos = torch.cat([self.pos, pos])
        self.next_ids = torch.cat([self.next_ids, next_ids])
        self.rows = self.rows + rows

    def _crop(self) -> None:
        """Drop the leading cache columns that every row masks out."""
        live = self.mask.any(dim=0).nonzero()
        start = int(live[0]) if len(live) else 0
        if start and self.mergeable:
            self.mask = self.mask[:, start:]
            for layer in self.cache.layers:
                layer.keys = layer.keys[..., start:, :]
                layer.values = layer.values[..., start:, :]

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
        idx = torch.tensor(keep, dtype=torch.long, device=self.lm.device)
        self.cache.batch_select_indices(idx)
        self.mask, self.pos, self.next_ids = self.mask[idx], self.pos[idx], self.next_ids[idx]
        self.rows = [self.rows[i] for i in keep]
        self._crop()


class Engine:
    """`agenerate_one` for many concurrent callers over one Scheduler, and safe weight loads."""

    def __init__(self, lm: LM, max_rows: int = 256):
        self.lm, self.sched, self.gate = lm, Scheduler(lm, max_rows), WeightGate()
        self._new: list[Row] = []  # admitted at the next step
        self._live: set[Row] = set()  # rows whose caller is waiting
        self._driving = False

    async def agenerate_one(self, prompt: list[int], sp: SamplingParams, slot: int = 0) -> GenOutput:
        """Generate one completion (with the adapter of `slot`); concurrent calls are decoded together."""
        problem = refusal(self.lm, prompt, sp)
        if problem:
            return GenOutput([], [], "error", problem, self.lm.versions[slot])
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
            await anyio.to_thread.run_sync(self.lm.load_weights, path, sha256, version, slot)


def generate(lm: LM, prompts: list[list[int]], params: list[SamplingParams],
             slots: list[int] | None = None) -> list[GenOutput]:
    """The batch API: every prompt (of model `slots[i]`, default 0) admitted at the first step of a scheduler
    of its own and decoded to the end; outputs in request order, one per prompt."""
    if len(prompts) != len(params):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    slots = slots or [0] * len(prompts)
    problems = [refusal(lm, prompt, sp) for prompt, sp in zip(prompts, params)]
    outputs = [GenOutput([], [], "error", problem, lm.versions[slot]) if problem else None
               for problem, slot in zip(problems, slots)]
    runnable = [i for i, problem in enumerate(problems) if not problem]
    if runnable:
        sched = Scheduler(lm, max_rows=len(runnable))
        rows = [sched.new_row(prompts[i], params[i], slots[i]) for i in runnable]
        sched.run(rows)
        for i, row in zip(runnable, rows):
            outputs[i] = row.output()
    return outputs


def refusal(lm: LM, prompt: list[int], sp: SamplingParams) -> str | None:
    """Why a request cannot be decoded (None when it can): both APIs answer it with an error reply."""
    return request_error(prompt, sp, lm.context_length, lm.vocab_size)


# -- sampling: one step of every row ------------------------------------------------


def pick_tokens(logits, params: list[SamplingParams], gens: list) -> list[tuple[int, float]]:
    """One (token id, logprob) per row of `logits` (float32, [rows, vocab]): the sampling math of both APIs
    (see the module docstring for what the logprob is: `jet.sampling`)."""
    import torch

    settings = sampling.table([sampling.drawn_with(sp) for sp in params], device=logits.device)
    logp = sampling.transformed(logits, settings)
    kept = sampling.support(logp, settings)
    picks = [sample_row(logits[r], logp[r], sp, gen, kept[r]) for r, (sp, gen) in enumerate(zip(params, gens))]
    picked = torch.tensor(picks, device=logits.device)
    reported = sampling.renormalised(logp, picked, sampling.narrowed(settings), kept).tolist()
    return list(zip(picks, reported))


def sample_row(logits, logp, sp: SamplingParams, gen, kept=None) -> int:
    """One token id from a row of logits; draws exactly one uniform from `gen` unless greedy.

    `logp` is the row's reshaped log-probabilities (`jet.sampling.transformed`) and `kept` its support
    (`jet.sampling.support`), computed here when not given.
    """
    import torch

    if sp.temperature == 0:
        return int(torch.argmax(logits).item())
    u = torch.rand((), generator=gen, dtype=torch.float64).item()
    probs = logp.double().exp()
    if sampling.narrows(sampling.settings_of(sp)):
        if kept is None:
            kept = sampling.support(logp[None], sampling.table([sampling.settings_of(sp)], device=logp.device))[0]
        probs = torch.where(kept, probs, torch.zeros_like(probs))
    cdf = torch.cumsum(probs, dim=0)  # token-id order, so batch noise cannot reorder it
    target = torch.tensor([u], dtype=cdf.dtype, device=cdf.device) * cdf[-1]
    idx = int(torch.searchsorted(cdf, target, right=True).item())
    idx = min(idx, len(cdf) - 1)
    while probs[idx] == 0:  # u * total landed exactly on a boundary before a dropped id
        idx -= 1
    return idx


def generator(seed: int | None):
    """A CPU torch.Generator seeded with `seed` (fresh entropy when None): one per request."""
    import torch

    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


# -- the batch's tensors ---------------------------------------------------------------


def left_padded(prompts: list[list[int]], pad_id: int, device):
    """(ids, attention mask, positions) of `prompts` right-aligned in one batch: padding on the left, masked,
    and each row's positions counted from its first token."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[r, width - len(p):] = 1
    pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), pos.to(device)


def _row_kv(cache, mask, i: int):
    """Row i's keys and values at its unmasked columns, copied: [1, kv_heads, n, head_dim] per layer."""
    cols = mask[i].nonzero().squeeze(1)
    return [(layer.keys[i:i + 1, :, cols].clone(), layer.values[i:i + 1, :, cols].clone()) for layer in cache.layers]


def _pad_left(cache, n: int) -> None:
    import torch.nn.functional as F

    if n:
        for layer in cache.layers:
            layer.keys = F.pad(layer.keys, (0, 0, n, 0))
            layer.values = F.pad(layer.values, (0, 0, n, 0))


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
