"""The `hf` inference backend: a transformers causal LM (CPU or GPU), token ids in, token ids + logprobs out.

What it is: `HFBackend`, the public face of the hf engine. It owns the model and what depends on its
weights: the weight version of each model it serves and their loads (`load_weights`: full weights
copied in, or an adapter version applied by `jet.workers.inference.served_adapters`), the prefix cache
of each model (`jet.workers.inference.prefix_cache`, emptied by each of that model's loads), and the
forward itself (`forward`: each row's adapter, the KV-cache argument of the installed transformers).
Decoding is the engine's (`jet.workers.inference.hf_engine`: the scheduler, the sampling, continuous
batching), reached through three calls: `generate(prompts, params)` decodes a batch to the end,
`await agenerate_one(prompt, params)` decodes each call together with the others in flight, and
`await aload_weights(...)` loads between them without dropping any.

One model: an adapter version is merged into the weights it updates. Several models on one base
(`slots` > 1: a team whose models are adapters of one base, `jet.config.serving_groups`): one copy of
the base, each slot's adapter added row by row, never merged; each slot has its own version and its
own prefix cache of its own size (keys and values depend on the adapter), and loads adapter versions
only. `view(slot)` is one model of them as the worker drives it (`SlotView`).

What it is not: the scheduler or the sampler (`hf_engine`), nor a server: no Redis; the sync API is not
thread-safe, and is not to be mixed with the async one while async calls are in flight.

Invariants: those of every backend (`jet.workers.inference.backend`: logprobs, stops, error replies)
and of the engine (`hf_engine`: batch invariance); a load changes nothing unless every tensor checks
(hash, names, shapes), and a full-weights version after adapter versions replaces all.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from jet import adapters
from jet.errors import WeightsError
from jet.wire import WEIGHTS_FILE
from jet.workers.inference import hf_engine
from jet.workers.inference.backend import GenOutput, SamplingParams, Slotted, check_sha256, version_in
from jet.workers.inference.prefix_cache import PrefixCache
from jet.workers.inference.served_adapters import MergedAdapter, RowAdapters

if TYPE_CHECKING:
    import torch


class HFBackend(Slotted):
    """A transformers causal LM with a hand-written scheduler and sampling loop (`hf_engine`)."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", dtype: str | torch.dtype = "float32",
                 max_inflight: int = 256, prefix_cache_mb: float | Sequence[float] = 1024, slots: int = 1):
        """`prefix_cache_mb`: each model's prefix cache (MiB), one size for every slot or one per slot."""
        import torch
        from transformers import AutoModelForCausalLM

        sizes = list(prefix_cache_mb) if isinstance(prefix_cache_mb, Sequence) else [prefix_cache_mb] * slots
        if len(sizes) != slots:
            raise ValueError(f"{len(sizes)} prefix cache sizes for {slots} slots")
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype).to(self.device).eval()
        config, gen = self.model.config, self.model.generation_config
        eos = gen.eos_token_id if gen is not None and gen.eos_token_id is not None else config.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else next(iter(self.eos_ids), 0)
        self.vocab_size = config.vocab_size
        self.versions = [0] * slots  # the weight version each slot serves
        self.max_inflight = max_inflight  # rows decoded together by the async API
        self.prefix_caches = [PrefixCache(int(mb * 2**20)) for mb in sizes]  # emptied by each load of the slot
        self.adapters = RowAdapters(self.model, slots) if slots > 1 else MergedAdapter(self.model)
        self.cache_kwarg = cache_kwarg(self.model)
        self._engine: hf_engine.Engine | None = None

    @property
    def prefix_cache(self) -> PrefixCache:
        return self.prefix_caches[0]

    @property
    def context_length(self) -> int:
        """Prompt plus completion tokens the model can attend to."""
        return self.model.config.max_position_embeddings

    # -- decoding: the engine's ----------------------------------------------------

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 slots: list[int] | None = None) -> list[GenOutput]:
        """Complete every prompt (each with the adapter of its slot in `slots`, default 0), batch-synchronously;
        outputs are in request order, one per prompt."""
        return hf_engine.generate(self, prompts, params, slots)

    async def agenerate_one(self, prompt: list[int], sp: SamplingParams, slot: int = 0) -> GenOutput:
        """One completion, decoded together with the other calls in flight."""
        return await self.engine.agenerate_one(prompt, sp, slot)

    async def aload_weights(self, path: str | Path, sha256: str | None = None, version: int | None = None,
                            slot: int = 0) -> None:
        """`load_weights` once the requests in flight have finished; new ones wait meanwhile."""
        await self.engine.aload_weights(path, sha256, version, slot)

    @property
    def engine(self) -> hf_engine.Engine:
        """The continuous-batching engine of the async API (created on first use)."""
        if self._engine is None:
            self._engine = hf_engine.Engine(self, self.max_inflight)
        return self._engine

    # -- what the engine calls (`hf_engine.LM`) --------------------------------------

    def new_cache(self):
        """An empty KV cache for this model."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def forward(self, ids, mask, pos, cache, slots: list[int]):
        """The next-token logits (float32, [rows, vocab]) of a batch: row r is `ids[r]` (with its attention
        `mask` and explicit positions `pos`) of the model of slot `slots[r]`, after what `cache` holds
        (extended in place)."""
        self.adapters.select(slots, ids.device)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{self.cache_kwarg: cache})
        return out.logits[:, -1, :].float()

    def load_weights(self, path: str | Path, sha256: str | None = None, version: int | None = None,
                     slot: int = 0) -> None:
        """Load a published version into the live model: an adapter version (a `jet.adapters` folder) into
        `slot`, else a safetensors file (or a dir holding model.safetensors), the whole model.

        The file's sha256 is checked when given. Nothing changes unless every tensor's name and shape
        fit the model. The new version is `version`, else the N of a `v<N>` directory in the path, else
        the old version + 1. With several slots, only adapter versions load.
        """
        if not 0 <= slot < len(self.versions):
            raise ValueError(f"slot {slot}: this backend serves slots 0..{len(self.versions) - 1}")
        if adapters.is_adapter(path):
            return self._load_adapter(Path(path), sha256, version, slot)
        if len(self.versions) > 1:
            raise WeightsError(f"{path}: not an adapter version ({adapters.ADAPTER_FILE}); this worker serves "
                               f"{len(self.versions)} models on one base and loads their adapters only")
        self._load_full(Path(path), sha256, version)

    def keep_base_of(self, targets: list[str] | str) -> int:
        """A backend of one model: keep, now, the base's own values of the weights adapter versions of
        `targets` will update (`MergedAdapter.keep_base_of`). Returns the bytes kept."""
        if not isinstance(self.adapters, MergedAdapter):
            raise ValueError("keep_base_of: a backend of several models never merges adapters into the base")
        return self.adapters.keep_base_of(targets)

    # -- the two kinds of version ----------------------------------------------------

    def _load_adapter(self, folder: Path, sha256: str | None, version: int | None, slot: int) -> None:
        file = folder / adapters.ADAPTER_FILE
        check_sha256(file, sha256)
        try:
            self.adapters.set(slot, adapters.read(folder))
        except adapters.AdapterError as e:
            raise WeightsError(str(e)) from e
        self.prefix_caches[slot].clear()  # keys and values of the old adapter
        self.versions[slot] = version if version is not None else version_in(file, default=self.versions[slot] + 1)

    def _load_full(self, file: Path, sha256: str | None, version: int | None) -> None:
        import torch
        from safetensors.torch import load_file

        file = file / WEIGHTS_FILE if file.is_dir() else file
        if not file.is_file():
            raise WeightsError(f"no weights file at {file}")
        check_sha256(file, sha256)
        try:
            state = load_file(str(file), device="cpu")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own types (SafetensorError, ...)
            raise WeightsError(f"{file} is not a readable safetensors file: {type(e).__name__}: {e}") from e
        live = self.model.state_dict()
        _check_state(state, live, file)
        with torch.no_grad():
            for name, tensor in state.items():
                live[name].copy_(tensor)
        self.adapters.forget()
        self.prefix_cache.clear()  # keys and values of the old weights
        self.version = version if version is not None else version_in(file, default=self.version + 1)


def _check_state(state: dict, live: dict, file: Path) -> None:
    """WeightsError unless `state` names and shapes every tensor of the model `live` (tied ones once)."""
    unexpected = sorted(set(state) - set(live))
    if unexpected:
        raise WeightsError(f"{file}: tensors the model does not have: {unexpected[:5]}")
    groups: dict[int, list[str]] = {}  # tied tensors (one storage under several names) need one name present
    for name, tensor in live.items():
        groups.setdefault(tensor.data_ptr(), []).append(name)
    missing = [names[0] for names in groups.values() if not any(n in state for n in names)]
    if missing:
        raise WeightsError(f"{file}: missing tensors: {missing[:5]}")
    wrong = [f"{k} {tuple(v.shape)}, model {tuple(live[k].shape)}"
             for k, v in state.items() if v.shape != live[k].shape]
    if wrong:
        raise WeightsError(f"{file}: shape mismatch: {wrong[:5]}")


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
