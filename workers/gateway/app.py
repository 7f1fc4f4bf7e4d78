"""The gateway: an OpenAI-compatible HTTP API over `gen:<model>`.

Served: `POST /v1/chat/completions`, `POST /v1/responses` (the Responses API,
`jet.workers.gateway.responses`), `GET /v1/models`, `GET /v1/models/{id}`;
any other path gets 404 naming these (logged as a warning naming the
episode's task).

What it is: a Starlette app on uvicorn that turns OpenAI requests into
`jet.llm` calls, so an agent written with the `openai` SDK, the OpenAI Agents
SDK (on either API), LangChain or plain HTTP is trained unchanged. Each episode gets a base URL and an API key (a
signed, expiring token naming the episode run, model and agent:
`jet.workers.gateway.auth`); a call made with it is built token-in-token-out
by the same `Session.chat_completion` as `llm.chat` (the same kept token ids,
so the merge sees one timeline) and recorded in that episode. Unknown,
tampered or expired keys get 401; malformed bodies 400 with a reason, in
OpenAI's error shape (`jet.workers.gateway.chat`).

Status codes: 200; 400 bad body or parameter, a prompt over the model's
context (`context_length_exceeded`: checked on the text's size before it is
rendered, then on its tokens before any generation request is built), or the
inference worker refused it; 401 bad, expired or finished-episode key; 404
unknown path or model; 405 wrong method; 413 body over the limit; 429 too
many requests or body bytes in flight (Retry-After); 503 the run's Redis is
unreachable; 504 no inference worker answered in time. Limits:
`jet.workers.gateway.http.Limits`.

Streaming: the opening event goes out at once, the rest once the completion
exists (generation is not incremental); an error after the opening is sent
in the stream, in OpenAI's shape. A call whose client disconnected before its
whole answer went out (streamed or not) is withdrawn from the episode and
never trained (`jet.workers.gateway.sessions`).

Two deployments of one app:
- Embedded (the default): every env worker serves the app on 127.0.0.1 at a
  free port, in its own event loop, over its own LLM client. A key's episode
  is looked up in `client.sessions` and the call is recorded directly in the
  live Session, exactly like a `jet.llm` call. Its keys are signed with a
  secret of that process, so they are valid there only.
- Standalone: `jet gateway [--host 127.0.0.1] [--port 8000]`, for agents that
  cannot reach the env worker's loopback (another process, container or
  host); env workers started with `--gateway-url` (or $JET_GATEWAY_URL) hand
  out its URL. It keeps its own Sessions per episode run (conversation state in
  memory, rebuilt from Redis on a miss, so a restarted or second gateway still
  extends the kept ids) and appends each answered call to the episode run's
  stream `calls:<episode>.<tag>`. The env worker creates that stream when the
  episode starts and, once the workflow returned, reads and deletes it in one
  MULTI, BEFORE the merge and the atomic commit: the published trajectory
  holds every call the gateway acknowledged; a call of an episode that is over
  is refused with 401 and never written; a Redis error while collecting gives
  the task back (QueueError). See `jet.workers.gateway.sessions`.
Keys of a standalone gateway are signed with the run's secret
($JET_GATEWAY_SECRET, else one kept in Redis: `jet.workers.gateway.auth`).

Whichever model a request names: a configured model is used as named; any
other name (agents hard-code "gpt-4o") means the key's model. The agent name
is the key's; keys for other agents or models of the same episode come from
`llm.openai_credentials(agent=..., model=...)`.

What it is not: a public endpoint. It binds to loopback unless told otherwise,
and keys protect episodes from each other, not the run from its own agents.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import time
import uuid
from typing import Any, AsyncIterator, Callable

import anyio
import click

from jet.options import config_options, load_config, redis_url_option, require_models, resolve_url
from jet.config import JetConfig
from jet.errors import GenerationError, GenerationTimeout, JetError, QueueError
from jet.keys import Keys
from jet.llm import ChatCompletion, LLMClient, PromptTooLong, Session, Tokenizers, open_client
from jet.queues.connect import connect, retry_forever
from jet.workers.gateway import chat as chat_api
from jet.workers.gateway import responses as responses_api
from jet.workers.gateway.auth import Claims, InvalidKey, Signer, load_secret
from jet.workers.gateway.chat import BadRequest, ChatRequest, error_body
from jet.workers.gateway.formats import ChatFormat, ModelInfo, ResponsesFormat, classify, stop_ids
from jet.workers.gateway.http import GRACE_S, EventStream, Limiter, Limits, read_json, serving, watching
from jet.workers.gateway.sessions import Episodes, LocalSessions, RecordingSessions, Sessions, remember, responses_of

log = logging.getLogger(__name__)

__all__ = ["GRACE_S", "KEY_GRACE_S", "episode_gateway", "make_app", "run", "serving"]

KEY_GRACE_S = 60.0  # an episode's key outlives its timeout by this much (s)
ENDPOINTS = ("POST /v1/chat/completions", "POST /v1/responses", "GET /v1/models", "GET /v1/models/{model}")
GENERATING = ("/v1/chat/completions", "/v1/responses")
_LIMITS = Limits()  # the defaults
CALLS_PER_EPISODE = 4  # embedded: gateway requests in flight per episode, at most (parallel agents and tools)


# ---- the app


def _error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def _handle(request, e: Exception):
    from starlette.exceptions import HTTPException

    if isinstance(e, HTTPException):
        return _error(e.status_code, str(e.detail), "invalid_request_error")
    return _error(*classify(e))





class _App:
    def __init__(self, sessions: LocalSessions | RecordingSessions, signer: Signer, models: list[str],
                 limits: Limits):
        self.sessions, self.signer, self.models, self.limits = sessions, signer, models, limits
        self._info: dict[str, ModelInfo] = {}
        self._warned: set[tuple[str, str]] = set()

    def claims(self, request) -> Claims:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise InvalidKey("missing API key: send 'Authorization: Bearer <key>'")
        return self.signer.verify(key.strip())

    async def chat(self, request):
        claims = self.claims(request)
        req = chat_api.parse_chat(await read_json(request, self.limits.max_body))
        return await self.answer(request, claims, await self.sessions.get(claims), req, ChatFormat())

    async def responses(self, request):
        claims = self.claims(request)
        body = await read_json(request, self.limits.max_body)
        parsed = responses_api.parse_responses(body)
        previous = parsed.previous_response_id
        session = await self.sessions.get(claims)
        earlier = responses_of(session).get(previous) if previous else None
        if previous and earlier is None:
            raise BadRequest(f"previous_response_id: no response {previous!r} in this episode",
                             "previous_response_id", "previous_response_not_found")
        return await self.answer(request, claims, session, parsed.request(earlier), ResponsesFormat(body))

    async def answer(self, request, claims: Claims, session: Session, req: ChatRequest, api):
        """Generate `req` in `session` and answer it in `api`'s format, watching for a client that left."""
        from starlette.responses import JSONResponse

        model = req.model if req.model in self.models else claims.model
        if model not in self.models:
            raise BadRequest(f"model {model!r} is not served here; served: {', '.join(self.models)}", "model")
        tokenizer = await anyio.to_thread.run_sync(session.client.tokenizers.get, model)
        info = await self.info(session, model, tokenizer)
        await anyio.to_thread.run_sync(info.check, req)
        stop = stop_ids(tokenizer, req.stop)
        headers = self.warn(claims, req)
        rid, created = uuid.uuid4().hex[:24], int(time.time())
        generate = functools.partial(self.generate, claims, session, req, model, stop, info, api, rid)
        if req.stream:
            return self.streamed(api, rid, created, model, generate, claims, req, tokenizer, headers)
        async with watching(request.receive) as gone:
            done, recorded = await generate()
        if gone.is_set():
            await self.withdrawn(claims, done, recorded)
        return JSONResponse(api.body(rid, created, model, done, tokenizer, req), headers=headers)

    async def generate(self, claims: Claims, session: Session, req: ChatRequest, model: str, stop, info: ModelInfo,
                       api, rid: str) -> tuple[ChatCompletion, Any]:
        from jinja2 import TemplateError

        try:
            done = await session.chat_completion(req.messages, model=model, tools=req.tools, agent=claims.agent,
                                                 stop_token_ids=stop, max_prompt_tokens=info.max_prompt,
                                                 tool_calls=req.tool_choice != "none", **req.sampling)
        except TemplateError as e:
            raise BadRequest(f"the chat template of {model!r} refused these messages: {e}", "messages") from None
        response = api.conversation(rid, req, done)
        recorded = await self.sessions.recorded(claims, req, done, response)
        if response is not None:
            remember(session, *response)
        return done, recorded

    def streamed(self, api, rid: str, created: int, model: str, generate: Callable, claims: Claims,
                 req: ChatRequest, tokenizer, headers: dict[str, str]) -> EventStream:
        """The SSE answer: the opening now, the rest once `generate` returned; withdrawn if undelivered."""
        state: dict[str, Any] = {}

        async def rest() -> list[bytes]:
            try:
                state["done"], state["recorded"] = await generate()
            except JetError as e:  # the status line is gone: the error goes in the stream
                return api.error(e)
            return api.rest(api.body(rid, created, model, state["done"], tokenizer, req), req)

        async def finished(delivered: bool) -> None:
            if not delivered and "done" in state:
                await self.withdrawn(claims, state["done"], state["recorded"])

        return EventStream(api.opening(rid, created, model), rest, finished, headers)

    async def withdrawn(self, claims: Claims, done: ChatCompletion, recorded: Any) -> None:
        log.warning("task %r, episode %s: the client disconnected before it received call %s; withdrawn "
                    "from the episode (not trained)", claims.task, claims.episode_id, done.result.request_id)
        await self.sessions.undelivered(claims, done, recorded)

    async def info(self, session: Session, model: str, tokenizer: Any) -> ModelInfo:
        if model not in self._info:
            path = session.client.tokenizers.paths[model]
            self._info[model] = await anyio.to_thread.run_sync(ModelInfo, path, tokenizer)
        return self._info[model]

    def warn(self, claims: Claims, req: ChatRequest) -> dict[str, str]:
        if req.warning is None:
            return {}
        if (claims.task, req.warning) not in self._warned:  # once per task and kind, not per call
            self._warned.add((claims.task, req.warning))
            log.warning("task %r: %s", claims.task, req.warning)
        return {"Jet-Warning": req.warning}

    async def list_models(self, request):
        from starlette.responses import JSONResponse

        self.claims(request)
        return JSONResponse({"object": "list", "data": [self._model(m) for m in self.models]})

    async def get_model(self, request):
        from starlette.responses import JSONResponse

        self.claims(request)
        name = request.path_params["model"]
        if name not in self.models:
            return _error(404, f"unknown model {name!r}; served: {', '.join(self.models)}", "invalid_request_error",
                          "model", "model_not_found")
        return JSONResponse(self._model(name))

    async def not_found(self, request):
        allowed = next((e.split()[0] for e in ENDPOINTS if e.split()[1] == request.url.path), None)
        if allowed is not None:
            return _error(405, f"{request.method} {request.url.path}: method not allowed (use {allowed})",
                          "invalid_request_error", None, "method_not_allowed")
        try:
            task = repr(self.claims(request).task)
        except InvalidKey:
            task = "unknown (no valid key)"
        log.warning("task %s: %s %s is not served by the gateway (served: %s)", task, request.method,
                    request.url.path, ", ".join(ENDPOINTS))
        return _error(404, f"{request.method} {request.url.path} is not served here; the gateway serves "
                      f"{', '.join(ENDPOINTS)}", "invalid_request_error", None, "unknown_url")

    @staticmethod
    def _model(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "jet"}


