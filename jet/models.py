"""Tiny local models: a byte-level BPE tokenizer and a random causal LM.

What it is: the builder that tests and the CPU demo use instead of a model hub
(none is reachable here). `train_tokenizer` trains a byte-level BPE on a
built-in synthetic corpus (English-ish sentences, arithmetic, number-guessing
and calculator-tool games, JSON tool calls) and attaches a real jinja chat
template; `init_model` adds a randomly initialised Llama or Qwen2 model and
writes a standard Hugging Face directory (config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with the chat
template inline) that transformers and vLLM load.

What it is not: a pretrained model. Outputs are random until trained.

Invariants:
- Deterministic: the same arguments give byte-identical tokenizer.json and
  model.safetensors.
- The model's vocab_size equals len(tokenizer), so every id it can sample
  decodes.
- Byte-level BPE round-trips any NFC-normalised text: decode(encode(s)) == s
  (the NFC normaliser is Qwen2's, which transformers 5 imposes on qwen2 dirs).
- Tokenizers add no special tokens on encode (no automatic BOS); the chat
  template writes every control token itself (Llama-3's <|begin_of_text|>
  included), so token-in-token-out prompts are exactly the rendered template.
- The tokenizer's eos is the end-of-turn token (<|im_end|> / <|eot_id|>);
  generation_config.eos_token_id lists it and the end-of-text token.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

from jet.errors import ConfigError

# Qwen2 / Llama-3 style split: words, single digits, punctuation runs, spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Shared jinja pieces: tool-call rendering accepts OpenAI-style
# {"function": {"name", "arguments"}} or flat {"name", "arguments"}; arguments
# may be a JSON string (OpenAI) or an object.
_TOOL_CALLS = (
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function or call %}"
    "{{- '<tool_call>{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
)
_TOOLS_PREAMBLE = (
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- 'You can call these tools. To call one, reply with "
    "<tool_call>{\"name\": <name>, \"arguments\": <object>}</tool_call>.\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>' }}"
)

CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}" + _TOOLS_PREAMBLE + "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message.role == 'system') %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' %}"
    "{%- generation %}{{- message.content or '' }}" + _TOOL_CALLS + "{{- '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML (Qwen-style). Tool results are a `tool` turn; assistant tool calls are <tool_call>JSON</tool_call>."""

LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- if tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}" + _TOOLS_PREAMBLE + "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message.role == 'system') %}"
    "{%- set role = 'ipython' if message.role == 'tool' else message.role %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}"
    "{%- if message.role == 'assistant' %}"
    "{%- generation %}{{- message.content or '' }}" + _TOOL_CALLS + "{{- '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}"
    "{{- (message.content or '') + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
"""Llama-3 style. Tool results use the `ipython` header, as Llama 3.1 does."""

# Per template family: special tokens (id order), eos (end of turn), extra stop, pad, bos.
TEMPLATES: dict[str, dict] = {
    "chatml": {
        "template": CHATML_TEMPLATE,
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "eos": "<|im_end|>",
        "stop": ["<|im_end|>", "<|endoftext|>"],
        "pad": "<|endoftext|>",
        "bos": None,
    },
    "llama3": {
        "template": LLAMA3_TEMPLATE,
        "special": [
            "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<|finetune_right_pad_id|>",
        ],
        "eos": "<|eot_id|>",
        "stop": ["<|eot_id|>", "<|end_of_text|>"],
        "pad": "<|finetune_right_pad_id|>",
        "bos": "<|begin_of_text|>",
    },
}
ARCHS = ("llama", "qwen2")

_WORDS = (
    "the a an one two three this that these those my your our their its cat dog bird fish horse "
    "model agent user player tool game number answer result value list task step turn round world "
    "time day night year house tree river city road book idea plan story question reason problem "
    "solution system message reply hint clue range guess score reward point limit target secret "
    "is was are were be been has had have can could will would may might must should shall "
    "runs ran sees saw finds found makes made takes took gives gave calls called thinks thought "
    "knows knew wants wanted needs needed tries tried asks asked says said tells told picks picked "
    "checks checked counts counted adds added subtracts multiplies divides computes returns "
    "starts started stops stopped waits moves keeps wins won loses lost plays played learns learned "
    "and or but so if then because when while with without from to of in on at by for about over "
    "under between after before again still only also just even never always often sometimes "
    "big small large tiny red blue green yellow black white quick slow happy sad bright dark "
    "new old good bad best worst first second third last next every some many few more less most "
    "very quite rather too enough here there now today tomorrow yesterday yes no not maybe please "
    "thanks sorry hello goodbye great nice fine right left up down above below inside outside "
    "zero ten hundred thousand half double sum difference product quotient equal equals plus minus "
    "times divided remainder even odd prime square root total average maximum minimum "
    "higher lower correct wrong close closer far warm cold try again guessed done finished "
    "water fire earth air light sound music color shape line circle paper table chair window door"
).split()
_OPS = ["+", "-", "*", "/"]


def synthetic_corpus(lines: int = 3000, seed: int = 0) -> list[str]:
    """Deterministic English-ish text, arithmetic, guessing-game and tool-call lines."""
    rng = random.Random(seed)
    makers = [_sentence, _arithmetic, _guessing, _tool_call, _chat_line]
    return [makers[i % len(makers)](rng) for i in range(lines)]


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    return " ".join(words).capitalize() + rng.choice([".", "!", "?", ","])


