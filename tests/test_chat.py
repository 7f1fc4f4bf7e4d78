"""jet.chat: token-in-token-out prompts on the ChatML and Llama-3 templates of jet.models."""

import pytest

from jet.chat import Conversations, Template, message_key, parse_reply
from jet.models import train_tokenizer

SYSTEM = {"role": "system", "content": "You play a guessing game."}
USER = {"role": "user", "content": "Guess a number between 1 and 10."}
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def template(request):
    return Template(train_tokenizer(vocab_size=512, template=request.param))


def complete(conv, messages, text, finish="stop", tools=None):
    """Play one call: prompt, a completion of `text` (+ the end-of-turn token when it stopped), record."""
    tok = conv.template.tokenizer
    prompt = conv.prompt(messages, tools)
    completion = conv.template.encode(text) + ([tok.eos_token_id] if finish == "stop" else [])
    reply = conv.reply(completion, finish)
    conv.record(messages, tools, prompt.ids, completion, finish, reply)
    return prompt, completion, reply


def test_first_prompt_is_the_rendered_template(template):
    conv = Conversations(template)
    prompt = conv.prompt([SYSTEM, USER])
    assert prompt.extends is None
    assert prompt.ids == template.encode(template.render([SYSTEM, USER], None, True))
    assert template.decode(prompt.ids) == template.render([SYSTEM, USER], None, True)


def test_later_turns_append_to_the_kept_ids(template):
    conv = Conversations(template)
    p1, c1, r1 = complete(conv, [SYSTEM, USER], "I guess 5.")
    assert r1 == {"role": "assistant", "content": "I guess 5."}
    m2 = [SYSTEM, USER, r1, {"role": "user", "content": "5 is too low. Go higher."}]
    p2, c2, r2 = complete(conv, m2, "8")
    assert p2.extends is not None and p2.ids[: len(p1.ids) + len(c1)] == p1.ids + c1
    # The replies came back unchanged, so the appended prompt is exactly the template's render.
    assert p2.ids == template.encode(template.render(m2, None, True))
    m3 = m2 + [r2, {"role": "user", "content": "8 is too high. Go lower."}]
    p3 = conv.prompt(m3)
    assert p3.ids[: len(p2.ids) + len(c2)] == p2.ids + c2
    assert p3.ids == template.encode(template.render(m3, None, True))


def test_kept_ids_are_never_retokenised(template):
    """A completion in non-canonical pieces (a byte at a time) stays as generated: no drift."""
    conv = Conversations(template)
    tok = template.tokenizer
    prompt = conv.prompt([SYSTEM, USER])
    pieces = [i for ch in "I guess 7." for i in template.encode(ch)] + [tok.eos_token_id]
    assert pieces[:-1] != template.encode("I guess 7.")
    reply = conv.reply(pieces, "stop")
    conv.record([SYSTEM, USER], None, prompt.ids, pieces, "stop", reply)
    m2 = [SYSTEM, USER, reply, {"role": "user", "content": "Correct!"}]
    p2 = conv.prompt(m2)
    assert p2.ids[: len(prompt.ids) + len(pieces)] == prompt.ids + pieces
    assert p2.ids != template.encode(template.render(m2, None, True))  # a re-render would differ...
    assert template.decode(p2.ids) == template.render(m2, None, True)  # ...though the text is the same


def test_tool_calls_are_parsed_and_appended_after(template):
    conv = Conversations(template)
    text = 'Let me compute.<tool_call>{"name": "calc", "arguments": {"expression": "2 + 3"}}</tool_call>'
    p1, c1, reply = complete(conv, [SYSTEM, USER], text, tools=TOOLS)
    assert reply["content"] == "Let me compute."
    [call] = reply["tool_calls"]
    assert call["function"] == {"name": "calc", "arguments": '{"expression": "2 + 3"}'}
    m2 = [SYSTEM, USER, reply, {"role": "tool", "content": "5"}]
    p2 = conv.prompt(m2, TOOLS)
    assert p2.ids[: len(p1.ids) + len(c1)] == p1.ids + c1
    assert p2.ids == template.encode(template.render(m2, TOOLS, True))
    # Other tools: the system preamble changes, so nothing is appended to.
    assert conv.prompt(m2, TOOLS + [{"type": "function", "function": {"name": "x"}}]).extends is None


def test_a_completion_cut_by_max_tokens_is_closed_by_the_template(template):
    conv = Conversations(template)
    p1, c1, reply = complete(conv, [SYSTEM, USER], "I guess", finish="length")
    m2 = [SYSTEM, USER, reply, {"role": "user", "content": "Finish your sentence."}]
    p2 = conv.prompt(m2)
    assert p2.ids[: len(p1.ids) + len(c1)] == p1.ids + c1
    assert template.decode(p2.ids) == template.render(m2, None, True)


def test_rewritten_history_starts_a_fresh_render(template):
    conv = Conversations(template)
    complete(conv, [SYSTEM, USER], "I guess 5.")
    edited = [SYSTEM, USER, {"role": "assistant", "content": "I guess 6."}, {"role": "user", "content": "No."}]
    prompt = conv.prompt(edited)
    assert prompt.extends is None and prompt.ids == template.encode(template.render(edited, None, True))


def test_branches_extend_the_longest_matching_turn(template):
    conv = Conversations(template)
    p1, c1, r1 = complete(conv, [SYSTEM, USER], "3")
    m2 = [SYSTEM, USER, r1, {"role": "user", "content": "3 is too low. Go higher."}]
    p2, c2, r2 = complete(conv, m2, "9")
    deeper = conv.prompt(m2 + [r2, {"role": "user", "content": "9 is too high. Go lower."}])
    assert deeper.extends is not None and len(deeper.extends.ids) == len(p2.ids) + len(c2)
    other = conv.prompt([SYSTEM, USER, r1, {"role": "user", "content": "Try again."}])
    assert other.extends is not None and len(other.extends.ids) == len(p1.ids) + len(c1)


def test_parse_reply_keeps_malformed_tool_calls_as_text():
    text = 'a<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>b<tool_call>{oops}</tool_call>'
    m = parse_reply(text)
    assert m["content"] == "ab<tool_call>{oops}</tool_call>"
    assert [c["function"]["name"] for c in m["tool_calls"]] == ["f"]
    assert parse_reply("plain") == {"role": "assistant", "content": "plain"}


def test_message_keys_compare_content_not_spelling():
    a = {"role": "assistant", "content": None,
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    b = {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {"x": 1}}]}
    assert message_key(a) == message_key(b)
    assert message_key(a) != message_key({**b, "content": "hi"})
