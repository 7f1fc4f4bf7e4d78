"""jet.models: the tiny local tokenizer, chat templates, model dirs and `jet model init`."""

import json

import pytest
from click.testing import CliRunner

from jet.errors import ConfigError
from jet.models import CHATML_TEMPLATE, LLAMA3_TEMPLATE, init_model, train_tokenizer

TEXTS = [
    "Guess a number between 1 and 100. I guess 42. Higher! 73? Lower. 61 is correct!",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "(12 + 7) * 3"}}</tool_call>',
    "  leading spaces, tabs\tand\nnewlines\n\n; ünïcödé 日本語 emoji 🙂 and 1234567890.",
]
TOOL_CHAT = [
    {"role": "system", "content": "You play a guessing game."},
    {"role": "user", "content": "Guess my number."},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "guess", "arguments": '{"n": 50}'}}]},
    {"role": "tool", "content": "higher"},
]


@pytest.fixture(scope="module")
def tokenizers():
    return {t: train_tokenizer(vocab_size=700, template=t) for t in ("chatml", "llama3")}


@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_tokenizer_round_trips_text(tokenizers, template):
    tok = tokenizers[template]
    assert len(tok) == 700
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.eos_token_id not in ids  # nothing added on encode
    # Game words were learned as merges, not spelled out byte by byte.
    assert [len(tok.encode(w)) for w in (" higher", " lower", " guess", "Correct")] == [1, 1, 1, 1]


def test_special_tokens_per_family(tokenizers):
    chatml, llama3 = tokenizers["chatml"], tokenizers["llama3"]
    assert chatml.eos_token == "<|im_end|>" and chatml.pad_token == "<|endoftext|>"
    assert llama3.eos_token == "<|eot_id|>" and llama3.bos_token == "<|begin_of_text|>"
    assert llama3.pad_token_id is not None and llama3.pad_token_id != llama3.eos_token_id
    for tok, marks in [(chatml, ["<|im_start|>", "<|im_end|>"]),
                       (llama3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])]:
        for mark in marks:
            assert len(tok.encode(mark)) == 1, mark
    assert chatml.chat_template == CHATML_TEMPLATE and llama3.chat_template == LLAMA3_TEMPLATE


def test_reserved_tokens_fill_vocab_beyond_the_corpus():
    tok = train_tokenizer(vocab_size=3000)
    assert len(tok) == 3000
    assert tok.convert_ids_to_tokens(2999).startswith("<|reserved_")


def test_chatml_renders_tool_chat_and_generation_prompt(tokenizers):
    tok = tokenizers["chatml"]
    text = tok.apply_chat_template(TOOL_CHAT, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou play a guessing game.<|im_end|>\n"
        "<|im_start|>user\nGuess my number.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "guess", "arguments": {"n": 50}}</tool_call><|im_end|>\n'
        "<|im_start|>tool\nhigher<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(TOOL_CHAT, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ids == tok.encode(text)
    assert ids[-3:] == tok.encode("<|im_start|>assistant\n")
    without = tok.apply_chat_template(TOOL_CHAT, tokenize=False, add_generation_prompt=False)
    assert text == without + "<|im_start|>assistant\n"


def test_llama3_renders_tool_chat_and_generation_prompt(tokenizers):
    tok = tokenizers["llama3"]
    text = tok.apply_chat_template(TOOL_CHAT, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou play")
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nhigher<|eot_id|>" in text
    assert '<tool_call>{"name": "guess", "arguments": {"n": 50}}</tool_call><|eot_id|>' in text
    assert text.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok.apply_chat_template(TOOL_CHAT, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ids == tok.encode(text) and ids[0] == tok.bos_token_id


@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_template_tools_and_assistant_mask(tokenizers, template):
    tok = tokenizers[template]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template(TOOL_CHAT[:2], tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.count("You play a guessing game.") == 1  # merged into the one system turn
    assert '"name": "calculator"' in text and "<tools>" in text
    # {% generation %} marks exactly the assistant turn (content + end-of-turn token).
    chat = TOOL_CHAT[:2] + [{"role": "assistant", "content": "I guess 50."}]
    out = tok.apply_chat_template(chat, tokenize=True, return_assistant_tokens_mask=True)
    marked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert marked == tok.encode("I guess 50." + tok.eos_token)


@pytest.mark.parametrize("arch,template", [("llama", "chatml"), ("qwen2", "llama3")])
def test_init_model_loads_with_auto_classes(tmp_path, arch, template):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = init_model(tmp_path / "m", arch=arch, template=template, vocab_size=600, hidden_size=32, layers=2)
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= files
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == arch and model.config.vocab_size == len(tok) == 600
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 2
    eos = model.generation_config.eos_token_id
    assert tok.eos_token_id in eos and len(eos) == 2
    ids = tok.apply_chat_template(TOOL_CHAT, tokenize=True, add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits
    assert logits.shape == (1, ids["input_ids"].shape[1], 600) and torch.isfinite(logits).all()


def test_init_model_is_deterministic_per_seed(tmp_path):
    kw = dict(vocab_size=600, hidden_size=32, layers=1)
    a, b = init_model(tmp_path / "a", seed=3, **kw), init_model(tmp_path / "b", seed=3, **kw)
    c = init_model(tmp_path / "c", seed=4, **kw)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_unknown_template_or_arch_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="template"):
        train_tokenizer(template="mistral")
    with pytest.raises(ConfigError, match="arch"):
        init_model(tmp_path / "x", arch="gpt2", vocab_size=600)


def test_cli_model_init(tmp_path):
    from jet.cli.main import main

    out = tmp_path / "cli"
    args = ["model", "init", "--out", str(out), "--arch", "qwen2", "--template", "llama3",
            "--hidden", "32", "--layers", "1", "--vocab-size", "640", "--seed", "7"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith(str(out))
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        "qwen2", 32, 1, 640)
    bad = CliRunner().invoke(main, ["model", "init", "--out", str(tmp_path / "y"), "--arch", "gpt2"])
    assert bad.exit_code == 2 and "gpt2" in bad.output
