"""The OpenAI chat-completions format, as the gateway speaks it: request bodies in, responses out.

What it is: `parse_chat` validates a `/v1/chat/completions` body into a
`ChatRequest` (messages normalised to what chat templates render, sampling
mapped onto `jet.llm`'s), raising `BadRequest` with the offending parameter
and a reason; `completion` and `stream_events` build the response body and
its server-sent-event chunks. Pure functions: no I/O, no tokenizer.

Accepted: messages with roles system / developer (as system) / user /
assistant / tool, text content as a string or text parts, assistant
`tool_calls`, `tools` (functions), temperature, top_p, max_tokens /
max_completion_tokens, stop (strings; the gateway maps them to single stop
tokens), seed, stream (+ stream_options.include_usage), n = 1, logprobs
(the sampled tokens' behaviour logprobs, under the request's temperature and
top_p) with top_logprobs = 0.
- tool_choice: "auto" (the default) and "none" (tool-call markup the model
  writes stays in the content; the tools are still rendered, as OpenAI does)
  are honoured; "required" and a named function get 400: the gateway does not
  constrain decoding, so it cannot promise a tool call.
- response_format: "text" as is; json_object / json_schema are served as
  plain, unconstrained text (`ChatRequest.warning` says so; the gateway logs
  it and sends it in the `Jet-Warning` header): an RL policy learns the
  format from its reward, which a hard 400 would never let it try.
- n > 1 gets 400: extra choices the agent never continues would be trained
  on a reward they did not earn (like an undelivered call).
- top_logprobs > 0 gets 400: inference returns only the sampled token's logprob.
Other OpenAI parameters (penalties, user, metadata, store, parallel_tool_calls,
...) are accepted and ignored, so SDKs and frameworks that send them work.
Message fields other than role, content, name, tool_calls and tool_call_id
(refusal, annotations, audio: what an SDK message object dumps) are dropped,
so a reply passed back as the SDK returned it matches the kept turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterator

import orjson

from jet.errors import JetError

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_STOP = 4  # stop strings per request (as OpenAI)
STREAM_PIECE = 16  # characters of content per streamed chunk


class BadRequest(JetError):
    """A request body the gateway cannot serve (HTTP 400); `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """What the gateway generates for, whichever API the request came from."""

    messages: list[dict]
    tools: list[dict] | None = None
    model: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, max_tokens, seed
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    tool_choice: str = "auto"  # "auto" or "none"
    logprobs: bool = False
    warning: str | None = None  # served, but not as asked (response_format)

    def texts(self) -> Iterator[str]:
        """The text this request renders at least: contents, tool calls, tools."""
        for m in self.messages:
            yield m.get("content") or ""
            for c in m.get("tool_calls") or ():
                yield c["function"]["name"]
                yield c["function"]["arguments"]
        if self.tools:
            yield json.dumps(self.tools)

    def text_chars(self) -> int:
        """Characters of `texts`: the prompt has at least text_chars / (longest token) tokens."""
        return sum(len(t) for t in self.texts())


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _number(body: dict, key: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{key}: expected a number, got {value!r}", key)
    if value > high or value < low or (low_open and value == low):
        raise BadRequest(f"{key}: must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}", key)
    return float(value)


def _int(body: dict, key: str, low: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key}: expected an integer, got {value!r}", key)
    if low is not None and value < low:
        raise BadRequest(f"{key}: must be >= {low}, got {value}", key)
    return value


def _text(value: Any, where: str, *, optional: bool = False) -> str | None:
    """Message content: a string, or a list of text parts (joined)."""
    if value is None:
        if optional:
            return None
        raise BadRequest(f"{where}: content is required", where)
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        out = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}[{j}]: only text content parts are supported, got {kind!r}", where)
            out.append(part["text"])
        return "".join(out)
    raise BadRequest(f"{where}: expected a string or a list of text parts, got {type(value).__name__}", where)


def _tool_calls(value: Any, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise BadRequest(f"{where}: expected a list", where)
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}[{j}]: expected {{'type': 'function', 'function': {{'name', 'arguments'}}}}",
                             where)
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args)
        out.append({"id": str(call.get("id") or f"call_{j}"), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _message(i: int, m: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise BadRequest(f"{where}: expected an object with a role, got {type(m).__name__}", "messages")
    role = m.get("role")
    if role not in ROLES:
        raise BadRequest(f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}", "messages")
    out: dict[str, Any] = {"role": ROLES[role]}
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if role == "assistant":
        out["content"] = _text(m.get("content"), f"{where}.content", optional=bool(m.get("tool_calls")))
        if m.get("tool_calls"):
            out["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
    else:
        out["content"] = _text(m.get("content"), f"{where}.content")
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise BadRequest(f"{where}.tool_call_id: a tool message needs the id of the call it answers", "messages")
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _tools(value: Any) -> list[dict] | None:
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise BadRequest("tools: expected a list of {'type': 'function', 'function': {...}}", "tools")
    for j, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function" or not isinstance(fn.get("name"), str):
            raise BadRequest(f"tools[{j}]: expected {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise BadRequest(f"stop: expected a string or a list of at most {MAX_STOP} non-empty strings", "stop")
    return tuple(stops)


def tool_choice(value: Any, named: Any = None) -> str:
    """"auto" or "none"; BadRequest for what the gateway cannot promise ("required", a named function)."""
    if value in (None, "auto", "none"):
        return value or "auto"
    if value == "required" or isinstance(value, dict):
        shown = "'required'" if value == "required" else f"a named function ({named or value!r})"
        raise BadRequest(f"tool_choice: {shown} cannot be honoured: the gateway samples freely (no "
                         "constrained decoding), so it cannot promise a tool call; send 'auto' (and reward "
                         "the tool use) or 'none'", "tool_choice", "unsupported_tool_choice")
    raise BadRequest(f"tool_choice: expected 'auto', 'none', 'required' or a function, got {value!r}",
                     "tool_choice")


def format_warning(kind: Any, param: str) -> str | None:
    """The warning for a structured-output format served as plain text (None for text)."""
    if kind in (None, "text"):
        return None
    if kind not in ("json_object", "json_schema"):
        raise BadRequest(f"{param}: expected type 'text', 'json_object' or 'json_schema', got {kind!r}", param)
    return (f"{param} {kind!r} is served as plain text: the gateway does not constrain decoding, so the "
            "reply may not parse; the reward decides")


def logprobs(body: dict) -> bool:
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise BadRequest(f"logprobs: expected a boolean, got {wanted!r}", "logprobs")
    top = _int(body, "top_logprobs", 0)
    if top:
        raise BadRequest(f"top_logprobs: {top} asked, but inference returns only the sampled token's logprob "
                         "(send 0 or leave it out)", "top_logprobs")
    return bool(wanted)


def parse_chat(body: Any) -> ChatRequest:
    """A validated chat request; BadRequest (with the parameter and the reason) otherwise."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: required, a non-empty list of chat messages", "messages")
    if body.get("n") not in (None, 1):
        raise BadRequest(f"n: only n=1 is supported, got {body['n']!r} (choices the agent does not continue "
                         "would be trained on a reward they did not earn; send n separate requests)", "n")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"model: expected a string, got {model!r}", "model")
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest(f"stream: expected a boolean, got {body['stream']!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options: expected an object", "stream_options")
    fmt = body.get("response_format")
    if fmt is not None and not isinstance(fmt, dict):
        raise BadRequest("response_format: expected an object like {'type': 'text'}", "response_format")
    sampling = {"temperature": _number(body, "temperature", 0, 2), "top_p": _number(body, "top_p", 0, 1, True),
                "max_tokens": _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1),
                "seed": _int(body, "seed")}
    return ChatRequest(messages=[_message(i, m) for i, m in enumerate(messages)], tools=_tools(body.get("tools")),
                       model=model, sampling={k: v for k, v in sampling.items() if v is not None},
                       stop=_stop(body.get("stop")), stream=bool(body.get("stream")),
                       include_usage=bool(options.get("include_usage")), tool_choice=tool_choice(body.get(
                           "tool_choice")), logprobs=logprobs(body),
                       warning=format_warning((fmt or {}).get("type"), "response_format"))


# ---- responses


def assistant_message(reply: dict) -> dict:
    """An OpenAI assistant message from a parsed reply: content null when it only calls tools."""
    calls = reply.get("tool_calls") or []
    content = reply.get("content") or ""
    message: dict[str, Any] = {"role": "assistant", "content": None if calls and not content.strip() else content}
    if calls:
        message["tool_calls"] = calls
    return message


def finish_reason(reply: dict, generated: str) -> str:
    if reply.get("tool_calls"):
        return "tool_calls"
    return "length" if generated == "length" else "stop"


def token_logprobs(tokens: list[str], logprobs: list[float]) -> list[dict]:
    """OpenAI's per-token logprob entries (no alternatives: top_logprobs is always empty)."""
    return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs)]


def completion(rid: str, created: int, model: str, reply: dict, generated: str, prompt_tokens: int,
               completion_tokens: int, version: int, logprobs: list[dict] | None = None) -> dict:
    """The body of a non-streaming response; `logprobs` from `token_logprobs` when they were asked for."""
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": f"jet-v{version}",
            "choices": [{"index": 0, "message": assistant_message(reply),
                         "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                         "finish_reason": finish_reason(reply, generated)}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def chunk(head: dict, delta: dict, finish: str | None = None, include_usage: bool = False,
          logprobs: list[dict] | None = None) -> bytes:
    """One server-sent event of a streamed completion."""
    body = {**head, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                         "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None}}]}
    if include_usage:
        body["usage"] = None
    return b"data: " + orjson.dumps(body) + b"\n\n"


def stream_head(rid: str, created: int, model: str) -> dict:
    return {"id": rid, "created": created, "model": model, "system_fingerprint": None}


def stream_events(body: dict, include_usage: bool) -> Iterator[bytes]:
    """The events of a finished completion after the opening one (`chunk(head, {"role": ...})`, sent
    before generation): content pieces (with their logprobs), tool calls, finish, usage, [DONE]."""
    choice = body["choices"][0]
    message = choice["message"]
    head = {k: body[k] for k in ("id", "created", "model", "system_fingerprint")}
    content = message["content"] or ""
    lps = (choice["logprobs"] or {}).get("content")
    for at in range(0, len(content), STREAM_PIECE):
        yield chunk(head, {"content": content[at:at + STREAM_PIECE]}, None, include_usage)
    if lps:
        yield chunk(head, {}, None, include_usage, lps)
    for j, call in enumerate(message.get("tool_calls") or []):
        yield chunk(head, {"tool_calls": [{"index": j, **call}]}, None, include_usage)
    yield chunk(head, {}, choice["finish_reason"], include_usage)
    if include_usage:
        yield b"data: " + orjson.dumps({**head, "object": "chat.completion.chunk", "choices": [],
                                        "usage": body["usage"]}) + b"\n\n"
    yield b"data: [DONE]\n\n"


def stream_error(message: str, kind: str, code: str | None = None) -> bytes:
    """An error after the stream began (the status line is gone): the `openai` SDK raises it."""
    return b"data: " + orjson.dumps(error_body(message, kind, None, code)) + b"\n\ndata: [DONE]\n\n"
