"""The LLM client agent code calls: `await llm.chat(messages, tools=..., **sampling)`.

What it is:
- `LLMClient`, one per process (`open_client`): sends GenRequests to
  `gen:<model>` and reads ONE reply stream, `reply:<client id>`, with ONE
  reader task that hands each GenResult to the call waiting for its request id.
- `Session`, one per episode (`client.session(...)`): what a workflow gets as
  `llm`. `chat` builds the prompt token-in-token-out (`jet.chat`), generates,
  records a `jet.timeline.Call` (prompt ids, completion ids, logprobs, version,
  model, agent, and the request's temperature and top_p) in `session.calls`, and returns the assistant message.
  `chat_completion` returns the same plus the raw result (what an HTTP gateway
  needs); `generate` is the raw token-ids path, recorded the same way.
  An env worker also gives each session the base URL and API key of its
  OpenAI-compatible gateway (`openai_base_url`, `openai_api_key`,
  `openai_client()`; see `jet.workers.gateway.app`), so agents written against an
  OpenAI SDK are recorded into the same episode.

Delivery choices:
- The reply stream is read with plain XREAD (no group), from where the client
  started. A reply only matters to the process waiting for it, and a crashed
  process loses its episodes anyway (they are re-run elsewhere), so a group
  would recover nothing. Read entries are deleted (XDEL), and the stream has a
  TTL renewed while the client lives, so a dead client's stream expires (and
  inference workers skip requests whose reply stream is gone).
- One request, one copy: a call sends its GenRequest once, with a deadline
  (now + its timeout, `models[].request_timeout_s`, or the session's
  `deadline`, an episode's end, when sooner), and waits for the reply
  until then, however long the request queues or decodes. The delivery rules
  of jet.queues make a re-send useless there and harmful under load: an entry
  no worker read yet stays in `gen:<model>` (never trimmed), one a worker holds
  is renewed while it decodes, and one whose worker died is reclaimed by a
  reaper after its lease and served elsewhere; a copy sent meanwhile would be
  decoded a second time by a worker that reads it while the first is still
  queued or decoding. So the only re-send is for a request that can no longer
  be answered: the reply stream is gone (the server lost its data, or the
  stream expired) and the reader made it again; then every waiting call sends
  its request again, same id and deadline (the reader checks on each idle pass:
  one EXPIRE per block_ms when no reply comes, nothing per request). A request
  dead-lettered after `max_deliveries` (it crashed the workers) gets no reply:
  sending it again would only crash them again. A worker that reads a request after
  its deadline drops it undecoded; one that reads a copy of a request it is
  decoding joins the first (jet.workers.inference.worker), and the idempotency marker
  acks any later copy without a reply. A second reply for a resolved request
  is ignored. No reply by the deadline raises GenerationTimeout.

What it is not: a tokenizer cache for the gateway's HTTP layer, or a sampler.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

import anyio
import msgspec

from jet.chat import Conversations, Message, Template
from jet.errors import CodecError, ConnectError, GenerationError, GenerationTimeout, JetError
from jet.keys import Keys
from jet.queues import codec
from jet.queues.connect import connect, retry_forever, translated
from jet.queues.producer import Producer
from jet.sampling import NAMES as DISTRIBUTION
from jet.sampling import settings_of
from jet.timeline import Call
from jet.wire import GenRequest, GenResult

log = logging.getLogger(__name__)

SAMPLING = (*DISTRIBUTION, "max_tokens", "stop_token_ids", "seed")  # the keywords a call takes


class PromptTooLong(JetError):
    """A prompt over the caller's token limit, refused before any generation request is built."""

    def __init__(self, tokens: int, limit: int):
        super().__init__(f"the prompt is {tokens} tokens; at most {limit} fit (the model's context)")
        self.tokens, self.limit = tokens, limit
REPLY_TTL_S = 600  # a dead client's reply stream expires after this (s)


