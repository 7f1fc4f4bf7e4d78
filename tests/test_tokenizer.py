"""jet.tokenizer: the lean tokenizer renders and encodes exactly as transformers does.

Each template family is checked against transformers' own AutoTokenizer on the same folder: the
rendered text of many conversations (system or not, tools, tool calls with string and object
arguments, tool results, None content, reasoning, with and without the generation prompt), the ids
of that text and of awkward strings, and decoding. The families: the tiny models' ChatML and
Llama-3 templates (jet.models), a Qwen2-style template that renders tools and tool calls, a
Llama-3.1-style one (tools in the first user message, `strftime_now`, `raise_exception`), a
template chosen by name among several, and SmolLM2-135M-Instruct's own (the real model the
`smollm2` fixture of tests/conftest.py converts from its GGUF file).
"""

import json
import shutil

import pytest

from jet.chat import Conversations, Template
from jet.models import train_tokenizer
from jet.tokenizer import ChatTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate <arithmetic> & more",
                                           "parameters": {"type": "object", "properties": {
                                               "expr": {"type": "string"}}, "required": ["expr"]}}}]
CALL_STR = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "calc", "arguments": "{\"expr\": \"2+2\"}"}}]}
CALL_OBJ = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_2", "type": "function",
                            "function": {"name": "calc", "arguments": {"expr": "3*7"}}}]}
CONVERSATIONS = [
    ([{"role": "user", "content": "Hi"}], None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 47 + 38?"}], None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo — ünïcode ✓ 東京"},
      {"role": "assistant", "content": "85"}, {"role": "user", "content": "  spaces\n\nand\ttabs  "}], None),
    ([{"role": "user", "content": "Compute 2+2 with the tool."}, CALL_STR,
      {"role": "tool", "tool_call_id": "call_1", "content": "4"}], TOOLS),
    ([{"role": "system", "content": "Use tools."}, {"role": "user", "content": "3*7?"}, CALL_OBJ,
      {"role": "tool", "tool_call_id": "call_2", "content": "21"},
      {"role": "assistant", "content": "It is 21.", "name": None}], TOOLS),
    ([{"role": "user", "content": "Think first."},
      {"role": "assistant", "content": "Done.", "reasoning_content": "hmm <b>"}], None),
]
TEXTS = ["", " ", "hello world", "  leading", "trailing  ", "a\n\n\nb", "<|im_start|>user\nhi<|im_end|>",
         "<tool_call>{\"name\": \"calc\"}</tool_call>", "12345678901234567890", "Ünïcödé 東京 🚀", "\t\r\n"]

QWEN2_STYLE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nReply with <tool_call>{\\"name\\": ..., \\"arguments\\": ...}</tool_call><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>' + '\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA31_STYLE = """{{- bos_token }}
{%- set date_string = strftime_now("%d %b %Y") %}
{%- if messages[0]['role'] == 'system' %}
{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}{{- "<|eot_id|>" }}
{%- if tools is not none %}
{%- if messages | length == 0 %}{{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}{%- endif %}
{%- set first_user_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
{{- "Given the following functions, respond with a JSON for a function call.\\n\\n" }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- set ns = namespace(calls=0) %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ (message['content'] or '') | trim + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- set ns.calls = ns.calls + 1 %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{{- '{"name": "' + tool_call.name + '", "parameters": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- "}" }}{{- "<|eot_id|>" }}
{%- elif message.role == "tool" or message.role == "ipython" %}
{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
{%- if message.content is mapping or message.content is iterable and message.content is not string %}{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}
{{- "<|eot_id|>" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tokenizer folders, one per template family, saved by transformers as a model folder is."""
    base = tmp_path_factory.mktemp("tok")
    out = {}
    for family in ("chatml", "llama3"):
        tok = train_tokenizer(vocab_size=600, template=family)
        tok.save_pretrained(base / family)
        out[family] = base / family
    for name, source, template in (("qwen2-style", "chatml", QWEN2_STYLE), ("llama31-style", "llama3", LLAMA31_STYLE)):
        shutil.copytree(out[source], base / name)
        (base / name / "chat_template.jinja").write_text(template)
        out[name] = base / name
    # several named templates, the tool one chosen when tools are passed
    shutil.copytree(out["chatml"], base / "named")
    config = json.loads((base / "named" / "tokenizer_config.json").read_text())
    default = (out["chatml"] / "chat_template.jinja").read_text() if (out["chatml"] / "chat_template.jinja").exists() \
        else config["chat_template"]
    (base / "named" / "chat_template.jinja").unlink(missing_ok=True)
    config["chat_template"] = [{"name": "default", "template": default}, {"name": "tool_use", "template": QWEN2_STYLE}]
    (base / "named" / "tokenizer_config.json").write_text(json.dumps(config))
    out["named"] = base / "named"
    return out


FAMILIES = ["chatml", "llama3", "qwen2-style", "llama31-style", "named"]


def pair(folder):
    return ChatTokenizer.load(folder), transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("family", FAMILIES)
