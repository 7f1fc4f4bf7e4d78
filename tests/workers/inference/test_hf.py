"""jet.workers.inference.hf: batched KV-cache sampling, logprobs, stops, errors, weight loading."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from jet.errors import WeightsError
from jet.models import init_model
from jet.workers.inference.backend import GenOutput, SamplingParams
from jet.workers.inference.hf import HFBackend
from jet.workers.inference.hf_engine import sample_row
from tests.weights import perturbed_weights

CONTEXT = 64
PROMPTS = [[5, 6, 7], list(range(40, 51)), list(range(100, 125)), [300, 301, 302, 303, 304, 305, 306]]
PARAMS = [
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=1),
    SamplingParams(temperature=0.0, max_tokens=10),
    SamplingParams(temperature=1.3, max_tokens=7, seed=2),
    SamplingParams(temperature=1.0, top_p=0.3, max_tokens=12, seed=3),
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(tmp_path_factory, request):
    out = init_model(tmp_path_factory.mktemp("m") / "tiny", arch=request.param, vocab_size=512,
                     hidden_size=32, layers=2, heads=4, kv_heads=2, max_position=CONTEXT, seed=0)
    # A random init is near-uniform over the vocabulary; a scaled head gives
    # peaked distributions, so greedy, top-p and stops are meaningful.
    state = load_file(out / "model.safetensors")
    state["lm_head.weight"] = state["lm_head.weight"] * 40
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def backend(model_dir):
    return HFBackend(model_dir)


def naive_nucleus(probs: torch.Tensor, top_p: float) -> list[int]:
    """The ids a top-p sampler keeps, one by one: most probable first until the mass before reaches top_p,
    then every id tied with the last one kept."""
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += float(probs[i])
    floor = float(probs[kept[-1]])
    return [i for i in range(len(probs)) if float(probs[i]) >= floor]


def reference_logprobs(model, prompt, completion, temperature, top_p=1.0):
    """Full forward of prompt + completion (no cache, no padding); the sampled distribution built by hand."""
    seq = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    out = logp.gather(1, torch.tensor(completion)[:, None])[:, 0]
    if temperature and top_p < 1:
        probs = logp.double().exp()
        mass = torch.tensor([float(probs[k, naive_nucleus(probs[k], top_p)].sum()) for k in range(len(completion))])
        out = out - mass.log().float()
    return out, logits


def test_logprobs_equal_a_full_forward_pass(backend):
    outs = backend.generate(PROMPTS, PARAMS)
    for prompt, sp, out in zip(PROMPTS, PARAMS, outs):
        assert out.finish_reason in ("stop", "length") and out.error is None and out.version == 0
        assert len(out.token_ids) == len(out.logprobs) >= 1
        ref, logits = reference_logprobs(backend.model, prompt, out.token_ids, sp.temperature, sp.top_p)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
        if sp.temperature == 0:  # greedy: argmax, logprob under temperature 1
            assert out.token_ids == logits.argmax(-1).tolist()
        if sp.top_p < 1:  # every sampled token lies in the top-p nucleus of its step
            probs = torch.softmax(logits / sp.temperature, -1)
            for step, tok in enumerate(out.token_ids):
                ordered = probs[step].sort(descending=True).values
                floor = ordered[((ordered.cumsum(0) - ordered) < sp.top_p).sum() - 1]
                assert probs[step, tok] >= floor - 1e-6


def test_batch_gives_the_same_outputs_as_each_prompt_alone(backend):
    batch = backend.generate(PROMPTS, PARAMS)
    reversed_batch = backend.generate(PROMPTS[::-1], PARAMS[::-1])[::-1]
    for i, (prompt, sp) in enumerate(zip(PROMPTS, PARAMS)):
        alone = backend.generate([prompt], [sp])[0]
        for other in (batch[i], reversed_batch[i]):
            assert other.token_ids == alone.token_ids
            assert other.finish_reason == alone.finish_reason
            torch.testing.assert_close(torch.tensor(other.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)


def test_seed_reproduces_and_different_seeds_differ(backend):
    prompt, sp = [[7, 8, 9]], SamplingParams(temperature=1.5, max_tokens=12, seed=11)
    first, again = backend.generate(prompt, [sp])[0], backend.generate(prompt, [sp])[0]
    assert first.token_ids == again.token_ids
    others = [backend.generate(prompt, [SamplingParams(temperature=1.5, max_tokens=12, seed=s)])[0].token_ids
              for s in (12, 13)]
    assert any(o != first.token_ids for o in others)


def _first_new_token(tokens):
    return next(k for k in range(1, len(tokens)) if tokens[k] not in tokens[:k])


def test_stop_ids_and_max_tokens_set_finish_reason(backend, model_dir, tmp_path):
    prompt = [[11, 12, 13, 14]]
    full = backend.generate(prompt, [SamplingParams(temperature=0, max_tokens=8)])[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 8
    k = _first_new_token(full.token_ids)
    stopped = backend.generate(prompt, [SamplingParams(temperature=0, max_tokens=8,
                                                       stop_token_ids=(full.token_ids[k],))])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[: k + 1]  # the stop token is included...
    assert stopped.logprobs == pytest.approx(full.logprobs[: k + 1], abs=1e-5)  # ...with its logprob

    # EOS ids from generation_config.json are stop ids too.
    copy = shutil.copytree(model_dir, tmp_path / "eos")
    gen = json.loads((copy / "generation_config.json").read_text())
    gen["eos_token_id"] = [full.token_ids[k]]
    (copy / "generation_config.json").write_text(json.dumps(gen))
    eos_stopped = HFBackend(copy).generate(prompt, [SamplingParams(temperature=0, max_tokens=8)])[0]
    assert eos_stopped.finish_reason == "stop" and eos_stopped.token_ids == stopped.token_ids


def test_bad_requests_error_without_disturbing_the_batch(backend):
    good = [PROMPTS[0], PROMPTS[2]]
    prompts = [good[0], [1] * CONTEXT, [], [3, 512], [4, 5], [6, 7], good[1]]
    params = [PARAMS[0], SamplingParams(), SamplingParams(), SamplingParams(),
              SamplingParams(temperature=-1), SamplingParams(max_tokens=0), PARAMS[2]]
    outs = backend.generate(prompts, params)
    reasons = [o.finish_reason for o in outs]
    assert reasons[1:6] == ["error"] * 5 and "error" not in (reasons[0], reasons[6])
    assert "64 tokens" in outs[1].error and "context" in outs[1].error
    assert "empty" in outs[2].error and "vocabulary" in outs[3].error
    assert "temperature" in outs[4].error and "max_tokens" in outs[5].error
    assert all(o.token_ids == [] and o.logprobs == [] for o in outs[1:6])
    for out, prompt, sp in [(outs[0], good[0], PARAMS[0]), (outs[6], good[1], PARAMS[2])]:
        assert out.token_ids == backend.generate([prompt], [sp])[0].token_ids


def test_max_tokens_is_clipped_to_the_context_left(backend):
    prompt = list(range(200, 200 + CONTEXT - 3))
    out = backend.generate([prompt], [SamplingParams(temperature=0, max_tokens=100)])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert backend.context_length == CONTEXT


def unchanged(out, before) -> bool:
    """The same generation: tokens, finish and version exactly, logprobs up to float noise (the second call
    takes its prompt's head from the prefix cache, computed in another batch)."""
    return (out.token_ids, out.finish_reason, out.version) == (before.token_ids, before.finish_reason,
                                                                before.version) and out.logprobs == pytest.approx(
        before.logprobs, abs=1e-5)


def test_load_weights_checks_hash_and_changes_outputs(model_dir, tmp_path):
    live = HFBackend(model_dir)
    prompt, greedy = [[21, 22, 23]], [SamplingParams(temperature=0, max_tokens=10)]
    before = live.generate(prompt, greedy)[0]
    file, digest = perturbed_weights(model_dir, tmp_path / "weights" / "v7", seed=0, scale=0.5)

    with pytest.raises(WeightsError, match="sha256"):
        live.load_weights(file, sha256="0" * 64)
    assert live.version == 0 and unchanged(live.generate(prompt, greedy)[0], before)

    live.load_weights(file.parent, sha256=digest)  # a dir holding model.safetensors
    after = live.generate(prompt, greedy)[0]
    assert live.version == 7 and after.version == 7
    assert after.token_ids != before.token_ids
    ref, _ = reference_logprobs(live.model, prompt[0], after.token_ids, 0)
    torch.testing.assert_close(torch.tensor(after.logprobs), ref, atol=1e-4, rtol=0)
    fresh = HFBackend(model_dir)
    fresh.load_weights(file, version=9)
    assert fresh.version == 9 and fresh.generate(prompt, greedy)[0].token_ids == after.token_ids


def test_load_weights_rejects_files_that_do_not_fit(model_dir, tmp_path):
    live = HFBackend(model_dir)
    prompt, greedy = [[21, 22, 23]], [SamplingParams(temperature=0, max_tokens=6)]
    before = live.generate(prompt, greedy)[0]
    state = load_file(model_dir / "model.safetensors")
    state["model.norm.weight"] = torch.ones(7)
    save_file(state, tmp_path / "bad.safetensors")
    with pytest.raises(WeightsError, match="shape"):
        live.load_weights(tmp_path / "bad.safetensors")
    del state["model.norm.weight"]
    save_file(state, tmp_path / "missing.safetensors")
    with pytest.raises(WeightsError, match="missing"):
        live.load_weights(tmp_path / "missing.safetensors")
    with pytest.raises(WeightsError, match="no weights file"):
        live.load_weights(tmp_path / "nowhere")
    assert live.version == 0 and unchanged(live.generate(prompt, greedy)[0], before)


def test_sampler_draws_from_the_tempered_and_truncated_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    draws = 4000

    def frequencies(sp):
        gen = torch.Generator().manual_seed(0)
        logp = torch.log_softmax(logits / sp.temperature, -1)
        picks = torch.tensor([sample_row(logits, logp, sp, gen) for _ in range(draws)])
        return torch.bincount(picks, minlength=5).float() / draws

    expected = torch.softmax(logits / 0.7, -1)
    torch.testing.assert_close(frequencies(SamplingParams(temperature=0.7)), expected, atol=0.03, rtol=0)
    # top_p 0.8 keeps the smallest top set with mass >= 0.8: tokens 0, 1 (0.70 + 0.17).
    nucleus = expected[:2] / expected[:2].sum()
    got = frequencies(SamplingParams(temperature=0.7, top_p=0.8))
    torch.testing.assert_close(got, torch.cat([nucleus, torch.zeros(3)]), atol=0.03, rtol=0)
    assert sample_row(logits, None, SamplingParams(temperature=0), None) == 0


@pytest.mark.anyio
async def test_a_finished_output_never_changes_while_others_decode(model_dir, anyio_backend):
    """Continuous batching: a request that finishes leaves the batch with its own tokens; decoding
    the requests still in flight (the same rows, the same cache) must not touch what it returned."""
    import anyio

    backend = HFBackend(str(model_dir), max_inflight=4)
    short, long_ = SamplingParams(max_tokens=2, seed=1), SamplingParams(max_tokens=12, seed=2)
    got: dict[str, GenOutput] = {}
    seen: dict[str, tuple] = {}

    async def one(name: str, sp: SamplingParams) -> None:
        got[name] = await backend.agenerate_one([5, 6, 7], sp)
        seen[name] = (tuple(got[name].token_ids), tuple(got[name].logprobs))

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "long", long_)
        tg.start_soon(one, "short", short)
    assert len(seen["short"][0]) <= 2 < len(seen["long"][0])
    assert (tuple(got["short"].token_ids), tuple(got["short"].logprobs)) == seen["short"]  # unchanged since
    alone = backend.generate([[5, 6, 7]], [short])[0]
    assert tuple(alone.token_ids) == seen["short"][0]  # and what it would have been alone (batch invariance)
