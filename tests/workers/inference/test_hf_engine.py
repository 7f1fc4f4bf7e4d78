"""jet.workers.inference.hf_engine: continuous batching (requests join and leave between steps), the
same tokens and logprobs as alone, weight loads between requests, cancellation."""

import anyio
import pytest
import torch
from safetensors.torch import load_file, save_file

from jet.models import init_model
from jet.workers.inference.backend import SamplingParams
from jet.workers.inference.hf import HFBackend
from tests.weights import perturbed_weights

CONTEXT = 128
ATOL = 1e-4  # float32: a row decoded in a merged, left-padded batch vs one unpadded forward


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(tmp_path_factory, request):
    out = init_model(tmp_path_factory.mktemp("m") / "tiny", arch=request.param, vocab_size=512,
                     hidden_size=32, layers=2, heads=4, kv_heads=2, max_position=CONTEXT, seed=0)
    state = load_file(out / "model.safetensors")
    state["lm_head.weight"] = state["lm_head.weight"] * 40  # peaked distributions: stops and top-p matter
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def requests(n: int):
    """Prompts of different lengths, settings mixed, completion lengths from 2 to 60."""
    out = []
    for i in range(n):
        prompt = [(7 * i + k) % 500 + 3 for k in range(3 + (5 * i) % 17)]
        sp = SamplingParams(temperature=[0.0, 0.7, 1.0, 1.4][i % 4], top_p=[1.0, 0.9][i % 2],
                            max_tokens=2 + (11 * i) % 59, seed=100 + i)
        out.append((prompt, sp))
    return out


