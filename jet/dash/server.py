"""`jet dash`: the live web dashboard of a swarm, with its JSON API and Prometheus metrics.

What it is: a Starlette app on uvicorn. `/` serves the pages (static/, plain
JavaScript that polls the JSON API under `/api/` and draws its own SVG charts:
no CDN, nothing fetched from outside); `/metrics` is Prometheus text. The data
comes from Redis (streams, groups, dead letters, trajectories, the worker
registry: jet.dash.swarm and jet.dash.episodes), the trainers' metrics files
(jet.dash.training) and the studies' folders (jet.dash.studies).

Access: bound to loopback (the default) it answers only requests whose Host is
a loopback name (a web page elsewhere cannot reach it by DNS rebinding); bound
to anything else it requires a token (`--token`, $JET_DASH_TOKEN, or a random
one it prints): `?token=` on the first page load (then a cookie), or
`Authorization: Bearer <token>` for the API and `/metrics`. Actions (dead
letters: requeue, drop) are POSTs with a JSON body from the same origin.

What it is not: a writer of anything but dead letters, which it changes with
the code `jet dlq` runs (jet.queues.admin). It never reads a stream with a
consumer group, so watching takes nothing from the workers or the trainer.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import anyio
import click
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from jet.options import redis_url_option, run_dir_option, run_option
from jet.dash import episodes, exporter, studies
from jet.dash.access import Access, is_loopback
from jet.dash.hub import Hub, Settings
from jet.errors import JetError
from jet.keys import Keys, check_name

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
DEFAULT_PORT = 8265
TOKEN_ENV = "JET_DASH_TOKEN"


# -- handlers -------------------------------------------------------------------------


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY,
                                 default=str), status_code=status, media_type="application/json")


def _hub(request: Request) -> Hub:
    return request.app.state.hub


async def _run(request: Request) -> str:
    run = request.query_params.get("run") or await _hub(request).default_run()
    if not run:
        raise BadRequest("no run: pass ?run=NAME (none found on the server or under runs_dir)")
    try:
        return check_name("run", run)
    except ValueError as e:
        raise BadRequest(str(e)) from None


class BadRequest(JetError):
    pass


def _float(request: Request, name: str) -> float | None:
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return None
    try:
        return float(raw)
    except ValueError:
        raise BadRequest(f"{name}: expected a number, got {raw!r}") from None


def _bool(request: Request, name: str) -> bool | None:
    raw = request.query_params.get(name)
    return None if raw in (None, "", "any") else raw.lower() in ("1", "true", "yes")


async def index(request: Request) -> Response:
    return FileResponse(STATIC / "index.html")


async def api_index(request: Request) -> Response:
    return _json({"endpoints": API})


async def api_runs(request: Request) -> Response:
    hub = _hub(request)
    return _json({"runs": await hub.runs(), "default": await hub.default_run(), "redis": bool(hub.s.redis_url)})


async def api_swarm(request: Request) -> Response:
    return _json(await _hub(request).snapshot(await _run(request)))


async def api_dlq(request: Request) -> Response:
    from jet.queues import admin

    body = await _body(request)
    op, ids, run = body.get("op"), body.get("ids"), body.get("run") or await _run(request)
    if op not in ("requeue", "drop") or not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise BadRequest('expected {"op": "requeue" | "drop", "ids": ["<dead-letter id>", ...], "run": "<run>"}')
    hub = _hub(request)
    keys = Keys(check_name("run", run))
    fn = admin.requeue if op == "requeue" else admin.drop
    n = await fn(await hub.redis(), keys, ids, hub.s.redis_url)
    hub.forget(run)
    log.info("dashboard: %s %d dead letter(s) of run %s", op, n, run)
    return _json({"op": op, "changed": n})


async def _body(request: Request) -> dict:
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise BadRequest("actions take a JSON body (Content-Type: application/json)")
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"malformed JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("expected a JSON object")
    return body


async def api_training(request: Request) -> Response:
    hub, run = _hub(request), await _run(request)
    model = request.query_params.get("model")
    if not model:
        models = await anyio.to_thread.run_sync(hub.curves.models, run)
        latest = {m: await anyio.to_thread.run_sync(hub.curves.latest, run, m) for m in models}
        return _json({"run": run, "models": models, "latest": latest})
    check_name("model", model)
    epoch, lines = int(_float(request, "epoch") or 0), int(_float(request, "lines") or 0)
    data = await anyio.to_thread.run_sync(hub.curves.since, run, model, epoch, lines)
    return _json({"run": run, "model": model, **data})


async def api_episodes(request: Request) -> Response:
    hub, run = _hub(request), await _run(request)
    q = request.query_params
    snap = await hub.snapshot(run)
    model = q.get("model") or next(iter(snap["models"]), None)
    if not model:
        return _json({"run": run, "models": [], "rows": [], "next": None})
    filters = {"task": q.get("task"), "min_reward": _float(request, "min_reward"),
               "max_reward": _float(request, "max_reward"), "failed": _bool(request, "failed"),
               "no_llm_calls": _bool(request, "no_llm_calls")}
    limit = max(1, min(500, int(_float(request, "limit") or 50)))
    out = await episodes.latest(await hub.redis(), Keys(run), check_name("model", model),
                                stream=q.get("stream", "traj"), before=q.get("before") or None, limit=limit,
                                filters=filters, url=hub.s.redis_url)
    return _json({"run": run, "model": model, "models": snap["models"], **out})


async def api_episode(request: Request) -> Response:
    hub, run = _hub(request), await _run(request)
    q = request.query_params
    model, entry = q.get("model"), q.get("id")
    if not model or not entry:
        raise BadRequest("pass ?model=M&id=<entry id>")
    found = await episodes.one(await hub.redis(), Keys(run), check_name("model", model), entry,
                               lambda m: hub.decoder(run, m), stream=q.get("stream", "traj"), url=hub.s.redis_url)
    if found is None:
        return _json({"error": f"no trajectory {entry} on {model} (trimmed, or a wrong id)"}, 404)
    return _json(found)


async def api_studies(request: Request) -> Response:
    return _json({"studies": await anyio.to_thread.run_sync(studies.studies, Path(_hub(request).s.studies_dir))})


async def api_study(request: Request) -> Response:
    name = request.path_params["name"]
    found = await anyio.to_thread.run_sync(studies.study, Path(_hub(request).s.studies_dir), name)
    return _json(found) if found is not None else _json({"error": f"no study {name!r}"}, 404)


async def study_file(request: Request) -> Response:
    path = studies.file_in(Path(_hub(request).s.studies_dir), request.path_params["name"], request.path_params["path"])
    return FileResponse(path) if path else _json({"error": "no such file"}, 404)


async def metrics(request: Request) -> Response:
    hub = _hub(request)
    runs = [request.query_params["run"]] if request.query_params.get("run") else (
        [hub.s.run] if hub.s.run else await hub.runs())
    snaps, trainers = {}, {}
    for run in runs:
        check_name("run", run)
        if hub.s.redis_url:
            snaps[run] = await hub.snapshot(run)
        for m in await anyio.to_thread.run_sync(hub.curves.models, run):
            trainers[(run, m)] = await anyio.to_thread.run_sync(hub.curves.latest, run, m)
    body = await anyio.to_thread.run_sync(exporter.render, snaps, trainers)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


API = {  # documented in docs/dashboard.md
    "GET /api/runs": "runs found on the server and under runs_dir, and the default one",
    "GET /api/swarm?run=R": "streams (length, groups: pending, lag, consumers + idle), dead letters, workers, "
                            "stats counters, latest weight versions",
    "POST /api/dlq {run, op: requeue|drop, ids}": "requeue or drop dead letters (what `jet dlq` does)",
    "GET /api/training?run=R": "models with a metrics file, and each one's latest line",
    "GET /api/training?run=R&model=M&epoch=E&lines=N": "metric series points after line N of epoch E",
    "GET /api/episodes?run=R&model=M&task=&min_reward=&max_reward=&failed=&no_llm_calls=&before=&limit=&stream=":
        "latest trajectories, newest first, filtered; `next` pages to older ones",
    "GET /api/episode?run=R&model=M&id=ID&stream=": "one trajectory, its tokens decoded, with mask, logprobs, versions",
    "GET /api/studies": "studies under studies_dir",
    "GET /api/studies/NAME": "a study's results (with per-arm intervals), decisions, report, plots",
    "GET /metrics": "Prometheus text format",
}


# -- the app --------------------------------------------------------------------------


async def _error(request: Request, exc: Exception) -> Response:
    status = 400 if isinstance(exc, (BadRequest, ValueError)) else 503
    return _json({"error": str(exc)}, status)


def create_app(s: Settings):
    """The dashboard as an ASGI app (behind the access rules of jet.dash.access)."""
    import contextlib

    hub = Hub(s)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await hub.close()

    app = Starlette(routes=[
        Route("/", index), Route("/api", api_index), Route("/api/runs", api_runs), Route("/api/swarm", api_swarm),
        Route("/api/dlq", api_dlq, methods=["POST"]), Route("/api/training", api_training),
        Route("/api/episodes", api_episodes), Route("/api/episode", api_episode),
        Route("/api/studies", api_studies), Route("/api/studies/{name}", api_study),
        Route("/api/studies/{name}/files/{path:path}", study_file), Route("/metrics", metrics),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ], exception_handlers={JetError: _error, ValueError: _error}, lifespan=lifespan)
    app.state.hub = hub
    return Access(app, token=s.token, loopback=s.loopback)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free one); `jet up` hands it to the dashboard."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def url_of(host: str, port: int, token: str | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/" + (f"?token={token}" if token else "")


def _model_paths(config_path: str | None) -> tuple[dict[str, str], str | None, str | None]:
    if not config_path:
        return {}, None, None
    from jet.options import load_config

    cfg = load_config(config_path)
    return {m.name: m.path for m in cfg.models}, cfg.run, cfg.runs_dir


@click.command("dash")
@run_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; anything but loopback requires the token.")
@click.option("--port", type=int, default=DEFAULT_PORT, show_default=True, help="Port (0: any free one).")
@click.option("--config", "config_path", default=None, envvar="JET_CONFIG", type=click.Path(dir_okay=False),
              help="A run config: its run, runs_dir and model folders (tokenizers) are used (default: $JET_CONFIG).")
@click.option("--runs-dir", default=None, help="Folder of the run folders (default: the config's, else runs).")
@click.option("--studies-dir", default="studies", show_default=True, help="Folder of the `jet study` folders.")
@click.option("--token", envvar=TOKEN_ENV, default=None,
              help="Access token (default: none on loopback, a random one elsewhere). Env: JET_DASH_TOKEN.")
@click.option("--alive", "alive_s", type=float, default=60.0, show_default=True,
              help="Seconds of consumer idle time after which it is not counted alive.")
@click.option("--fd", type=int, default=None, hidden=True, help="Serve on this inherited listening socket.")
@redis_url_option
@run_dir_option
def cli(run, host, port, config_path, runs_dir, studies_dir, token, alive_s, fd, redis_url, run_dir):
    """Live web dashboard: swarm, training curves, episodes, studies; JSON API and /metrics."""
    import uvicorn

    from jet.queues.server import discovered_url

    paths, cfg_run, cfg_runs = _model_paths(config_path)
    url = redis_url or discovered_url(run_dir)
    if not url:
        click.echo("jet dash: no Redis found (--redis-url, JET_REDIS_URL or `jet server`): "
                   "only training curves and studies are shown", err=True)
    loopback = is_loopback(host)
    if not loopback and not token:
        token = secrets.token_urlsafe(18)
    settings = Settings(redis_url=url, runs_dir=runs_dir or cfg_runs or "runs", studies_dir=studies_dir,
                        run=run or cfg_run, token=token, loopback=loopback, alive_s=alive_s, model_paths=paths)
    sock = socket.socket(fileno=fd) if fd is not None else bind(host, port)
    bound = sock.getsockname()[1]
    click.echo(f"jet dash: {url_of(host, bound, token)}", err=True)
    config = uvicorn.Config(create_app(settings), log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=3)
    # uvicorn shuts down gracefully on SIGTERM / SIGINT, then raises the signal again under the handlers
    # it found: these make that a clean exit 0, as every role drains and exits on SIGTERM
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    from jet.options import setup_logging

    setup_logging(os.environ.get("JET_LOG_LEVEL", "INFO"))
    cli()
