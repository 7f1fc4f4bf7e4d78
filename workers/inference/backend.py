"""The inference backend contract, and what every engine shares: token ids in, token ids + logprobs out.

What it is: `Backend`, what the inference worker (`jet.workers.inference.worker`) needs of an engine
(`hf`: transformers with our own scheduler, `jet.workers.inference.hf` and `.hf_engine`; `vllm`:
`jet.workers.inference.vllm`); `SamplingParams` and `GenOutput`, the request and result of one
completion; `request_error`, the checks every backend applies before decoding; the sampling step of
the hf engine (`pick_tokens`, one seeded `generator` per request); and `version_in`, the weight version a
published folder's name carries. Engines import this module and never each other's names.

Invariants of every backend:
- Logprobs are what the trainer recomputes: for each sampled token, its logprob under the distribution
  it was drawn from, the temperature-scaled softmax renormalised over the top-p nucleus, in float32
  (`jet.sampling` defines it). Temperature 0 means greedy; its logprob is then under temperature 1.
- A stop token (the request's stop ids plus the model's EOS ids) ends a request with finish_reason
  "stop" and IS included in token_ids; reaching max_tokens (clipped to the context left) ends it with
  "length".
- A bad request yields finish_reason "error" with a message, never an exception.

What it is not: an engine; no Redis.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from jet import sampling


@dataclass(frozen=True, slots=True)
class SamplingParams:
    # the settings of the distribution (`jet.sampling.PARAMS`: one field each, checked by `request_error`)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    max_tokens: int = 256  # new tokens at most; clipped to the context left
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS ids
    seed: int | None = None  # None = fresh entropy


@dataclass(frozen=True, slots=True)
class GenOutput:
    token_ids: list[int]
    logprobs: list[float]  # one per token, see the module docstring
    finish_reason: Literal["stop", "length", "error"]
    error: str | None  # set when finish_reason == "error"
    version: int  # weight version the tokens were sampled with


class Backend(Protocol):
    """An inference engine as the worker drives it (both implementations: `HFBackend`, `VLLMBackend`)."""

    version: int  # the weight version being served

    @property
    def context_length(self) -> int: ...

    async def agenerate_one(self, prompt: list[int], sp: SamplingParams) -> GenOutput:
        """One completion, decoded together with the other calls in flight (continuous batching)."""

    async def aload_weights(self, path: str | Path, sha256: str | None = None, version: int | None = None) -> None:
        """Load published weights once the requests in flight have finished; new ones wait meanwhile."""


class Slotted:
    """What both backends share for several adapter models on one base: a weight version per slot
    (`versions`; `version` is slot 0's, the only one otherwise) and `view(slot)`, one model as a backend."""

    versions: list[int]

    @property
    def version(self) -> int:
        return self.versions[0]

    @version.setter
    def version(self, v: int) -> None:
        self.versions[0] = v

    def view(self, slot: int) -> SlotView:
        """Slot `slot` as a backend of its own (the worker serves each model of a shared base through one)."""
        return SlotView(self, slot)


class SlotView:
    """One model of a backend serving several adapter models on one base (`slots` > 1), as the inference
    worker drives a backend: its own version, prefix cache (hf) and weight loads."""

    def __init__(self, backend, slot: int):
        self.backend, self.slot = backend, slot

    @property
    def version(self) -> int:
        return self.backend.versions[self.slot]

    @property
    def context_length(self) -> int:
        return self.backend.context_length

    @property
    def prefix_cache(self):
        caches = getattr(self.backend, "prefix_caches", None)
        return caches[self.slot] if caches else None

    async def agenerate_one(self, prompt: list[int], sp: SamplingParams) -> GenOutput:
        return await self.backend.agenerate_one(prompt, sp, self.slot)

    async def aload_weights(self, path: str | Path, sha256: str | None = None, version: int | None = None) -> None:
        await self.backend.aload_weights(path, sha256, version, self.slot)


def check_sha256(file: Path, sha256: str | None) -> None:
    """WeightsError unless `file` hashes to `sha256` (nothing to check when None): every weight load's first check."""
    from jet.errors import WeightsError
    from jet.wire import file_sha256

    if sha256 is not None and (digest := file_sha256(file)) != sha256.lower():
        raise WeightsError(f"sha256 mismatch for {file}: expected {sha256}, file has {digest}")


def request_error(prompt: list[int], sp: SamplingParams, context_length: int, vocab_size: int) -> str | None:
    """Why a request cannot be served by any backend (None when it can)."""
    if not prompt:
        return "empty prompt"
    if len(prompt) >= context_length:
        return (f"prompt of {len(prompt)} tokens leaves no room in the model's context of "
                f"{context_length} tokens")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        return f"prompt has token ids outside the vocabulary [0, {vocab_size})"
    bad = sampling.errors(sp)
    if bad:
        return bad
    if sp.max_tokens < 1:
        return f"max_tokens must be >= 1, got {sp.max_tokens}"
    return None


def pick_tokens(logits, params: list[SamplingParams], gens: list) -> list[tuple[int, float]]:
    """One (token id, logprob) per row of `logits` (float32, [rows, vocab]): the sampling math of
    both APIs (see the module docstring for what the logprob is: `jet.sampling`)."""
    import torch

    settings = sampling.table([sampling.drawn_with(sp) for sp in params], device=logits.device)
    logp = sampling.transformed(logits, settings)
    kept = sampling.support(logp, settings)
    picks = [_sample(logits[r], logp[r], sp, gen, kept[r]) for r, (sp, gen) in enumerate(zip(params, gens))]
    picked = torch.tensor(picks, device=logits.device)
    reported = sampling.renormalised(logp, picked, sampling.narrowed(settings), kept).tolist()
    return list(zip(picks, reported))


def _sample(logits, logp, sp: SamplingParams, gen, kept=None) -> int:
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


def version_in(file: Path, default: int) -> int:
    """The N of the innermost `v<N>` folder holding `file` (a published weight version), else `default`."""
    for part in reversed(file.parts[:-1]):
        match = re.fullmatch(r"v(\d+)", part)
        if match:
            return int(match.group(1))
    return default
