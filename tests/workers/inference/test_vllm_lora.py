"""LoRA adapters at run time on the vllm backend (`VLLMBackend(lora_slots=N)`): adapter versions that
trainers publish are loaded by name and version without restarting the engine, two models' adapters
serve in one engine at once, each row computing what its adapter merged into the base computes (the
greedy tokens of the hf backend, logprobs equal to a recomputation), a new version of one model leaves
the other's alone, and what cannot be served is refused with its reason while the old version serves.

Skipped where vllm is not installed (CI runs this file in its own venv: see .ci/run)."""

from __future__ import annotations

import anyio
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from jet.config import AdapterConfig  # noqa: E402
from jet.errors import WeightsError  # noqa: E402
from jet.workers.inference.backend import SamplingParams  # noqa: E402
from tests.workers.inference.test_shared_base import trained_adapters  # noqa: E402
from tests.workers.inference.test_vllm import ATOL, CONTEXT, _device, hf_model, model_dir, prompts, recomputed  # noqa: E402,F401

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def versions(model_dir, tmp_path_factory):
    """Three adapter versions of the model, as trainers publish them: (folder, sha256) each."""
    return trained_adapters(model_dir, tmp_path_factory.mktemp("adapters"), [
        (AdapterConfig(r=4, alpha=16.0), 1, 3), (AdapterConfig(r=8, alpha=16.0), 2, 3),
        (AdapterConfig(r=4, alpha=16.0, target_modules=["q_proj", "v_proj", "down_proj"]), 3, 4)])


@pytest.fixture(scope="module")
async def backend(model_dir):
    from jet.workers.inference.vllm import VLLMBackend

    b = await anyio.to_thread.run_sync(lambda: VLLMBackend(
        model_dir, device=_device(), dtype="float32", gpu_memory_utilization=0.3, max_model_len=CONTEXT,
        lora_slots=2, max_lora_rank=8))
    yield b
    b.close()


def merged(model_dir, folder):
    """The hf backend with the adapter version merged into its base: the reference."""
    from jet.workers.inference.hf import HFBackend

    hf = HFBackend(model_dir)
    hf.load_weights(folder)
    return hf


@pytest.mark.anyio
async def test_two_adapters_serve_in_one_engine_each_as_merged(backend, model_dir, versions):
    (a, sha_a), (b, sha_b), (c, sha_c) = versions
    ps = prompts(4)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    sampled = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
    base = await backend.agenerate(ps, [greedy] * len(ps))
    await backend.aload_weights(a, sha_a, 1, slot=0)
    await backend.aload_weights(b, sha_b, 1, slot=1)
    assert backend.versions == [1, 1]

    def check(outs, slots, refs):
        for out, p, slot in zip(outs, ps * 2, slots):
            ref = refs[slot]
            [want] = ref.generate([p], [greedy])
            assert out.version == backend.versions[slot]
            assert out.token_ids == want.token_ids, slot
            assert out.logprobs == pytest.approx(want.logprobs, abs=ATOL)

    refs = {0: merged(model_dir, a), 1: merged(model_dir, b)}
    slots = [0] * len(ps) + [1] * len(ps)
    outs = await backend.agenerate(ps * 2, [greedy] * len(slots), slots)  # both models in flight at once
    check(outs, slots, refs)
    assert [o.token_ids for o in outs[:4]] != [o.token_ids for o in base] or \
        [o.logprobs for o in outs[:4]] != pytest.approx([o.logprobs for o in base], abs=1e-3), "not the base"
    # sampled tokens: their logprobs are the merged model's, recomputed independently
    outs = await backend.agenerate(ps * 2, [sampled] * len(slots), slots)
    for out, p, slot in zip(outs, ps * 2, slots):
        want = recomputed(refs[slot].model, p, out.token_ids, 1.0, 1.0)
        assert out.logprobs == pytest.approx(want.tolist(), abs=ATOL)

    # a new version of model 1 (another rank and targets); model 0 keeps its own
    await backend.aload_weights(c, sha_c, 2, slot=1)
    assert backend.versions == [1, 2]
    refs[1] = merged(model_dir, c)
    check(await backend.agenerate(ps * 2, [greedy] * len(slots), slots), slots, refs)

    # refused, with the reason; both slots keep serving what they served
    with pytest.raises(WeightsError, match="adapter versions only"):
        await backend.aload_weights(model_dir / "model.safetensors", None, 3, slot=0)
    with pytest.raises(WeightsError, match="sha256 mismatch"):
        await backend.aload_weights(b, "0" * 64, 3, slot=0)
    big = trained_adapters(model_dir, model_dir.parent / "big", [(AdapterConfig(r=16, alpha=16.0), 4, 1)])[0][0]
    with pytest.raises(WeightsError, match="above this worker's maximum 8"):
        await backend.aload_weights(big, None, 3, slot=0)
    assert backend.versions == [1, 2]
    check(await backend.agenerate(ps * 2, [greedy] * len(slots), slots), slots, refs)