def make_app(sessions: Sessions, signer: Signer, models: list[str],
             limits: Limits | None = None):
    """The ASGI app: the routes behind the admission limits; errors answered in OpenAI's shape."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    limits = limits or Limits()
    app = _App(sessions, signer, list(models), limits)
    errors = (InvalidKey, BadRequest, PromptTooLong, GenerationTimeout, GenerationError, QueueError, HTTPException)
    routes = [Route("/v1/chat/completions", app.chat, methods=["POST"]),
              Route("/v1/responses", app.responses, methods=["POST"]),
              Route("/v1/models", app.list_models, methods=["GET"]),
              Route("/v1/models/{model:path}", app.get_model, methods=["GET"]),
              Route("/{path:path}", app.not_found, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])]
    return Limiter(Starlette(routes=routes, exception_handlers={e: _handle for e in errors}), limits, GENERATING)


# ---- the two deployments


def embedded_limits(cfg: JetConfig) -> Limits:
    """An env worker's gateway: requests in flight follow the configured episode concurrency."""
    return Limits(max_in_flight=max(16, CALLS_PER_EPISODE * sum(t.concurrency for t in cfg.tasks)))


def pool_size(cfg: JetConfig) -> int:
    """Redis connections an env worker's LLM client may need: its gateway's requests and the episodes'
    own `jet.llm` calls, each at most CALLS_PER_EPISODE per episode at once."""
    return 2 * embedded_limits(cfg).connections


