"""The OpenAI chat-completions format, as the gateway speaks it: request bodies in, responses out.

What it is: `ChatBody` declares a `/v1/chat/completions` body (pydantic:
every accepted field with its type and bounds); `parse_chat` validates one
into a `ChatRequest` (messages normalised to what chat templates render,
sampling mapped onto `jet.llm`'s), raising `BadRequest` with the offending
parameter and a reason (`bad_request` words pydantic's errors the gateway's way); `completion` and `stream_events` build the response body and
its server-sent-event chunks. Pure functions: no I/O, no tokenizer.

Accepted: messages with roles system / developer (as system) / user /
assistant / tool, text content as a string or text parts, assistant
`tool_calls`, `tools` (functions), the sampling settings (`jet.sampling.PARAMS`:
temperature, top_p), max_tokens /
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
from typing import Annotated, Any, Iterator, Literal, TypeVar

import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from jet.errors import JetError
from jet.sampling import PARAMS as SETTINGS
from jet.sampling import Param

M = TypeVar("M", bound=BaseModel)

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


# ---- request bodies, declared: pydantic models whose errors become BadRequest (`bad_request`)
#
# Every field's type says what it accepts; `bad_request` turns pydantic's first error into the
# gateway's message, `<where>: <what was wrong>` (where = the JSON path, e.g. messages[0].role), and
# its `param`. A field may say more than its type with `json_schema_extra`: `bad`, the whole message
# for any error at that field; `param: "here"`, errors under it name the field itself as `param`
# (default: the body's top-level key). Checks no type can express raise `Refused` (a message, and
# optionally the sub-field it is about and the param) from a validator.


def refused(message: str, *, field: str | None = None, param: str | None = None) -> PydanticCustomError:
    """A validator's refusal: `message` after the field's path (or its sub-field `field`: a name or `[j]`);
    `param="here"` names that path as the error's param."""
    return PydanticCustomError("refused", message, {"field": field, "param": param})


def _in_range(low: float, high: float, low_open: bool = False):
    def check(value: float) -> float:
        if value > high or value < low or (low_open and value == low):
            raise refused(f"must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value:g}")
        return value
    return AfterValidator(check)


def _at_least(low: int):
    def check(value: int) -> int:
        if value < low:
            raise refused(f"must be >= {low}, got {value}")
        return value
    return AfterValidator(check)


Count = Annotated[int, Strict(), _at_least(1)]  # max_tokens and the like


def _stop(value: Any) -> tuple[str, ...]:
    stops = () if value is None else [value] if isinstance(value, str) else value
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise refused(f"expected a string or a list of at most {MAX_STOP} non-empty strings")
    return tuple(stops)


def _tool_choice(value: Any) -> str:
    """"auto" or "none"; refused: what the gateway cannot promise ("required", a named function)."""
    if value in (None, "auto", "none"):
        return value or "auto"
    if value == "required" or isinstance(value, dict):
        named = value.get("name") or (value.get("function") or {}).get("name") if isinstance(value, dict) else None
        shown = "'required'" if value == "required" else f"a named function ({named or value!r})"
        raise PydanticCustomError("unsupported_tool_choice", f"{shown} cannot be honoured: the gateway samples "
                                  "freely (no constrained decoding), so it cannot promise a tool call; send 'auto' "
                                  "(and reward the tool use) or 'none'", {})
    raise refused(f"expected 'auto', 'none', 'required' or a function, got {value!r}")


Stop = Annotated[tuple[str, ...], BeforeValidator(_stop)]
ToolChoice = Annotated[str, BeforeValidator(_tool_choice)]


