"""The gateway: an OpenAI-compatible HTTP API (`/v1/chat/completions`, `/v1/models`) over `gen:<model>`.

What it is: a Starlette app on uvicorn that turns OpenAI chat requests into
`jet.llm` calls, so an agent written with the `openai` SDK, LangChain or plain
HTTP is trained unchanged. Each episode gets a base URL and an API key (a
signed, expiring token naming the episode run, model and agent:
`jet.workers.gateway_auth`); a call made with it is built token-in-token-out
by the same `Session.chat_completion` as `llm.chat` (the same kept token ids,
so the merge sees one timeline) and recorded in that episode. Unknown,
tampered or expired keys get 401; malformed bodies 400 with a reason, in
OpenAI's error shape (`jet.workers.gateway_openai`). Streaming is answered as
SSE chunks of the finished completion (generation is not incremental).

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
  the task back (QueueError). See `jet.workers.gateway_episodes`.
Keys of a standalone gateway are signed with the run's secret
($JET_GATEWAY_SECRET, else one kept in Redis: `jet.workers.gateway_auth`).

Whichever model a request names: a configured model is used as named; any
other name (agents hard-code "gpt-4o") means the key's model. The agent name
is the key's; keys for other agents or models of the same episode come from
`llm.openai_credentials(agent=..., model=...)`.

What it is not: a public endpoint. It binds to loopback unless told otherwise,
and keys protect episodes from each other, not the run from its own agents.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import time
from typing import Any, AsyncIterator

import anyio
import click
import orjson

from jet.cliopts import config_options, load_config, redis_url_option, require_models, resolve_url
from jet.config import JetConfig
from jet.errors import GenerationError, GenerationTimeout, JetError, QueueError
from jet.keys import Keys
from jet.llm import ChatCompletion, LLMClient, Session, Tokenizers, open_client
from jet.queues.connect import connect, retry_forever
from jet.workers.gateway_auth import Claims, InvalidKey, Signer, load_secret
from jet.workers.gateway_episodes import Episodes, RecordingSessions
from jet.workers.gateway_openai import BadRequest, ChatRequest, completion, error_body, parse_chat, stream_events

log = logging.getLogger(__name__)

MAX_BODY = 16 * 1024 * 1024  # bytes of a request body
GRACE_S = 10.0  # on shutdown, seconds in-flight requests get to finish
KEY_GRACE_S = 60.0  # an episode's key outlives its timeout by this much (s)


# ---- the app


class LocalSessions:
    """Embedded: keys reach the live sessions of this process's LLM client; calls record themselves."""

    def __init__(self, client: LLMClient):
        self.client = client

    async def get(self, claims: Claims) -> Session:
        s = self.client.sessions.get(claims.episode_id)
        if s is None or s.tag != claims.tag:
            raise InvalidKey("the episode of this API key is not running (it is over)", "episode_over")
        return s

    async def recorded(self, claims: Claims, request: ChatRequest, done: ChatCompletion) -> None:
        """Refuse the answer of a call that outlived its episode (the merge had already read the calls),
        as a standalone gateway does."""
        if self.client.sessions.get(claims.episode_id) is None:
            raise InvalidKey("the episode ended before this call finished: it was not recorded", "episode_over")


def _stop_ids(tokenizer: Any, stops: tuple[str, ...]) -> tuple[int, ...]:
    ids = []
    for s in stops:
        encoded = tokenizer.encode(s, add_special_tokens=False)
        if len(encoded) != 1:
            raise BadRequest(f"stop: {s!r} is {len(encoded)} tokens of this model; the gateway supports stop "
                             "strings of exactly one token", "stop")
        ids.append(encoded[0])
    return tuple(ids)


def _error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(message, kind, param, code), status_code=status)


class _App:
    def __init__(self, sessions: LocalSessions | RecordingSessions, signer: Signer, models: list[str]):
        self.sessions, self.signer, self.models = sessions, signer, models

    def claims(self, request) -> Claims:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise InvalidKey("missing API key: send 'Authorization: Bearer <key>'")
        return self.signer.verify(key.strip())

    async def chat(self, request):
        from starlette.responses import JSONResponse, StreamingResponse

        claims = self.claims(request)
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY:
                return _error(413, f"request body over {MAX_BODY} bytes", "invalid_request_error")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise BadRequest(f"the request body is not valid JSON: {e}") from None
        req = parse_chat(body)
        session = await self.sessions.get(claims)
        model = req.model if req.model in self.models else claims.model
        if model not in self.models:
            raise BadRequest(f"model {model!r} is not served here; served: {', '.join(self.models)}", "model")
        tokenizer = await anyio.to_thread.run_sync(session.client.tokenizers.get, model)
        stop = _stop_ids(tokenizer, req.stop)
        done = await _complete(session, req, model, claims.agent, stop)
        await self.sessions.recorded(claims, req, done)
        body = completion(f"chatcmpl-{done.result.request_id}", int(time.time()), model, done.message,
                          done.result.finish_reason, len(done.call.prompt_ids), len(done.call.completion_ids),
                          done.result.version)
        if req.stream:
            return StreamingResponse(stream_events(body, req.include_usage), media_type="text/event-stream")
        return JSONResponse(body)

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

    @staticmethod
    def _model(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "jet"}


