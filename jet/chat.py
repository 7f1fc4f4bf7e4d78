"""Chat prompts built token-in-token-out, and assistant replies parsed from token ids.

What it is: `Conversations` keeps, for one agent on one model, the exact token
ids each call saw and produced, and builds the next prompt by APPENDING to them
(docs/design.md, "Timelines"). `parse_reply` turns a completion into an assistant
message (content and `<tool_call>{json}</tool_call>` tool calls, the format the
templates of `jet.models` render). The chat template is the tokenizer's own.

How a prompt is built for `messages` (a list of chat messages):
1. Find the kept turn whose messages (the call's prompt messages plus the
   assistant reply it returned) are the longest prefix of `messages`, with the
   same tools. Messages compare by content, not identity (an OpenAI-style
   tool call with JSON-string arguments equals one with an object).
2. None: render the whole conversation with `add_generation_prompt=True` and
   encode it (no special tokens added: the template writes them all).
3. Found, with kept ids K = that call's prompt + completion ids: render the
   text of the kept messages (P, no generation prompt) and of the new
   conversation (F, generation prompt). F must start with P (templates that
   rewrite history, e.g. dropping old reasoning, fail this and take step 2).
   The delta is `tail + F[len(P):]`, where `tail` is what the template writes
   after the part the model generated (ChatML's "\\n" after <|im_end|>;
   "<|im_end|>\\n" when the completion was cut by max_tokens). The prompt is
   K + encode(delta): the model's own ids are never re-tokenised.

Invariants: a prompt decodes to the text the template renders for the
conversation whenever the replies were passed back unchanged; when they
were edited, the edit starts a fresh render (a new timeline in
`jet.timeline.merge_calls`). What it is not: no I/O, no sampling; the tokenizer
is any Hugging Face tokenizer with a chat template.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

Message = dict[str, Any]
MAX_TURNS = 64  # kept turns per conversation set; the oldest are forgotten

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


# ---- messages


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _tool_call_key(call: Any) -> dict:
    fn = call.get("function") or call
    return {"name": fn.get("name"), "arguments": _arguments(fn.get("arguments"))}


def message_key(m: Message) -> str:
    """A canonical form of a message: equal for messages the template renders alike."""
    out = {k: v for k, v in m.items() if v is not None and k not in ("tool_calls", "content")}
    out["content"] = m.get("content") or ""
    if m.get("tool_calls"):
        out["tool_calls"] = [_tool_call_key(c) for c in m["tool_calls"]]
    return json.dumps(out, sort_keys=True, default=str)


def tools_key(tools: Sequence[dict] | None) -> str:
    return json.dumps(list(tools or []), sort_keys=True, default=str)


def parse_reply(text: str, tool_calls: bool = True) -> Message:
    """An assistant message from completion text (stop token removed).

    Each `<tool_call>{"name": ..., "arguments": ...}</tool_call>` that holds
    valid JSON becomes an OpenAI-style tool call (arguments as a JSON string)
    and is cut from the content; anything malformed stays in the content.
    With `tool_calls=False` (OpenAI's tool_choice "none") all of it is content.
    """
    if not tool_calls:
        return {"role": "assistant", "content": text}
    calls, kept, last = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        args = body.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                      "function": {"name": body["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
        kept.append(text[last:match.start()])
        last = match.end()
    kept.append(text[last:])
    message: Message = {"role": "assistant", "content": "".join(kept)}
    if calls:
        message["tool_calls"] = calls
    return message


# ---- the template


class Template:
    """A tokenizer's chat template as text in, ids out (no special tokens added on encode)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def render(self, messages: Sequence[Message], tools: Sequence[dict] | None, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                  tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


# ---- conversations


@dataclass(frozen=True, slots=True)
class Turn:
    """What one call saw and produced, kept so later prompts can append to it."""

    keys: tuple[str, ...]  # message_key of the prompt messages, then of the reply
    tools: str  # tools_key
    ids: tuple[int, ...]  # prompt ids + completion ids
    completion: tuple[int, ...]
    finish_reason: str  # "stop": the last completion id is a stop token


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: list[int]
    extends: Turn | None  # the kept turn this prompt appends to, or None for a fresh render


class Conversations:
    """The kept turns of one agent on one model; builds prompts that append to them."""

    def __init__(self, template: Template, max_turns: int = MAX_TURNS):
        self.template = template
        self.turns: list[Turn] = []
        self.max_turns = max_turns

    def prompt(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> Prompt:
        if not messages:
            raise ValueError("chat needs at least one message")
        keys = [message_key(m) for m in messages]
        tkey = tools_key(tools)
        for turn in sorted(self.turns, key=lambda t: len(t.keys), reverse=True):
            n = len(turn.keys)
            if turn.tools == tkey and n <= len(keys) and tuple(keys[:n]) == turn.keys:
                delta = self._delta(turn, messages, tools)
                if delta is not None:
                    return Prompt(list(turn.ids) + self.template.encode(delta), turn)
        text = self.template.render(messages, tools, generation_prompt=True)
        return Prompt(self.template.encode(text), None)

    def _delta(self, turn: Turn, messages: Sequence[Message], tools) -> str | None:
        """The text to append to `turn.ids` for `messages`, or None if the template does not append."""
        n = len(turn.keys)
        before = self.template.render(messages[: n - 1], tools, generation_prompt=True)
        kept = self.template.render(messages[:n], tools, generation_prompt=False)
        full = self.template.render(messages, tools, generation_prompt=True)
        if not (kept.startswith(before) and full.startswith(kept)):
            return None
        tail = self._tail(turn, kept[len(before):])
        return None if tail is None else tail + full[len(kept):]

    def _tail(self, turn: Turn, rendered: str) -> str | None:
        """What the template writes for the reply after the part the model generated."""
        generated = self.template.decode(turn.completion)
        if rendered.startswith(generated):
            return rendered[len(generated):]
        if turn.finish_reason != "stop" or not turn.completion:
            return None
        content = self.template.decode(turn.completion[:-1])
        if rendered.startswith(content):  # stopped by a stop id the template does not write
            return rendered[len(content):]
        stop = self.template.decode(turn.completion[-1:])
        at = rendered.rfind(stop) if stop else -1  # the reply was re-serialised (tool-call JSON)
        return rendered[at + len(stop):] if at >= 0 else None

    def record(self, messages: Sequence[Message], tools: Sequence[dict] | None, prompt_ids: Sequence[int],
               completion: Sequence[int], finish_reason: str, reply: Message) -> Turn:
        turn = Turn(keys=tuple(message_key(m) for m in [*messages, reply]), tools=tools_key(tools),
                    ids=tuple(prompt_ids) + tuple(completion), completion=tuple(completion),
                    finish_reason=finish_reason)
        self.turns.append(turn)
        del self.turns[: -self.max_turns]
        return turn

    def reply(self, completion: Sequence[int], finish_reason: str, tool_calls: bool = True) -> Message:
        """The assistant message for a completion (its stop token, when it stopped, removed)."""
        ids = completion[:-1] if finish_reason == "stop" and completion else completion
        return parse_reply(self.template.decode(ids), tool_calls)