class Body(BaseModel):
    """A request body or a part of one: unknown keys are accepted and ignored (SDKs send many)."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class Format(Body):
    """response_format / text.format: plain text, or a structured format served as plain text."""

    type: Literal["text", "json_object", "json_schema"] | None = None

    def warning(self, param: str) -> str | None:
        if self.type in (None, "text"):
            return None
        return (f"{param} {self.type!r} is served as plain text: the gateway does not constrain decoding, so "
                "the reply may not parse; the reward decides")


def _setting(p: Param) -> Any:
    """A setting of the sampling distribution as a body field: a number in its range, or in the OpenAI API's
    where that is narrower (temperature: [0, 2])."""
    return Annotated[float, Strict(), _in_range(p.low, p.high if p.api_high is None else p.api_high, p.low_open)] | None


# Every setting of the sampling distribution (`jet.sampling.PARAMS`: temperature, top_p), an optional field each.
Settings = create_model("Settings", __base__=Body, **{p.name: (_setting(p), None) for p in SETTINGS})


class Sampling(Settings):
    """What both APIs share: the model, sampling, stop strings, tools choice, logprobs, streaming."""

    model: str | None = None
    seed: int | None = None
    stop: Stop = ()
    stream: bool = False
    tool_choice: ToolChoice = "auto"
    logprobs: bool | None = None
    top_logprobs: Annotated[int, _at_least(0)] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _no_alternatives(cls, top: int | None) -> int | None:
        if top:
            raise refused(f"{top} asked, but inference returns only the sampled token's logprob "
                          "(send 0 or leave it out)")
        return top

    def sampling(self, max_tokens: int | None) -> dict[str, Any]:
        values = {**{p.name: getattr(self, p.name) for p in SETTINGS}, "max_tokens": max_tokens, "seed": self.seed}
        return {k: v for k, v in values.items() if v is not None}


class TextPart(Body):
    type: Literal["text"]
    text: str


def parts(kinds: tuple[str, ...], what: str):
    """Text content: a string, or a list of text parts of `kinds` (joined); `what` names them in errors."""
    def check(value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise refused(f"expected a string or a list of text parts, got {type(value).__name__}")
        out = []
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in kinds or not isinstance(part.get("text"), str):
                raise refused(f"only {what} are supported, got {kind!r}", field=f"[{j}]")
            out.append(part["text"])
        return "".join(out)
    return BeforeValidator(check)


Text = Annotated[str | None, parts(("text",), "text content parts")]


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


Arguments = Annotated[str, BeforeValidator(_arguments)]  # a function call's arguments, as a JSON string


class FunctionCall(Body):
    name: str
    arguments: Arguments = "{}"


class ToolCall(Body):
    model_config = ConfigDict(json_schema_extra={"bad": "expected {'type': 'function', 'function': {'name', "
                                                        "'arguments'}}"})
    id: Any = None
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text = Field(None, json_schema_extra={"param": "here"})
    name: Any = None
    tool_calls: list[ToolCall] | None = Field(None, json_schema_extra={"param": "here"})
    tool_call_id: Any = None

    @model_validator(mode="before")
    @classmethod
    def _an_object(cls, m: Any) -> Any:
        if not isinstance(m, dict):
            raise refused(f"expected an object with a role, got {type(m).__name__}")
        return m

    @model_validator(mode="after")
    def _as_its_role_needs(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise refused("content is required", field="content", param="here")
        if self.role == "tool" and not isinstance(self.tool_call_id, str):
            raise refused("a tool message needs the id of the call it answers", field="tool_call_id")
        return self

    def normalised(self) -> dict:
        """The message as chat templates render it (see the module docstring)."""
        out: dict[str, Any] = {"role": ROLES[self.role]}
        if isinstance(self.name, str):
            out["name"] = self.name
        out["content"] = self.content
        if self.role == "assistant" and self.tool_calls:
            out["tool_calls"] = [{"id": str(c.id or f"call_{j}"), "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for j, c in enumerate(self.tool_calls)]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionTool(Body):
    name: str


class ChatTool(Body):
    model_config = ConfigDict(json_schema_extra={"bad": "expected {'type': 'function', 'function': {'name': ...}}"})
    type: Literal["function"] = "function"
    function: FunctionTool


class StreamOptions(Body):
    include_usage: bool = False


class ChatBody(Sampling):
    """A `/v1/chat/completions` body."""

    messages: list[ChatMessage] = Field(min_length=1, json_schema_extra={
        "bad": "required, a non-empty list of chat messages"})
    n: Any = None
    max_completion_tokens: Count | None = None
    max_tokens: Count | None = None
    tools: list[ChatTool] | None = Field(None, json_schema_extra={
        "bad": "expected a list of {'type': 'function', 'function': {...}}"})
    stream_options: StreamOptions | None = Field(None, json_schema_extra={"bad": "expected an object"})
    response_format: Format | None = Field(None, json_schema_extra={
        "bad": "expected an object like {'type': 'text'}"})

    @field_validator("n")
    @classmethod
    def _one(cls, n: Any) -> Any:
        if n not in (None, 1):
            raise refused(f"only n=1 is supported, got {n!r} (choices the agent does not continue would be "
                          "trained on a reward they did not earn; send n separate requests)")
        return n

    def request(self, raw_tools: list[dict] | None) -> ChatRequest:
        return ChatRequest(messages=[m.normalised() for m in self.messages], tools=raw_tools or None,
                           model=self.model, sampling=self.sampling(self.max_completion_tokens or self.max_tokens),
                           stop=self.stop, stream=self.stream,
                           include_usage=bool(self.stream_options and self.stream_options.include_usage),
                           tool_choice=self.tool_choice, logprobs=bool(self.logprobs),
                           warning=self.response_format.warning("response_format") if self.response_format else None)


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _walk(model: type[BaseModel], loc: tuple) -> tuple[tuple, list[tuple[tuple, dict, bool]]]:
    """`loc` without pydantic's union tags, and the json_schema_extra met on the way: (where, extra,
    whether it is a field's: it then speaks for errors at that field only; a model's speaks for
    errors anywhere inside an item of it)."""
    clean, extras, here = (), [], [model]
    for part in loc:
        if isinstance(part, int):
            clean += (part,)
            continue
        owner = next((m for m in here if part in m.model_fields), None)
        if owner is None:  # a union member's tag ('float', 'function-before[...]', an item type): narrow to it
            tagged = [m for m in here if _tag(m) == part]
            here = tagged or here
            continue
        field = owner.model_fields[part]
        clean += (part,)
        if isinstance(field.json_schema_extra, dict):
            extras.append((clean, field.json_schema_extra, True))
        here = _models_in(field.annotation)
        for m in here[:1]:
            if isinstance(m.model_config.get("json_schema_extra"), dict):
                item = clean + (loc[len(clean)],) if _is_list(field.annotation) and len(loc) > len(clean) \
                    and isinstance(loc[len(clean)], int) else clean
                extras.append((item, m.model_config["json_schema_extra"], False))
    return clean, extras


def _tag(model: type[BaseModel]) -> str | None:
    """The `type` a model's items carry (its Literal's only value), if it has one."""
    field = model.model_fields.get("type")
    args = getattr(field.annotation, "__args__", ()) if field else ()
    return args[0] if len(args) == 1 and isinstance(args[0], str) else None


def _is_list(annotation: Any) -> bool:
    return getattr(annotation, "__origin__", None) is list or any(_is_list(a) for a in getattr(annotation, "__args__", ()))


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The model classes in an annotation like `list[X | Y] | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models_in(arg)]


GENERIC = {"float_type": "expected a number", "float_parsing": "expected a number", "int_type": "expected an integer",
           "int_from_float": "expected an integer", "bool_type": "expected a boolean", "string_type": "expected a string",
           "dict_type": "expected an object", "model_type": "expected an object", "list_type": "expected a list",
           "missing": "required", "too_short": "must not be empty"}


def bad_request(e: ValidationError, model: type[BaseModel]) -> BadRequest:
    """The gateway's 400 for the first error of `e` (a body validated by `model`)."""
    err = e.errors(include_url=False)[0]
    ctx = err.get("ctx") or {}
    loc, extras = _walk(model, err["loc"])
    where = _path(loc)
    param = str(loc[0]) if loc else None
    for at, extra, _ in extras:
        if extra.get("param") == "here":
            param = _path(at)
    if err["type"] == "refused":
        sub = ctx.get("field")
        if sub:
            where += sub if sub.startswith("[") else f".{sub}"
            if ctx.get("param") == "here":
                param = where
        return BadRequest(f"{where}: {err['msg']}", param)
    if err["type"] == "unsupported_tool_choice":
        return BadRequest(f"{where}: {err['msg']}", param, "unsupported_tool_choice")
    bad = [(at, extra["bad"]) for at, extra, own in extras if "bad" in extra and (at == loc or not own)]
    if bad:
        return BadRequest(f"{_path(bad[-1][0])}: {bad[-1][1]}", param)
    what = f"expected one of {ctx.get('expected')}" if err["type"] == "literal_error" else GENERIC.get(err["type"],
                                                                                                       err["msg"])
    shown = "" if err["type"] in ("missing", "too_short") else f", got {err['input']!r}"
    return BadRequest(f"{where}: {what}{shown}", param)


def parse(model: type[M], body: Any) -> M:
    """`body` validated by `model`; BadRequest (with the parameter and the reason) otherwise."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise bad_request(e, model) from None


def parse_chat(body: Any) -> ChatRequest:
    """A validated chat request; BadRequest (with the parameter and the reason) otherwise."""
    return parse(ChatBody, body).request(body.get("tools"))


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