def client_id() -> str:
    """A fresh id for this process's reply stream: host-pid-random, key-safe."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Tokenizers:
    """Model name -> tokenizer, loaded from the model's directory on first use.

    The tokenizer is `jet.tokenizer`'s lean one (the `tokenizers` library and a sandboxed Jinja2
    chat template: no torch or transformers in the process) whenever the folder has a
    `tokenizer.json`. Loading holds a lock: a lazy first import from several worker threads at
    once is not thread-safe (transformers' raised ImportError)."""

    def __init__(self, paths: Mapping[str, str]):
        self.paths = dict(paths)
        self._loaded: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __contains__(self, model: str) -> bool:
        return model in self.paths

    def get(self, model: str) -> Any:
        """The tokenizer of `model` (blocking on first use: call from a thread)."""
        if model in self._loaded:
            return self._loaded[model]
        if model not in self.paths:
            known = ", ".join(sorted(self.paths)) or "none"
            raise ValueError(f"unknown model {model!r}; configured: {known}")
        with self._lock:
            if model not in self._loaded:
                from jet.sources import resolve_model
                from jet.tokenizer import load_tokenizer

                path = resolve_model(self.paths[model], f"models[{model}].path")
                self._loaded[model] = load_tokenizer(path)
        return self._loaded[model]


@dataclass(slots=True)
class _Waiter:
    event: anyio.Event = field(default_factory=anyio.Event)  # set by a reply, or by a lost reply stream
    result: GenResult | None = None


class LLMClient:
    """Sends generation requests and routes their replies; one per process.

    `timeout_s`: a call's longest wait (s) for models not in `timeouts` (model name -> s)."""

    def __init__(self, url: str, keys: Keys, tokenizers: Tokenizers, *, timeout_s: float = 300.0,
                 timeouts: Mapping[str, float] | None = None, block_ms: int = 1000, gen_maxlen: int = 10_000,
                 cid: str | None = None, max_connections: int | None = None):
        self.url, self.keys, self.tokenizers = url, keys, tokenizers
        self.max_connections = max_connections  # Redis pool size (None: redis-py's default of 100)
        self.timeout_s, self.timeouts = timeout_s, dict(timeouts or {})
        self.block_ms, self.gen_maxlen = block_ms, gen_maxlen
        self.id = cid or client_id()
        self.reply_to = keys.reply(self.id)
        self.sessions: dict[str, Session] = {}  # episode id -> live session (a gateway looks them up here)
        self._waiting: dict[str, _Waiter] = {}
        self._producers: dict[str, Producer] = {}
        self.r = self.rb = None
        self._http: Any = None  # shared httpx client of OpenAI-SDK episodes, made on first use

    # -- lifecycle (use `open_client`) -----------------------------------------

    async def _open(self, stop: anyio.Event | None = None) -> None:
        """Connect (waiting for the server with backoff; `stop` ends the wait with `Stopped`)."""
        self.r = await retry_forever(lambda: connect(self.url, name=f"jet-llm-{self.id}",
                                                     max_connections=self.max_connections),
                                     url=self.url, what="llm client: connect", stop=stop)
        self.rb = await connect(self.url, block_ms=self.block_ms, name=f"jet-llm-read-{self.id}")
        self._last = "0-0"
        await self._ensure_stream()

    async def _ensure_stream(self) -> bool:
        """(Re)create the reply stream with its TTL: workers skip requests whose reply stream is gone.
        True if it had to be made (again)."""
        with translated(self.url):
            if await self.r.expire(self.reply_to, REPLY_TTL_S):
                return False
            entry = await self.r.xadd(self.reply_to, codec.encode("hello", {"client": self.id}))
            await self.r.xdel(self.reply_to, entry)
            await self.r.expire(self.reply_to, REPLY_TTL_S)
        self._last = max(self._last, entry.decode(), key=_entry_order)
        return True

    def http(self) -> Any:
        """The process's shared `httpx.AsyncClient` for OpenAI-SDK clients (`Session.openai_client`)."""
        if self._http is None:
            import openai

            class Shared(openai.DefaultAsyncHttpxClient):
                """The SDK's default transport, which an episode's `async with` does not close."""

                async def aclose(self) -> None:
                    pass

                async def really_close(self) -> None:
                    await super().aclose()

            self._http = Shared()
        return self._http

    async def _close(self) -> None:
        if self._http is not None:
            with contextlib.suppress(Exception):
                await self._http.really_close()
        with contextlib.suppress(Exception):
            await self.r.delete(self.reply_to)
        for c in (self.r, self.rb):
            with contextlib.suppress(Exception):
                await c.aclose()

    async def _read_replies(self) -> None:
        """The one reader: dispatch replies by request id, keep the stream's TTL fresh. An idle pass
        (no reply within block_ms) checks that the stream still exists: one that is gone lost the
        replies written to it (and the server perhaps the requests), so the waiting calls send again."""
        renewed = time.monotonic()
        while True:
            try:
                with translated(self.url):
                    reply = await self.rb.xread({self.reply_to: self._last}, count=256, block=self.block_ms)
                    entries = [e for _, es in (reply or []) for e in es]
                    if entries:
                        self._last = entries[-1][0]
                        await self.r.xdel(self.reply_to, *[i for i, _ in entries])
                if not entries or time.monotonic() - renewed > REPLY_TTL_S / 10:
                    if await self._ensure_stream() and self._waiting:
                        log.warning("reply stream %s was gone (server restarted without its data?): "
                                    "sending the %d requests waiting for it again",
                                    self.keys.short(self.reply_to), len(self._waiting))
                        for waiter in self._waiting.values():
                            waiter.event.set()  # no result: the call sends its request again
                    renewed = time.monotonic()
            except ConnectError as e:
                log.warning("reply reader: %s; retrying", e)
                await anyio.sleep(0.5)
                continue
            for _, fields in entries:
                self._dispatch(fields)

    def _dispatch(self, fields: dict) -> None:
        try:
            result = GenResult.from_payload(codec.decode(fields))
        except CodecError as e:
            log.warning("ignoring a malformed reply on %s: %s", self.keys.short(self.reply_to), e)
            return
        waiter = self._waiting.get(result.request_id)
        if waiter is None or waiter.result is not None:
            return  # a duplicate, or a call that gave up
        waiter.result = result
        waiter.event.set()

    # -- requests -------------------------------------------------------------

    async def generate(self, request: GenRequest, timeout_s: float | None = None) -> GenResult:
        """Send `request` (its reply_to and deadline are set here) and wait for its result, at most
        `timeout_s` (default: the model's timeout) or until `request.deadline` when that is sooner.
        Sent again only if the reply stream was lost.

        Raises GenerationError when the worker answered with an error,
        GenerationTimeout when no reply came in time.
        """
        timeout = timeout_s or self.timeouts.get(request.model, self.timeout_s)
        now = time.time()
        if request.deadline:  # the caller's own end (an episode's timeout) comes first when sooner
            timeout = max(0.0, min(timeout, request.deadline - now))
        sent = msgspec.structs.replace(request, reply_to=self.reply_to, deadline=now + timeout).to_fields()
        waiter = self._waiting.setdefault(request.msg_id, _Waiter())
        try:
            with anyio.move_on_after(timeout):
                await self._producer(request.model).send([sent])
                while True:
                    await waiter.event.wait()
                    if waiter.result is not None:
                        break
                    waiter.event = anyio.Event()  # the reply stream was lost: send the same request again
                    await self._producer(request.model).send([sent])
        finally:
            self._waiting.pop(request.msg_id, None)
        result = waiter.result
        if result is None:
            raise GenerationTimeout(f"no reply to {request.msg_id} from gen:{request.model} in {timeout:.0f}s "
                                    f"(is an inference worker running? models[].request_timeout_s is the "
                                    f"longest wait, queueing included)")
        if result.finish_reason == "error":
            raise GenerationError(f"{request.model}: {result.error}")
        return result

    def _producer(self, model: str) -> Producer:
        if model not in self._producers:
            self._producers[model] = Producer(self.r, self.url, self.keys, self.keys.gen(model),
                                              maxlen=self.gen_maxlen)
        return self._producers[model]

    def session(self, episode_id: str, model: str, agent: str = "main") -> "Session":
        """A new episode's session; it stays in `sessions` until `close_session`."""
        s = Session(self, episode_id, model, agent)
        self.sessions[episode_id] = s
        return s

    def close_session(self, episode_id: str) -> None:
        self.sessions.pop(episode_id, None)


def _entry_order(entry_id: str | bytes) -> tuple[int, int]:
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms), int(seq or 0)


