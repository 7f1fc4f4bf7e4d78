"""The `vllm` inference backend (GPU only): token ids in, token ids + logprobs out.

What it is: vLLM's async engine (`vllm.v1.engine.async_llm.AsyncLLM`, written
against vLLM 0.33; pinned in pyproject's `vllm` extra) driven with token-id
prompts (`{"prompt_token_ids": ...}`), with the interface of
`jet.workers.hf_backend.HFBackend` in async form: `agenerate(prompts, params)
-> list[GenOutput]`, `aload_weights(path, sha256, version)`, `context_length`,
`version`. The inference worker awaits these on its event loop.

Logprobs: the engine runs with `logprobs_mode="processed_logprobs"`, i.e.
log_softmax(logits / temperature) of the sampled token, with `logprobs=0` (the
sampled token only). vLLM applies top-k/top-p BEFORE it takes processed
logprobs, so with top_p < 1 they would be renormalised over the nucleus and
differ from what the trainer recomputes (the full-vocabulary tempered
distribution, see hf_backend). This backend therefore answers top_p < 1 with
an error instead of returning logprobs the trainer would misread. Greedy
(temperature 0) logprobs are under temperature 1, as in hf.

Weights: `reload_weights` on every GPU worker through `collective_rpc`, reading
the new safetensors folder from disk in place (after our sha256 check), then
`reset_prefix_cache()` so no KV computed with the old weights is reused.
The stop token that ended a completion is in its token ids (vLLM keeps it).

What it is not: importable without vllm (the import happens in `__init__`),
or usable on CPU.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import anyio

from jet.errors import ConfigError, WeightsError
from jet.wire import file_sha256
from jet.workers.hf_backend import WEIGHTS_FILE, GenOutput, SamplingParams, _version_in, request_error

log = logging.getLogger(__name__)


class VLLMBackend:
    def __init__(self, model_dir: str | Path, device: str = "cuda", dtype: str = "auto",
                 gpu_memory_utilization: float = 0.85, max_model_len: int | None = None):
        if not device.startswith("cuda"):
            raise ConfigError(f"models[].device: the vllm backend runs on CUDA only, got {device!r}")
        if ":" in device and "CUDA_VISIBLE_DEVICES" not in os.environ:
            os.environ["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        extra = {"max_model_len": max_model_len} if max_model_len else {}
        args = AsyncEngineArgs(model=str(model_dir), dtype=dtype, logprobs_mode="processed_logprobs",
                               gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
                               seed=0, **extra)
        self.engine = AsyncLLM.from_engine_args(args)
        self.vocab_size = self.engine.model_config.get_vocab_size()
        self.version = 0

    def close(self) -> None:
        """Stop the engine's background process."""
        self.engine.shutdown()

    @property
    def context_length(self) -> int:
        return self.engine.model_config.max_model_len

    def _request_error(self, prompt: list[int], sp: SamplingParams) -> str | None:
        if sp.top_p != 1:
            return (f"top_p={sp.top_p} is not supported by the vllm backend: its logprobs would be "
                    "renormalised over the nucleus, not those the trainer recomputes; use top_p=1")
        return request_error(prompt, sp, self.context_length, self.vocab_size)

    async def agenerate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenOutput]:
        """Complete every prompt concurrently in the engine; outputs in request order."""
        outputs: list[GenOutput | None] = [None] * len(prompts)

        async def one(i: int) -> None:
            problem = self._request_error(prompts[i], params[i])
            outputs[i] = (GenOutput([], [], "error", problem, self.version) if problem
                          else await self._one(prompts[i], params[i]))

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return outputs

    async def _one(self, prompt: list[int], sp: SamplingParams) -> GenOutput:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        vsp = VSamplingParams(temperature=sp.temperature, top_p=1.0, seed=sp.seed,
                              max_tokens=min(sp.max_tokens, self.context_length - len(prompt)),
                              stop_token_ids=list(sp.stop_token_ids), logprobs=0, detokenize=False,
                              skip_special_tokens=False, output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        try:
            async for out in self.engine.generate({"prompt_token_ids": prompt}, vsp, uuid.uuid4().hex):
                final = out
        except Exception as e:  # noqa: BLE001 - one request's failure is its error reply
            log.exception("vllm request failed")
            return GenOutput([], [], "error", f"vllm: {type(e).__name__}: {e}", self.version)
        comp = final.outputs[0]
        ids = list(comp.token_ids)
        logps = [float(comp.logprobs[k][t].logprob) for k, t in enumerate(ids)]
        if comp.finish_reason not in ("stop", "length"):
            return GenOutput([], [], "error", f"vllm finished with {comp.finish_reason!r}", self.version)
        return GenOutput(ids, logps, comp.finish_reason, None, self.version)

    async def aload_weights(self, path: str | Path, sha256: str | None = None, version: int | None = None) -> None:
        """Reload weights in place from a folder holding model.safetensors (or that file)."""
        file = Path(path)
        file = file / WEIGHTS_FILE if file.is_dir() else file
        if not file.is_file():
            raise WeightsError(f"no weights file at {file}")
        if sha256 is not None:
            digest = await anyio.to_thread.run_sync(file_sha256, file)
            if digest != sha256.lower():
                raise WeightsError(f"sha256 mismatch for {file}: expected {sha256}, file has {digest}")
        try:
            await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": str(file.parent)})
        except Exception as e:  # noqa: BLE001 - vLLM raises its own types; ours is WeightsError
            raise WeightsError(f"vllm could not reload {file.parent}: {e}") from e
        await self.engine.reset_prefix_cache()
        self.version = version if version is not None else _version_in(file, default=self.version + 1)