def test_renders_as_transformers(folders, family):
    lean, hf = pair(folders[family])
    rendered = 0
    for messages, tools in CONVERSATIONS:
        for gen in (False, True):
            want = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
            got = lean.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
            assert got == want, (family, messages, tools, gen)
            assert lean.encode(got) == list(hf.encode(want, add_special_tokens=False))
            rendered += 1
    assert rendered == 2 * len(CONVERSATIONS)


@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_encodes_and_decodes_as_transformers(folders, family):
    lean, hf = pair(folders[family])
    for text in TEXTS:
        ids = lean.encode(text)
        assert ids == list(hf.encode(text, add_special_tokens=False)), text
        assert lean.decode(ids) == hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert lean.get_vocab() == hf.get_vocab() and len(lean) == len(hf)
    assert lean.eos_token == hf.eos_token and lean.eos_token_id == hf.eos_token_id
    assert lean.model_max_length == hf.model_max_length


def test_tools_reach_the_template_and_tool_calls_render(folders):
    lean = ChatTokenizer.load(folders["qwen2-style"])
    text = lean.apply_chat_template(CONVERSATIONS[4][0], tools=TOOLS, tokenize=False)
    assert '"description": "Evaluate <arithmetic> & more"' in text  # tojson does not escape HTML
    assert '{"name": "calc", "arguments": {"expr": "3*7"}}' in text
    assert "<tool_response>\n21\n</tool_response>" in text


def test_named_templates_pick_the_tool_one_with_tools(folders):
    lean = ChatTokenizer.load(folders["named"])
    plain = lean.apply_chat_template(CONVERSATIONS[0][0], tokenize=False)
    tooled = lean.apply_chat_template(CONVERSATIONS[0][0], tools=TOOLS, tokenize=False)
    assert "# Tools" in tooled and "# Tools" not in plain


def test_the_sandbox_refuses_what_a_template_must_not_do(folders):
    import jinja2

    lean = ChatTokenizer.load(folders["chatml"])
    for bad in ("{{ messages.__class__.__mro__ }}", "{{ ''.__class__.__subclasses__() }}",
                "{% set ns = namespace() %}{% set ns._x = 1 %}"):
        with pytest.raises(jinja2.exceptions.SecurityError):
            lean.apply_chat_template([{"role": "user", "content": "x"}], chat_template=bad, tokenize=False)
    with pytest.raises(jinja2.exceptions.TemplateError, match="no tools"):
        lean.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                 chat_template="{{ raise_exception('no tools') }}")


def test_conversations_append_token_exactly_with_the_lean_tokenizer(folders):
    """jet.chat's append rule holds with the lean tokenizer: the second prompt extends the first call."""
    for family in ("chatml", "llama3"):
        lean, hf = pair(folders[family])
        prompts = []
        for tok in (lean, hf):
            conv = Conversations(Template(tok))
            first = [{"role": "user", "content": "Guess a number."}]
            p1 = conv.prompt(first)
            completion = conv.template.encode("I guess 5.") + [tok.eos_token_id]
            reply = conv.reply(completion, "stop")
            conv.record(first, None, p1.ids, completion, "stop", reply)
            p2 = conv.prompt([*first, reply, {"role": "user", "content": "Higher."}])
            assert p2.extends is not None and p2.ids[:len(p1.ids) + len(completion)] == p1.ids + completion
            prompts.append((p1.ids, p2.ids))
        assert prompts[0] == prompts[1], family


def test_missing_and_broken_files_are_clear_errors(tmp_path, folders):
    from jet.errors import ConfigError

    with pytest.raises(ConfigError, match="no tokenizer.json"):
        ChatTokenizer.load(tmp_path)
    shutil.copytree(folders["chatml"], tmp_path / "broken")
    (tmp_path / "broken" / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer_config.json: not valid JSON"):
        ChatTokenizer.load(tmp_path / "broken")
    assert isinstance(load_tokenizer(folders["chatml"]), ChatTokenizer)


def test_no_template_is_a_clear_error(tmp_path, folders):
    shutil.copytree(folders["chatml"], tmp_path / "bare")
    (tmp_path / "bare" / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tmp_path / "bare" / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "bare" / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        ChatTokenizer.load(tmp_path / "bare").apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.realmodel
@pytest.mark.slow
def test_smollm2_renders_encodes_and_decodes_as_transformers(smollm2):
    _, folder = smollm2
    lean, hf = pair(folder)
    for messages, tools in CONVERSATIONS:
        if tools:  # SmolLM2's template has no tools section; it must still render the messages alike
            messages = [m for m in messages if m["role"] in ("system", "user") or not m.get("tool_calls")]
            messages = [m for m in messages if m["role"] != "tool"]
        for gen in (False, True):
            want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            got = lean.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert got == want
            assert lean.encode(got) == list(hf.encode(want, add_special_tokens=False))
    for text in TEXTS:
        ids = lean.encode(text)
        assert ids == list(hf.encode(text, add_special_tokens=False)), text
        assert lean.decode(ids) == hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert lean.eos_token == hf.eos_token and lean.get_vocab() == hf.get_vocab()
