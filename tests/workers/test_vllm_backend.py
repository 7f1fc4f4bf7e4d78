"""jet.workers.vllm_backend on a GPU: the hf backend's contract (logprobs, stops, errors, reloads).

Skipped without CUDA or without vllm (`pip install 'jet-rl[vllm]'`, GPU only)."""

from __future__ import annotations

import hashlib

import anyio
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ATOL = 2e-3  # float32 in vLLM (its own kernels) vs a float32 transformers forward


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from jet.models import init_model

    # head_dim 64: sizes every vLLM attention backend supports.
    return init_model(tmp_path_factory.mktemp("m") / "tiny", vocab_size=512, hidden_size=256, layers=2, heads=4,
                      kv_heads=2, max_position=256, seed=0)


def reference_logprobs(model_dir, prompt, completion, temperature, state=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    if state is not None:
        model.load_state_dict(state)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion]).cuda()).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(1, torch.tensor(completion).cuda()[:, None])[:, 0].cpu()


@pytest.mark.anyio
async def test_vllm_backend_matches_the_contract(model_dir, tmp_path):
    pytest.importorskip("vllm")
    from safetensors.torch import load_file, save_file

    from jet.workers.hf_backend import SamplingParams
    from jet.workers.vllm_backend import VLLMBackend

    backend = await anyio.to_thread.run_sync(lambda: VLLMBackend(model_dir, dtype="float32",
                                                                 gpu_memory_utilization=0.3, max_model_len=256))
    try:
        prompts = [[5, 6, 7], list(range(40, 60)), [5] * 300, [8, 9]]
        params = [SamplingParams(temperature=0.8, max_tokens=12, seed=1), SamplingParams(temperature=0, max_tokens=8),
                  SamplingParams(), SamplingParams(top_p=0.5)]
        outs = await backend.agenerate(prompts, params)
        for prompt, sp, out in list(zip(prompts, params, outs))[:2]:
            assert out.finish_reason in ("stop", "length") and len(out.token_ids) == len(out.logprobs) >= 1
            ref = reference_logprobs(model_dir, prompt, out.token_ids, sp.temperature)
            torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=ATOL, rtol=0)
        assert outs[2].finish_reason == "error" and "context of 256 tokens" in outs[2].error
        assert outs[3].finish_reason == "error" and "top_p" in outs[3].error

        state = load_file(model_dir / "model.safetensors")
        gen = torch.Generator().manual_seed(0)
        state = {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
        (tmp_path / "v4").mkdir()
        save_file(state, tmp_path / "v4" / "model.safetensors", metadata={"format": "pt"})
        digest = hashlib.sha256((tmp_path / "v4" / "model.safetensors").read_bytes()).hexdigest()
        await backend.aload_weights(tmp_path / "v4", digest)
        greedy = SamplingParams(temperature=0, max_tokens=8)
        [after] = await backend.agenerate([prompts[1]], [greedy])
        assert backend.version == after.version == 4 and after.token_ids != outs[1].token_ids
        new_state = {k: v.cuda() for k, v in state.items()}
        ref = reference_logprobs(model_dir, prompts[1], after.token_ids, 0, state=new_state)
        torch.testing.assert_close(torch.tensor(after.logprobs), ref, atol=ATOL, rtol=0)
    finally:
        backend.close()
