"""The inference backend contract, and what every engine shares: token ids in, token ids + logprobs out.

What it is: `Backend`, what the inference worker (`jet.workers.inference.worker`) needs of an engine
(`hf`: transformers with our own scheduler, `jet.workers.inference.hf` and `.hf_engine`; `vllm`:
`jet.workers.inference.vllm`); `SamplingParams` and `GenOutput`, the request and result of one
completion; `request_error`, the checks every backend applies before decoding; `Slotted` and
`SlotView`, several adapter models of one base as one backend each; `check_sha256` and `version_in`,
a weight load's first check and the weight version a published folder's name carries. Engines import
this module and never each other's names.

Invariants of every backend:
- Logprobs are what the trainer recomputes: for each sampled token, its logprob under the distribution
  it was drawn from, the temperature-scaled softmax renormalised over the top-p nucleus, in float32
  (`jet.sampling` defines it). Temperature 0 means greedy; its logprob is then under temperature 1.
- A stop token (the request's stop ids plus the model's EOS ids) ends a request with finish_reason
  "stop" and IS included in token_ids; reaching max_tokens (clipped to the context left) ends it with
  "length".
- A bad request yields finish_reason "error" with a message, never an exception.

What it is not: an engine (the hf engine's sampling step is `jet.workers.inference.hf_engine.pick_tokens`);
no Redis.
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


def version_in(file: Path, default: int) -> int:
    """The N of the innermost `v<N>` folder holding `file` (a published weight version), else `default`."""
    for part in reversed(file.parts[:-1]):
        match = re.fullmatch(r"v(\d+)", part)
        if match:
            return int(match.group(1))
    return default