@contextlib.asynccontextmanager
async def episode_gateway(cfg: JetConfig, url: str, llm: LLMClient,
                          gateway_url: str | None = None) -> AsyncIterator[Episodes]:
    """The env worker's gateway: an embedded server over `llm`, or a standalone one at `gateway_url`."""
    if not gateway_url:  # keys signed with a secret of this process: valid at this process only
        signer = Signer(secrets.token_bytes(32), cfg.run)
        app = make_app(LocalSessions(llm), signer, [m.name for m in cfg.models], embedded_limits(cfg))
        async with serving(app, "127.0.0.1", 0) as base_url:
            log.info("embedded gateway on %s", base_url)
            yield Episodes(signer, base_url)
        return
    keys = Keys(cfg.run)
    r = await retry_forever(lambda: connect(url, name=f"jet-gateway-{llm.id}"), url=url, what="connect")
    try:
        signer = Signer(await load_secret(r, keys, url), cfg.run)
        yield Episodes(signer, gateway_url.rstrip("/"), r, keys, url)
    finally:
        with anyio.CancelScope(shield=True):
            await r.aclose()


async def run(cfg: JetConfig, url: str, stop: anyio.Event, *, host: str = "127.0.0.1", port: int = 8000,
              ready: Any = None, limits: Limits | None = None) -> None:
    """Serve the run's gateway on host:port until `stop`, then drain (in-flight requests get GRACE_S)."""
    limits = limits or Limits()
    keys = Keys(cfg.run)
    tokenizers = Tokenizers({m.name: m.path for m in cfg.models})
    for m in cfg.models:  # load now, not under the first requests' timeouts
        await anyio.to_thread.run_sync(tokenizers.get, m.name)
    r = await retry_forever(lambda: connect(url, name="jet-gateway", max_connections=limits.connections),
                            url=url, what="connect", stop=stop)
    try:
        signer = Signer(await load_secret(r, keys, url), cfg.run)
        timeouts = {m.name: m.request_timeout_s for m in cfg.models}
        async with open_client(url, keys, tokenizers, timeouts=timeouts, max_connections=limits.connections,
                               gen_maxlen=cfg.queues.maxlen.get("gen", 10_000), stop=stop) as llm:
            app = make_app(RecordingSessions(llm, r, keys, url), signer, [m.name for m in cfg.models], limits)
            async with serving(app, host, port) as base_url:
                log.info("gateway of run %r serving on %s (%s)", cfg.run, base_url, limits)
                if ready is not None:
                    ready(base_url)
                await stop.wait()
                log.info("gateway draining")
    finally:
        with anyio.CancelScope(shield=True):
            await r.aclose()


