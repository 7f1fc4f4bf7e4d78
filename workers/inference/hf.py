"""The `hf` inference backend: token ids in, token ids + logprobs out.

What it is: pure compute on a transformers causal LM (CPU or GPU). Prompts are
batched with LEFT padding, an attention mask and explicit position ids, and
decoded token by token with a KV cache by the scheduler of
`jet.workers.inference.hf_engine`, and sampled here (`pick_tokens`), so sampling is
ours: temperature, top-p, per-request seeds, max_tokens and stop ids.

`generate(prompts, params)` decodes a batch to the end (batch-synchronous);
`await agenerate_one(prompt, params)` decodes each call together with the
others in flight, joining and leaving between steps (continuous batching,
`jet.workers.inference.hf_engine`), and `await aload_weights(...)` loads between them
without dropping any. Both run the same scheduler and the same sampling math, and
share one prefix cache (`jet.workers.inference.prefix_cache`): a prompt that starts
with tokens already computed (a group's shared prompt, an episode's earlier turns)
prefills only the rest.

A LoRA adapter version (a folder of `jet.adapters` files, what a trainer with
`models[].adapter` publishes) is merged into the weights it updates: the base's
own values of those weights are kept aside the first time (a copy of the adapted
layers only), and each version sets them to base + its update, so versions never
accumulate rounding. A full-weights version after adapter versions replaces all.

Several models on one base (`slots` > 1: a team whose models are adapters of one
base, `jet.config.serving_groups`): one copy of the base, and each slot's adapter
added row by row (`jet.workers.inference.lora`), never merged; each slot has its
own version and its own prefix cache (keys and values depend on the adapter), and
loads adapter versions only. `view(slot)` is one model of them as the worker
drives it (`SlotView`).

What it is not: a server. No Redis; the sync API is not thread-safe, and is not
to be mixed with the async one while async calls are in flight.

Invariants:
- Logprobs are what the trainer recomputes: for each sampled token, its
  logprob under the distribution it was drawn from, the temperature-scaled
  softmax renormalised over the top-p nucleus, in float32 (`jet.sampling`
  defines it and finds the nucleus; both sides call it). Temperature 0 means
  greedy (argmax); its logprob is then under temperature 1,
  log_softmax(logits)[token] (informational: greedy tokens are never trained).
- Batch invariance: each request owns a torch.Generator seeded with its seed
  and draws exactly one uniform number per sampled token, and sampling inverts
  the CDF in token-id order (top-p only decides which ids are kept, row by row). So a
  request samples the same tokens alone or in any batch, up to float noise in
  the logits at a CDF boundary; greedy matches exactly.
- A stop token (the request's stop ids plus the generation config's EOS ids)
  ends the request with finish_reason "stop" and IS included in token_ids
  with its logprob; reaching max_tokens (clipped to the context left after the
  prompt) ends it with "length". Finished rows leave the batch.
- A bad request (empty or over-long prompt, ids out of vocabulary, invalid
  sampling params) yields finish_reason "error" with a message, never an
  exception, and does not disturb the other requests of the batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from jet.errors import WeightsError
from jet.wire import WEIGHTS_FILE
from jet.workers.inference.backend import (GenOutput, SamplingParams, Slotted, check_sha256, request_error,
                                           version_in)
from jet.workers.inference.prefix_cache import PrefixCache

if TYPE_CHECKING:
    import torch



class HFBackend(Slotted):
    """A transformers causal LM with a hand-written sampling loop."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", dtype: str | torch.dtype = "float32",
                 max_inflight: int = 256, prefix_cache_mb: float = 1024, slots: int = 1):
        import torch
        from transformers import AutoModelForCausalLM

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
        self.prefix_caches = [PrefixCache(int(prefix_cache_mb * 2**20 / slots)) for _ in range(slots)]  # emptied
        # by each load of the slot's weights
        self.base_of_adapted: dict[str, torch.Tensor] = {}  # the base's own values of the weights an adapter updates
        self.lora = None
        if slots > 1:
            from jet.workers.inference.lora import RowLoRA

            self.lora = RowLoRA(self.model, slots)
        self._engine = None

    @property
    def prefix_cache(self) -> PrefixCache:
        return self.prefix_caches[0]

    @property
    def context_length(self) -> int:
        """Prompt plus completion tokens the model can attend to."""
        return self.model.config.max_position_embeddings

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 slots: list[int] | None = None) -> list[GenOutput]:
        """Complete every prompt (each with the adapter of its slot in `slots`, default 0); outputs are in
        request order, one per prompt."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        slots = slots or [0] * len(prompts)
        outputs: list[GenOutput | None] = [None] * len(prompts)
        runnable = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            problem = self._request_error(prompt, sp)
            if problem:
                outputs[i] = GenOutput([], [], "error", problem, self.versions[slots[i]])
            else:
                runnable.append(i)
        if runnable:
            from jet.workers.inference.hf_engine import Scheduler

            sched = Scheduler(self, max_rows=len(runnable))
            rows = [sched.new_row(prompts[i], params[i], slots[i]) for i in runnable]
            sched.run(rows)
            for i, row in zip(runnable, rows):
                outputs[i] = row.output()
        return outputs

    async def agenerate_one(self, prompt: list[int], sp: SamplingParams, slot: int = 0) -> GenOutput:
        """One completion, decoded together with the other calls in flight (`jet.workers.inference.hf_engine`)."""
        return await self.engine.agenerate_one(prompt, sp, slot)

    async def aload_weights(self, path: str | Path, sha256: str | None = None, version: int | None = None,
                            slot: int = 0) -> None:
        """`load_weights` once the requests in flight have finished; new ones wait meanwhile."""
        await self.engine.aload_weights(path, sha256, version, slot)

    @property
    def engine(self):
        """The continuous-batching engine of the async API (created on first use)."""
        if self._engine is None:
            from jet.workers.inference.hf_engine import Engine

            self._engine = Engine(self, self.max_inflight)
        return self._engine

    def _request_error(self, prompt: list[int], sp: SamplingParams) -> str | None:
        return request_error(prompt, sp, self.context_length, self.vocab_size)

    def _left_pad(self, prompts: list[list[int]]):
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p):] = 1
        pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
        return ids.to(self.device), mask.to(self.device), pos.to(self.device)

    def load_weights(self, path: str | Path, sha256: str | None = None, version: int | None = None,
                     slot: int = 0) -> None:
        """Load a safetensors file (or a dir holding model.safetensors) into the live model.

        The file's sha256 is checked when given. Nothing is copied unless every
        tensor's name and shape match the model. The new version is `version`,
        else the N of a `v<N>` directory in the path, else the old version + 1.
        With several slots, only adapter versions load, each into its `slot`.
        """
        import torch
        from safetensors.torch import load_file

        from jet import adapters

        if self.lora is not None:
            if not adapters.is_adapter(path):
                raise WeightsError(f"{path}: not an adapter version ({adapters.ADAPTER_FILE}); this worker serves "
                                   f"{len(self.versions)} models on one base and loads their adapters only")
            return self._load_row_adapter(Path(path), sha256, version, slot)
        if adapters.is_adapter(path):
            return self._load_adapter(Path(path), sha256, version)
        file = Path(path)
        file = file / WEIGHTS_FILE if file.is_dir() else file
        if not file.is_file():
            raise WeightsError(f"no weights file at {file}")
        check_sha256(file, sha256)
        try:
            state = load_file(str(file), device="cpu")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own types (SafetensorError, ...)
            raise WeightsError(f"{file} is not a readable safetensors file: {type(e).__name__}: {e}") from e
        live = self.model.state_dict()
        self._check_state(state, live, file)
        with torch.no_grad():
            for name, tensor in state.items():
                live[name].copy_(tensor)
        self.base_of_adapted = {}  # full weights: no base to return to
        self.prefix_cache.clear()  # keys and values of the old weights
        self.version = version if version is not None else version_in(file, default=self.version + 1)

    def _load_adapter(self, folder: Path, sha256: str | None, version: int | None) -> None:
        """An adapter version: the adapted weights set to the base's + its update; nothing changes unless
        every tensor checks (hash, names, shapes)."""
        import torch

        from jet import adapters

        file = folder / adapters.ADAPTER_FILE
        check_sha256(file, sha256)
        live = self.model.state_dict()
        try:
            adapter = adapters.read(folder)
            todo = adapters.updates(adapter, {name: tensor.shape for name, tensor in live.items()})
        except adapters.AdapterError as e:
            raise WeightsError(str(e)) from e
        adapted = {name for name, _, _ in todo}
        with torch.no_grad():  # layer by layer: no copy of the whole model is ever allocated at once
            for name in set(self.base_of_adapted) - adapted:  # adapted before, not by this version
                live[name].copy_(self.base_of_adapted.pop(name))
            for name, a, b in todo:
                if name not in self.base_of_adapted:
                    self.base_of_adapted[name] = live[name].detach().clone()
                live[name].copy_(adapters.merged_weight(self.base_of_adapted[name], a, b, adapter.scale))
        self.prefix_cache.clear()
        self.version = version if version is not None else version_in(file, default=self.version + 1)

    def _load_row_adapter(self, folder: Path, sha256: str | None, version: int | None, slot: int) -> None:
        """An adapter version for one slot of a shared base: held beside the base, added row by row."""
        from jet import adapters

        file = folder / adapters.ADAPTER_FILE
        check_sha256(file, sha256)
        try:
            self.lora.set(slot, adapters.read(folder))
        except adapters.AdapterError as e:
            raise WeightsError(str(e)) from e
        self.prefix_caches[slot].clear()
        self.versions[slot] = version if version is not None else version_in(file, default=self.versions[slot] + 1)

    def keep_base_of(self, targets: list[str] | str) -> int:
        """Keep the base's own values of the weights adapter versions of `targets` ('all-linear': every linear
        layer but the output head; or module-name suffixes) will update, now: what the first adapter version
        would copy (`_load_adapter`), made at start so that version serves without the copy's cost (the
        memory is the same from the first version on). Returns the bytes kept."""
        import torch

        head = self.model.get_output_embeddings()
        kept = 0
        for name, module in self.model.named_modules():
            if not isinstance(module, torch.nn.Linear) or module is head:
                continue
            if targets != "all-linear" and not any(name == t or name.endswith(f".{t}") for t in targets):
                continue
            key = f"{name}.weight"
            if key not in self.base_of_adapted:
                self.base_of_adapted[key] = module.weight.detach().clone()
                kept += module.weight.numel() * module.weight.element_size()
        return kept

    def _check_state(self, state: dict, live: dict, file: Path) -> None:
        unexpected = sorted(set(state) - set(live))
        if unexpected:
            raise WeightsError(f"{file}: tensors the model does not have: {unexpected[:5]}")
        # Tied tensors (one storage under several names) need only one name present.
        groups: dict[int, list[str]] = {}
        for name, tensor in live.items():
            groups.setdefault(tensor.data_ptr(), []).append(name)
        missing = [names[0] for names in groups.values() if not any(n in state for n in names)]
        if missing:
            raise WeightsError(f"{file}: missing tensors: {missing[:5]}")
        wrong = [f"{k} {tuple(v.shape)}, model {tuple(live[k].shape)}"
                 for k, v in state.items() if v.shape != live[k].shape]
        if wrong:
            raise WeightsError(f"{file}: shape mismatch: {wrong[:5]}")