def reference_logprobs(model, prompt, completion, temperature):
    """Full-vocabulary tempered logprobs of a full forward: the reported ones at top_p = 1 (at top_p < 1
    the engine is compared with the batch API instead, whose math is jet.workers.inference.hf's)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(1, torch.tensor(completion)[:, None])[:, 0]


async def staggered(backend, reqs, gap_s=0.003):
    """Every request in flight at once, each arriving a little after the previous one."""
    outs = [None] * len(reqs)

    async def one(i):
        await anyio.sleep(i * gap_s)
        outs[i] = await backend.agenerate_one(*reqs[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(reqs)):
            tg.start_soon(one, i)
    return outs


@pytest.mark.anyio
async def test_continuous_outputs_equal_each_request_alone(model_dir):
    backend = HFBackend(model_dir)
    reqs = requests(12)
    outs = await staggered(backend, reqs)
    sched = backend.engine.sched
    assert not sched.busy and sched.peak_rows > 3  # rows really shared steps
    assert sched.forwards < sum(len(o.token_ids) for o in outs)
    for (prompt, sp), out in zip(reqs, outs):
        alone = HFBackend(model_dir).generate([prompt], [sp])[0]
        assert out.token_ids == alone.token_ids and out.finish_reason == alone.finish_reason
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
        if sp.top_p == 1:
            ref = reference_logprobs(backend.model, prompt, out.token_ids, sp.temperature)
            torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=ATOL, rtol=0)


@pytest.mark.anyio
async def test_a_short_request_joins_and_leaves_while_a_long_one_decodes(model_dir):
    backend = HFBackend(model_dir)
    backend.eos_ids = frozenset()  # the long request runs to max_tokens
    sched, order = backend.engine.sched, []

    async def call(name, prompt, n):
        out = await backend.agenerate_one(prompt, SamplingParams(temperature=1.0, max_tokens=n, seed=1))
        order.append((name, out))

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, "long", [5, 6, 7], 100)
        while sched.forwards < 5:
            await anyio.sleep(0.001)
        tg.start_soon(call, "short", list(range(20, 60)), 3)  # a longer prompt: merged by left-padding
    assert [name for name, _ in order] == ["short", "long"] and sched.peak_rows == 2
    assert [len(out.token_ids) for _, out in order] == [3, 100]
    for (name, out), prompt in zip(order, [list(range(20, 60)), [5, 6, 7]]):
        ref = reference_logprobs(backend.model, prompt, out.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=ATOL, rtol=0)


@pytest.mark.anyio
async def test_bad_requests_error_and_others_complete(model_dir):
    backend = HFBackend(model_dir)
    bad = [([], SamplingParams()), ([1] * CONTEXT, SamplingParams()), ([3, 512], SamplingParams()),
           ([4], SamplingParams(temperature=-1)), ([5], SamplingParams(top_p=0))]
    outs = await staggered(backend, bad + requests(3), gap_s=0)
    assert [o.finish_reason for o in outs[:5]] == ["error"] * 5
    assert all(o.error and o.token_ids == [] for o in outs[:5])
    assert all(o.finish_reason in ("stop", "length") for o in outs[5:])


@pytest.mark.anyio
async def test_weights_load_between_requests_none_dropped_none_mixed(model_dir, tmp_path):
    backend = HFBackend(model_dir)
    old = HFBackend(model_dir).model
    file, digest = perturbed_weights(model_dir, tmp_path / "v5", seed=3, scale=0.3)
    new = HFBackend(model_dir)
    new.load_weights(file)
    reqs = requests(16)
    outs = [None] * len(reqs)
    loaded_at = []

    async def one(i):
        await anyio.sleep(0.02 * i)
        outs[i] = await backend.agenerate_one(*reqs[i])

    async def load():
        await anyio.sleep(0.1)  # requests are in flight by now
        await backend.aload_weights(file, digest, 5)
        loaded_at.append(backend.engine.sched.forwards)

    async with anyio.create_task_group() as tg:
        for i in range(len(reqs)):
            tg.start_soon(one, i)
        tg.start_soon(load)
    versions = [o.version for o in outs]
    assert 0 in versions and 5 in versions and backend.version == 5  # some before, some after
    checked = set()
    for (prompt, sp), out in zip(reqs, outs):
        if sp.top_p == 1:
            model = old if out.version == 0 else new.model
            ref = reference_logprobs(model, prompt, out.token_ids, sp.temperature)
            torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=ATOL, rtol=0)
            checked.add(out.version)
    assert checked == {0, 5}
    assert not backend.engine.gate.loading and backend.engine.gate.inside == 0


@pytest.mark.anyio
async def test_a_cancelled_caller_leaves_the_batch(model_dir):
    backend = HFBackend(model_dir)
    done = []

    async def patient():
        done.append(await backend.agenerate_one([9, 10], SamplingParams(temperature=1.0, max_tokens=60, seed=2,
                                                                        stop_token_ids=())))

    async with anyio.create_task_group() as tg:
        tg.start_soon(patient)
        with anyio.move_on_after(0.2):  # this caller gives up mid-generation (it may be the driver)
            await backend.agenerate_one([11, 12], SamplingParams(temperature=1.0, max_tokens=100, seed=3,
                                                                 stop_token_ids=()))
    assert len(done) == 1 and done[0].finish_reason in ("stop", "length")
    sched = backend.engine.sched
    assert not sched.busy and sched.rows == []
    alone = HFBackend(model_dir).generate([[9, 10]], [SamplingParams(temperature=1.0, max_tokens=60, seed=2)])[0]
    assert done[0].token_ids == alone.token_ids


@pytest.mark.anyio
async def test_a_failing_step_errors_the_requests_in_flight_and_serving_goes_on(model_dir):
    backend = HFBackend(model_dir)
    calls = [0]

    def explode_once(module, args):
        calls[0] += 1
        if calls[0] == 6:  # mid-decoding, with every request in the batch
            raise RuntimeError("simulated out of memory")

    hook = backend.model.model.register_forward_pre_hook(explode_once)
    try:
        outs = await staggered(backend, requests(4), gap_s=0)
    finally:
        hook.remove()
    failed = [o for o in outs if o.finish_reason == "error"]
    assert failed and all("simulated out of memory" in o.error and o.token_ids == [] for o in failed)
    assert not backend.engine.sched.busy
    again = await staggered(backend, requests(4), gap_s=0)
    assert all(o.finish_reason in ("stop", "length") for o in again)