async def _complete(session: Session, req: ChatRequest, model: str, agent: str, stop: tuple[int, ...]):
    from jinja2 import TemplateError

    try:
        return await session.chat_completion(req.messages, model=model, tools=req.tools, agent=agent,
                                             stop_token_ids=stop, **req.sampling)
    except TemplateError as e:
        raise BadRequest(f"the chat template of {model!r} refused these messages: {e}", "messages") from None


def make_app(sessions: LocalSessions | RecordingSessions, signer: Signer, models: list[str]):
    """The Starlette app; errors are answered in OpenAI's shape."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    app = _App(sessions, signer, list(models))
    handlers = {
        InvalidKey: lambda r, e: _error(401, str(e), "authentication_error", None, e.code),
        BadRequest: lambda r, e: _error(400, str(e), "invalid_request_error", e.param, e.code),
        GenerationTimeout: lambda r, e: _error(504, str(e), "timeout_error"),
        GenerationError: lambda r, e: _error(400, f"the inference worker refused the request: {e}",
                                             "invalid_request_error"),
        QueueError: lambda r, e: _error(503, f"the run's Redis is unavailable: {e}", "server_error"),
        HTTPException: lambda r, e: _error(e.status_code, str(e.detail), "invalid_request_error"),
    }
    return Starlette(routes=[Route("/v1/chat/completions", app.chat, methods=["POST"]),
                             Route("/v1/models", app.list_models, methods=["GET"]),
                             Route("/v1/models/{model:path}", app.get_model, methods=["GET"])],
                     exception_handlers=handlers)


# ---- serving


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # the process owns its signals: SIGTERM drains the whole worker
            yield

    return Server


@contextlib.asynccontextmanager
async def serving(app, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Serve `app` on host:port (0 = a free port) until the block exits; yields the base URL (.../v1)."""
    import uvicorn

    server = _server_class()(uvicorn.Config(app, lifespan="off", log_config=None, access_log=False,
                                            server_header=False, timeout_graceful_shutdown=GRACE_S))
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)

    async def serve() -> None:
        with anyio.CancelScope(shield=True):  # shut down cleanly (bounded by GRACE_S) even when cancelled
            await server.serve(sockets=[sock])

    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        port = sock.getsockname()[1]
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve)
            with anyio.fail_after(30):
                while not server.started:
                    await anyio.sleep(0.01)
            try:
                yield f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
            finally:
                server.should_exit = True
    finally:
        sock.close()


@contextlib.asynccontextmanager
async def episode_gateway(cfg: JetConfig, url: str, llm: LLMClient,
                          gateway_url: str | None = None) -> AsyncIterator[Episodes]:
    """The env worker's gateway: an embedded server over `llm`, or a standalone one at `gateway_url`."""
    if not gateway_url:  # keys signed with a secret of this process: valid at this process only
        signer = Signer(secrets.token_bytes(32), cfg.run)
        app = make_app(LocalSessions(llm), signer, [m.name for m in cfg.models])
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


# ---- the standalone process


async def run(cfg: JetConfig, url: str, stop: anyio.Event, *, host: str = "127.0.0.1", port: int = 8000,
              ready: Any = None) -> None:
    """Serve the run's gateway on host:port until `stop`, then drain (in-flight requests get GRACE_S)."""
    keys = Keys(cfg.run)
    tokenizers = Tokenizers({m.name: m.path for m in cfg.models})
    for m in cfg.models:  # load now, not under the first requests' timeouts
        await anyio.to_thread.run_sync(tokenizers.get, m.name)
    r = await retry_forever(lambda: connect(url, name="jet-gateway"), url=url, what="connect")
    try:
        signer = Signer(await load_secret(r, keys, url), cfg.run)
        timeout = max(30.0, 3 * cfg.queues.lease_ms / 1000)
        async with open_client(url, keys, tokenizers, timeout_s=timeout,
                               gen_maxlen=cfg.queues.maxlen.get("gen", 10_000)) as llm:
            app = make_app(RecordingSessions(llm, r, keys, url), signer, [m.name for m in cfg.models])
            async with serving(app, host, port) as base_url:
                log.info("gateway of run %r serving on %s", cfg.run, base_url)
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
@redis_url_option
def cli(config_path, overrides, host, port, redis_url) -> None:
    """OpenAI-compatible API (/v1/chat/completions, /v1/models) whose calls are recorded in their episodes."""
    from jet.workers.processes import run_until_signal

    cfg = load_config(config_path, overrides)
    if not cfg.models:
        raise click.ClickException(f"{config_path}: no models configured")
    require_models(cfg, config_path)
    url = resolve_url(redis_url)
    try:
        run_until_signal(lambda stop: run(cfg, url, stop, host=host, port=port))
    except (JetError, OSError) as e:
        raise click.ClickException(str(e)) from None


if __name__ == "__main__":
    from jet.cli import setup_logging

    setup_logging(os.environ.get("JET_LOG_LEVEL", "INFO"))
    cli()
