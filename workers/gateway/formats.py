"""How the gateway answers: errors in OpenAI's terms, what fits a model, and the two response formats.

What it is: `classify` maps Jet's errors onto (HTTP status, OpenAI error
type, code); `ModelInfo` knows a model's context and longest token, so a
request whose text cannot fit is refused before it is rendered; `ChatFormat`
and `ResponsesFormat` turn one finished `ChatCompletion` into a
chat-completions or a Responses API answer (body, opening events, the rest,
an in-stream error), so the routes share one generation path.
What it is not: the routes or the recording (`jet.workers.gateway.app`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jet.errors import GenerationError, GenerationTimeout, QueueError
from jet.llm import ChatCompletion, PromptTooLong
from jet.queues import codec
from jet.workers.gateway import chat as chat_api
from jet.workers.gateway import responses as responses_api
from jet.workers.gateway.auth import InvalidKey
from jet.workers.gateway.chat import BadRequest, ChatRequest
from jet.workers.gateway.http import TooLarge

ENTRY_TOKENS = (codec.DEFAULT_MAX_BYTES - 64 * 1024) // 4  # prompt ids that fit in one generation request


def classify(e: Exception) -> tuple[int, str, str, str | None, str | None]:
    """(status, message, type, param, code) of an error, in OpenAI's terms."""
    if isinstance(e, InvalidKey):
        return 401, str(e), "authentication_error", None, e.code
    if isinstance(e, TooLarge):
        return 413, str(e), "invalid_request_error", None, "request_too_large"
    if isinstance(e, BadRequest):
        return 400, str(e), "invalid_request_error", e.param, e.code
    if isinstance(e, PromptTooLong):
        return 400, str(e), "invalid_request_error", "messages", "context_length_exceeded"
    if isinstance(e, GenerationTimeout):
        return 504, str(e), "timeout_error", None, None
    if isinstance(e, GenerationError):
        return 400, f"the inference worker refused the request: {e}", "invalid_request_error", None, None
    if isinstance(e, QueueError):
        return 503, f"the run's Redis is unavailable: {e}", "server_error", None, None
    raise e


class ModelInfo:
    """What a model's prompts may hold, checked in two steps before the prompt is rendered, so the
    memory and time spent on a request grow with the model's context, not with the body's size:
    1. characters: a text of C characters has at least C / (longest token) tokens;
    2. tokens, counted piece by piece (PIECE characters at a time, cut at whitespace) and stopped as
       soon as they are over the limit (with SLACK for the pieces' cut points).
    The exact check on the rendered prompt is `Session.chat_completion(max_prompt_tokens=...)`."""

    PIECE = 16_384  # characters tokenised at once
    SLACK = 1.1  # the piecewise count may run over the whole text's by this factor

    def __init__(self, path: str, tokenizer: Any):
        self.tokenizer = tokenizer
        self.context = _context(path, tokenizer)
        self.longest = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
        self.max_prompt = min(self.context - 1, ENTRY_TOKENS) if self.context else ENTRY_TOKENS

    def check(self, request: ChatRequest) -> None:
        """400 (context_length_exceeded) when the request's text cannot fit (blocking: call from a thread)."""
        chars = request.text_chars()
        if chars > self.max_prompt * self.longest:
            raise self._over(f"{chars} characters of text: at least {chars // self.longest} tokens")
        limit = int(self.max_prompt * self.SLACK) + 64
        counted = 0
        for piece in _pieces(request.texts(), self.PIECE):
            counted += len(self.tokenizer.encode(piece, add_special_tokens=False))
            if counted > limit:
                raise self._over(f"over {limit} tokens of text")

    def _over(self, what: str) -> BadRequest:
        return BadRequest(f"the request holds {what}, more than the {self.max_prompt} tokens a prompt of this "
                          "model may have", "messages", "context_length_exceeded")


def _pieces(texts, size: int):
    """The texts cut into pieces of at most about `size` characters, at whitespace where there is some."""
    for text in texts:
        at = 0
        while at < len(text):
            end = at + size
            if end < len(text):
                cut = text.rfind(" ", at + size // 2, end)
                end = cut if cut > at else end
            yield text[at:end]
            at = end


def _context(path: str, tokenizer: Any) -> int | None:
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    n = getattr(tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and 0 < n < 10**8 else None


def stop_ids(tokenizer: Any, stops: tuple[str, ...]) -> tuple[int, ...]:
    ids = []
    for s in stops:
        encoded = tokenizer.encode(s, add_special_tokens=False)
        if len(encoded) != 1:
            raise BadRequest(f"stop: {s!r} is {len(encoded)} tokens of this model; the gateway supports stop "
                             "strings of exactly one token", "stop")
        ids.append(encoded[0])
    return tuple(ids)


class ChatFormat:
    """The chat-completions format of an answer."""

    def conversation(self, rid: str, req: ChatRequest, done: ChatCompletion) -> None:
        return None

    def body(self, rid, created, model, done: ChatCompletion, tokenizer, req: ChatRequest) -> dict:
        c = done.call
        return chat_api.completion(f"chatcmpl-{rid}", created, model, done.message, done.result.finish_reason,
                                   len(c.prompt_ids), len(c.completion_ids), done.result.version,
                                   logprobs(tokenizer, done) if req.logprobs else None)

    def opening(self, rid, created, model) -> list[bytes]:
        return [chat_api.chunk(chat_api.stream_head(f"chatcmpl-{rid}", created, model),
                               {"role": "assistant", "content": ""})]

    def rest(self, body: dict, req: ChatRequest) -> list[bytes]:
        return list(chat_api.stream_events(body, req.include_usage))

    def error(self, e: Exception) -> list[bytes]:
        _, message, kind, _, code = classify(e)
        return [chat_api.stream_error(message, kind, code)]


class ResponsesFormat:
    """The Responses API format of an answer."""

    def __init__(self, request_body: dict):
        self.request, self.events = request_body, responses_api.Events()

    def conversation(self, rid: str, req: ChatRequest, done: ChatCompletion) -> tuple[str, list[dict]]:
        return f"resp_{rid}", [*responses_api.conversation(req), chat_api.assistant_message(done.message)]

    def body(self, rid, created, model, done: ChatCompletion, tokenizer, req: ChatRequest) -> dict:
        c = done.call
        items = responses_api.output_items(rid, done.message, logprobs(tokenizer, done) if req.logprobs else None)
        return responses_api.response_body(f"resp_{rid}", created, model, self.request,
                                           responses_api.status_of(done.message, done.result.finish_reason),
                                           items, (len(c.prompt_ids), len(c.completion_ids)))

    def opening(self, rid, created, model) -> list[bytes]:
        started = responses_api.response_body(f"resp_{rid}", created, model, self.request, "in_progress")
        return list(self.events.opening(started))

    def rest(self, body: dict, req: ChatRequest) -> list[bytes]:
        return list(self.events.rest(body))

    def error(self, e: Exception) -> list[bytes]:
        _, message, _, _, code = classify(e)
        return [self.events.error(message, code)]


def logprobs(tokenizer: Any, done: ChatCompletion) -> list[dict]:
    c = done.call
    n = len(c.completion_ids) - (c.finish_reason == "stop" and bool(c.completion_ids))  # as the content: no stop
    tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in c.completion_ids[:n]]
    return chat_api.token_logprobs(tokens, [float(x) for x in c.completion_logprobs[:n]])