@contextlib.asynccontextmanager
async def open_client(url: str, keys: Keys, tokenizers: Tokenizers, *, stop: anyio.Event | None = None,
                      **kwargs) -> AsyncIterator[LLMClient]:
    """An LLMClient with its reply reader running; closed (reply stream deleted) on exit."""
    client = LLMClient(url, keys, tokenizers, **kwargs)
    await client._open(stop)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(client._read_replies)
            try:
                yield client
            finally:
                tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await client._close()


@dataclass(frozen=True, slots=True)
class ChatCompletion:
    message: Message  # the assistant message
    call: Call  # what was recorded
    result: GenResult


class Session:
    """One episode's LLM access: what a workflow receives as `llm`.

    `calls` lists every recorded call in order; `info` is a free dict the
    workflow may fill (JSON-serialisable) and the Trajectory carries.
    """

    def __init__(self, client: LLMClient, episode_id: str, model: str, agent: str = "main"):
        self.client, self.episode_id, self.model, self.agent = client, episode_id, model, agent
        self.calls: list[Call] = []
        self.undelivered: list[Call] = []  # answered, but the client never received them: never trained
        self.info: dict[str, Any] = {}
        self.tag = uuid.uuid4().hex[:16]  # this run of the episode (a redelivered task's re-run gets another)
        # Set by the env worker's gateway (jet.workers.gateway.app) so OpenAI-SDK agents reach this episode:
        self.openai_base_url: str | None = None  # e.g. http://127.0.0.1:PORT/v1
        self.openai_api_key: str | None = None  # the key of (self.model, self.agent)
        self.mint_key: Callable[[str, str], str] | None = None  # (model, agent) -> a key of this episode
        self.deadline = 0.0  # unix time the episode ends (set by the env worker; 0 = none): calls wait no longer
        self._conversations: dict[tuple[str, str], Conversations] = {}

    async def chat(self, messages: Sequence[Message], *, model: str | None = None,
                   tools: Sequence[dict] | None = None, agent: str | None = None,
                   timeout_s: float | None = None, **sampling: Any) -> Message:
        """Generate the next assistant message for `messages` and record the call."""
        done = await self.chat_completion(messages, model=model, tools=tools, agent=agent,
                                          timeout_s=timeout_s, **sampling)
        return done.message

    async def chat_completion(self, messages: Sequence[Message], *, model: str | None = None,
                              tools: Sequence[dict] | None = None, agent: str | None = None,
                              timeout_s: float | None = None, max_prompt_tokens: int | None = None,
                              tool_calls: bool = True, **sampling: Any) -> ChatCompletion:
        """As `chat`, plus the Call and the raw result. A prompt over `max_prompt_tokens` raises
        PromptTooLong before any request is built; `tool_calls=False` leaves tool-call markup in
        the reply's content (OpenAI's tool_choice "none")."""
        model, agent = model or self.model, agent if agent is not None else self.agent
        messages = [dict(m) for m in messages]
        conv = await anyio.to_thread.run_sync(self.conversation, model, agent)
        prompt = await anyio.to_thread.run_sync(conv.prompt, messages, tools)
        if max_prompt_tokens is not None and len(prompt.ids) > max_prompt_tokens:
            raise PromptTooLong(len(prompt.ids), max_prompt_tokens)
        result, call = await self._generate(prompt.ids, model, agent, timeout_s, sampling)
        reply = await anyio.to_thread.run_sync(conv.reply, result.token_ids, result.finish_reason, tool_calls)
        conv.record(messages, tools, prompt.ids, result.token_ids, result.finish_reason, reply)
        return ChatCompletion(reply, call, result)

    async def generate(self, prompt_ids: Sequence[int], *, model: str | None = None, agent: str | None = None,
                       timeout_s: float | None = None, **sampling: Any) -> GenResult:
        """Raw token ids in, GenResult out; recorded as a Call like `chat`."""
        model, agent = model or self.model, agent if agent is not None else self.agent
        result, _ = await self._generate(list(prompt_ids), model, agent, timeout_s, sampling)
        return result

    def record(self, call: Call) -> None:
        """Add a call made elsewhere (another process's client, say) to this episode's calls."""
        self.calls.append(call)

    def withdraw(self, call: Call) -> None:
        """Move a recorded call whose answer never reached the client (it disconnected) from `calls`
        to `undelivered`: the agent never saw it, so the episode's reward says nothing about it."""
        for i in range(len(self.calls) - 1, -1, -1):
            if self.calls[i] is call:
                del self.calls[i]
                break
        self.undelivered.append(call)

    def openai_credentials(self, *, model: str | None = None, agent: str | None = None) -> tuple[str, str]:
        """(base URL, API key) of the gateway for this episode's calls as `agent` on `model`."""
        if self.openai_base_url is None or self.openai_api_key is None or self.mint_key is None:
            raise JetError("this session has no gateway: only sessions of an env worker's episodes get one")
        model, agent = model or self.model, agent if agent is not None else self.agent
        if (model, agent) == (self.model, self.agent):
            return self.openai_base_url, self.openai_api_key
        return self.openai_base_url, self.mint_key(model, agent)

    def openai_client(self, *, model: str | None = None, agent: str | None = None, sync: bool = False,
                      **kwargs: Any) -> Any:
        """An `openai.AsyncOpenAI` (`OpenAI` with sync=True) whose calls are recorded in this episode.

        The async client sends through the process's one shared HTTP transport (`LLMClient.http`)
        unless `http_client` is given: a client of its own builds a TLS context with the CA bundle
        loaded (~0.9 MB each), which with one client an episode is most of an env worker's memory.
        Closing the returned client (`async with`) leaves the shared transport open."""
        import openai

        base_url, api_key = self.openai_credentials(model=model, agent=agent)
        if sync:
            return openai.OpenAI(base_url=base_url, api_key=api_key, **kwargs)
        kwargs.setdefault("http_client", self.client.http())
        return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, **kwargs)

    def conversation(self, model: str, agent: str) -> Conversations:
        """The kept turns of `agent` on `model` (blocking on first use: loads the tokenizer)."""
        key = (model, agent)
        if key not in self._conversations:
            self._conversations[key] = Conversations(Template(self.client.tokenizers.get(model)))
        return self._conversations[key]

    async def _generate(self, prompt_ids: list[int], model: str, agent: str, timeout_s: float | None,
                        sampling: dict) -> tuple[GenResult, Call]:
        unknown = set(sampling) - set(SAMPLING)
        if unknown:
            raise TypeError(f"unknown sampling parameter(s) {sorted(unknown)}; supported: {', '.join(SAMPLING)}")
        if model not in self.client.tokenizers:
            self.client.tokenizers.get(model)  # raises, naming the configured models
        request = GenRequest(reply_to="", model=model, prompt_ids=prompt_ids, episode_id=self.episode_id,
                             agent=agent, deadline=self.deadline, **sampling)
        result = await self.client.generate(request, timeout_s)
        call = Call(prompt_ids, result.token_ids, result.logprobs, result.version, model, agent,
                    result.finish_reason, **settings_of(request))
        self.record(call)
        return result, call