def _arithmetic(rng: random.Random) -> str:
    a, b, op = rng.randint(0, 999), rng.randint(1, 99), rng.choice(_OPS)
    value = {"+": a + b, "-": a - b, "*": a * b, "/": round(a / b, 2)}[op]
    return rng.choice([f"{a} {op} {b} = {value}", f"({a} {op} {b}) = {value}", f"What is {a}{op}{b}? {value}."])


def _guessing(rng: random.Random) -> str:
    n, lo, hi = rng.randint(1, 100), rng.randint(0, 50), rng.randint(51, 1000)
    return rng.choice([
        f"I guess {n}.", f"My guess is {n}", f"Guess a number between {lo} and {hi}.",
        f"{n} is too high. Go lower.", f"{n} is too low. Go higher.", f"Higher! Your guess {n} is lower than it.",
        f"Lower! Your guess {n} is higher than it.", f"Correct! The number was {n}.", "Wrong, try again.",
    ])


def _tool_call(rng: random.Random) -> str:
    expr = f"{rng.randint(0, 999)} {rng.choice(_OPS)} {rng.randint(1, 99)}"
    call = {"name": rng.choice(["calculator", "guess", "search"]), "arguments": {"expression": expr}}
    return rng.choice([
        f"<tool_call>{json.dumps(call)}</tool_call>",
        json.dumps({"result": rng.randint(-999, 99999)}),
        json.dumps({"type": "function", "function": {**call, "arguments": json.dumps(call["arguments"])}}),
        json.dumps({"guess": rng.randint(1, 100), "feedback": rng.choice(["higher", "lower", "correct"])}),
    ])


def _chat_line(rng: random.Random) -> str:
    who = rng.choice(["system", "user", "assistant", "tool"])
    return f"{who}\n{_sentence(rng)}\n{_guessing(rng)}"


def train_tokenizer(texts: Iterable[str] | None = None, vocab_size: int = 1024, template: str = "chatml"):
    """Train a byte-level BPE on `texts` (default: the built-in synthetic corpus); return a fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    family = _family(template)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()  # as Qwen2's; transformers 5 rebuilds qwen2 tokenizers with it
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=family["special"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(list(texts) if texts is not None else synthetic_corpus(), trainer=trainer)
    # A corpus too small for vocab_size merges: fill up with reserved tokens
    # (as Llama-3 does), so len(tokenizer) == vocab_size always.
    missing = vocab_size - tok.get_vocab_size()
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=family["eos"], pad_token=family["pad"], bos_token=family["bos"],
        clean_up_tokenization_spaces=False, model_max_length=2048,
    )
    fast.chat_template = family["template"]
    return fast


def init_model(
    out_dir: str | Path,
    arch: str = "llama",
    template: str = "chatml",
    vocab_size: int = 1024,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_position: int = 2048,
    seed: int = 0,
) -> Path:
    """Write a tokenizer and a randomly initialised causal LM to `out_dir`; return the path."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    family = _family(template)
    tokenizer = train_tokenizer(vocab_size=vocab_size, template=template)
    tokenizer.model_max_length = max_position
    config = _config(arch, tokenizer, family, hidden_size, layers, heads, kv_heads, max_position)
    with torch.random.fork_rng():  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    stop_ids = tokenizer.convert_tokens_to_ids(family["stop"])
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=stop_ids, pad_token_id=config.pad_token_id,
        do_sample=True, temperature=1.0, top_p=1.0,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out, save_jinja_files=False)
    portable_tokenizer_config(out / "tokenizer_config.json")
    return out


def _config(arch, tokenizer, family, hidden_size, layers, heads, kv_heads, max_position):
    from transformers import LlamaConfig, Qwen2Config

    if arch not in ARCHS:
        raise ConfigError(f"model.arch: unknown {arch!r}; expected one of {ARCHS}")
    ids = {
        "bos_token_id": tokenizer.convert_tokens_to_ids(family["bos"] or family["pad"]),
        "eos_token_id": tokenizer.convert_tokens_to_ids(family["eos"]),
        "pad_token_id": tokenizer.pad_token_id,
    }
    cls = LlamaConfig if arch == "llama" else Qwen2Config
    return cls(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 4,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        # Untied: every tensor has its own name in model.safetensors, so weight
        # files written by any trainer load without tie bookkeeping.
        max_position_embeddings=max_position, tie_word_embeddings=False, **ids,
    )


def portable_tokenizer_config(path: Path) -> None:
    # transformers 5 writes its own class name (TokenizersBackend); older
    # transformers (as pinned by vLLM) only know PreTrainedTokenizerFast.
    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    # transformers 5 loads model_type qwen2 with Qwen2Tokenizer whatever this
    # file says; an explicit null keeps it from adding <|endoftext|> as unk.
    data.setdefault("unk_token", None)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _family(template: str) -> dict:
    if template not in TEMPLATES:
        raise ConfigError(f"model.template: unknown {template!r}; expected one of {sorted(TEMPLATES)}")
    return TEMPLATES[template]