@click.command("gateway")
@config_options("models, queues, run")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; the default serves this machine only (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="TCP port (0: any free).")
@click.option("--max-in-flight", type=click.IntRange(min=1), default=_LIMITS.max_in_flight, show_default=True,
              help="Generating requests served at once; more get 429 with Retry-After.")
@click.option("--max-body-mb", type=click.FloatRange(min=0.001), default=_LIMITS.max_body / 2**20,
              show_default=True, help="MiB of one request body; more gets 413.")
@click.option("--max-body-in-flight-mb", type=click.FloatRange(min=0.001),
              default=_LIMITS.max_body_in_flight / 2**20, show_default=True,
              help="MiB of request bodies held at once; more gets 429 with Retry-After.")
@redis_url_option
def cli(config_path, overrides, host, port, max_in_flight, max_body_mb, max_body_in_flight_mb, redis_url) -> None:
    """OpenAI-compatible API (/v1/chat/completions, /v1/responses, /v1/models) whose calls are recorded in
    their episodes."""
    from jet.supervisor import run_role

    cfg = load_config(config_path, overrides)
    if not cfg.models:
        raise click.ClickException(f"{config_path}: no models configured")
    cfg = require_models(cfg, config_path)
    limits = Limits(max_body=int(max_body_mb * 2**20), max_in_flight=max_in_flight,
                    max_body_in_flight=int(max_body_in_flight_mb * 2**20))
    url = resolve_url(redis_url)
    try:
        run_role(lambda stop: run(cfg, url, stop, host=host, port=port, limits=limits), "jet gateway")
    except OSError as e:
        raise click.ClickException(str(e)) from None


if __name__ == "__main__":
    from jet.options import setup_logging

    setup_logging(os.environ.get("JET_LOG_LEVEL", "INFO"))
    cli()
