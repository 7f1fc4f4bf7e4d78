"""The inference worker: `jet worker infer --model NAME [--backend hf|vllm] [-n N]`.

What it is: a consumer of `gen:<model>` (group `infer`, consumer
`<host>-infer-<model>-<slot>`) that takes up to `models[].max_batch` requests
at a time (`jet.queues.runtime.Runtime.serve_batches`), generates them with the backend in one batch
(`hf`: a thread; `vllm`: its async engine), and answers each on the
requester's reply stream with a GenResult. The reply XADD, the request's ack
and its idempotency marker commit in one atomic step, so a request reclaimed
from a crashed worker or retried by the client is answered at most once.
Between batches it loads the newest weights announced on `weights:<model>`
(`jet.workers.weights`); every reply carries the version it was generated with.

Requests that cannot be served get a reason, never a crash: an over-long or
invalid request gets an error reply (from the backend); a malformed one goes to
the dead-letter stream. A request whose deadline passed, or whose reply stream
is gone (its client died), is dropped (acked WITHOUT a marker, without
generating, counted as `gen_skipped`): the client has retried or gone, and a
retry under the same id is still served. A reply is written only to a reply
stream that still exists (the SETTLE step's NOMKSTREAM; a dropped reply is
counted as `outputs_dropped`), so no reply stream outlives its client's TTL.

What it is not: a scheduler across workers (more throughput = more processes).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import time
from typing import Any, Sequence

import anyio
import click

from jet.cliopts import config_options, load_config, redis_url_option, require_models, resolve_url
from jet.config import JetConfig
from jet.errors import CodecError
from jet.keys import GROUP_INFER, Keys
from jet.queues.connect import connect, retry_forever, translated
from jet.queues.consumer import Delivery, Settings, consumer_name
from jet.queues.runtime import Commit, Dead, Drop, Outcome, Runtime
from jet.wire import GenRequest, GenResult
from jet.workers.hf_backend import SamplingParams
from jet.workers.weights import WeightFollower

log = logging.getLogger(__name__)

DEADLINE_GRACE_S = 1.0  # clock skew tolerated between client and worker (s)


def make_backend(kind: str, path: str, device: str) -> Any:
    """Load the backend (blocking: call from a thread)."""
    if kind == "hf":
        from jet.workers.hf_backend import HFBackend

        return HFBackend(path, device=device)
    if kind == "vllm":
        from jet.workers.vllm_backend import VLLMBackend

        return VLLMBackend(path, device=device)
    raise ValueError(f"unknown backend {kind!r}; expected 'hf' or 'vllm'")


class Handler:
    """Turns a batch of deliveries of `gen:<model>` into outcomes: replies, drops, dead letters."""

    def __init__(self, rt: Runtime, backend: Any, follower: WeightFollower, model: str):
        self.rt, self.backend, self.follower, self.model = rt, backend, follower, model
        self.keys, self.url = rt.keys, rt.url

    async def __call__(self, batch: list[Delivery]) -> list[Outcome]:
        results: list[Outcome] = [Drop("gen_skipped") for _ in batch]
        todo: list[tuple[int, GenRequest]] = []
        for i, d in enumerate(batch):
            req = self._decode(d)
            if isinstance(req, Dead):
                results[i] = req
            elif not req.deadline or time.time() <= req.deadline + DEADLINE_GRACE_S:
                todo.append((i, req))
        gone = await self._gone_clients({req.reply_to for _, req in todo})
        todo = [(i, req) for i, req in todo if req.reply_to not in gone]
        if len(todo) < len(batch):
            log.info("skipped %d requests whose client gave up or is gone", len(batch) - len(todo))
        if todo:
            await self.follower.apply(self.backend)  # between batches: one version per batch
            outs = await self._generate([req for _, req in todo])
            for (i, req), out in zip(todo, outs):
                results[i] = Commit([(req.reply_to, self._result(req, out).to_fields())])
        return results

    def _decode(self, d: Delivery) -> GenRequest | Dead:
        """The request, or its dead letter (malformed, wrong model, foreign reply key)."""
        try:
            req = GenRequest.from_payload(d.payload)
            if req.model != self.model:
                raise CodecError(f"request for model {req.model!r} on the stream of {self.model!r}")
            if not req.reply_to.startswith(self.keys.prefix):
                raise CodecError(f"reply stream {req.reply_to!r} is not a key of run {self.keys.run!r}")
            if self.keys.kind(req.reply_to) != "reply":
                raise CodecError(f"reply_to {req.reply_to!r} is not a reply stream")
        except CodecError as e:
            return Dead(str(e))
        return req

    async def _gone_clients(self, streams: set[str]) -> set[str]:
        streams = sorted(streams)
        with translated(self.url):
            async with self.rt.client.pipeline(transaction=False) as p:
                for s in streams:
                    p.exists(s)
                flags = await p.execute()
        return {s for s, f in zip(streams, flags) if not f}

    async def _generate(self, reqs: list[GenRequest]) -> list:
        prompts = [list(r.prompt_ids) for r in reqs]
        params = [SamplingParams(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens,
                                 stop_token_ids=r.stop_token_ids, seed=r.seed) for r in reqs]
        if inspect.iscoroutinefunction(getattr(self.backend, "agenerate", None)):
            return await self.backend.agenerate(prompts, params)
        return await anyio.to_thread.run_sync(self.backend.generate, prompts, params)

    def _result(self, req: GenRequest, out) -> GenResult:
        return GenResult(request_id=req.msg_id, model=self.model, token_ids=out.token_ids,
                         logprobs=out.logprobs, finish_reason=out.finish_reason, version=out.version,
                         error=out.error, worker=self.rt.name)


async def run(cfg: JetConfig, model: str, url: str, stop: anyio.Event, *, slot: int = 0,
              backend: Any = None, backend_kind: str | None = None, device: str | None = None) -> None:
    """Serve `gen:<model>` until `stop` is set, then drain (finish or release the batch in hand)."""
    m = cfg.model(model)
    keys, settings = Keys(cfg.run), Settings.of(cfg.queues, batch=m.max_batch)
    if backend is None:
        backend = await anyio.to_thread.run_sync(make_backend, backend_kind or m.backend, m.path, device or m.device)
    name = consumer_name(f"infer-{model}", slot)
    try:
        rw = await retry_forever(lambda: connect(url, block_ms=settings.block_ms, name=name), url=url,
                                 what="connect", stop=stop)
        follower = WeightFollower(rw, url, keys, model, settings.block_ms)
        async with Runtime(url, keys, keys.gen(model), GROUP_INFER, name, settings, stop=stop) as rt:
            await follower.catch_up()
            await follower.apply(backend)
            log.info("%s serving %s (weight version %d, batch %d)", name, model, backend.version, m.max_batch)
            async with anyio.create_task_group() as tg:
                tg.start_soon(follower.run)
                await rt.serve_batches(Handler(rt, backend, follower, model), stop)
                tg.cancel_scope.cancel()
        with anyio.CancelScope(shield=True):
            await rw.aclose()
    finally:
        if hasattr(backend, "close"):
            backend.close()


@click.command("infer")
@config_options("models, queues, run")
@click.option("--model", default=None, help="Model to serve (default: the only configured one).")
@click.option("--backend", type=click.Choice(["hf", "vllm"]), default=None, help="Overrides models[].backend.")
@click.option("--device", default=None, help="Torch device; overrides models[].device.")
@click.option("-n", "processes", type=click.IntRange(min=1), default=1, show_default=True, help="Worker processes.")
@click.option("--slot", type=click.IntRange(min=0), default=0, show_default=True,
              help="First slot number (stable consumer names: host-infer-<model>-<slot>).")
@redis_url_option
def cli(config_path, overrides, model, backend, device, processes, slot, redis_url) -> None:
    """Serve generation requests of one model (gen:<model>) with the hf or vllm backend."""
    from jet.config import REDIS_URL_ENV
    from jet.supervisor import Child, Supervisor, run_role

    cfg = load_config(config_path, overrides)
    if model is None:
        if len(cfg.models) != 1:
            raise click.UsageError(f"--model is required: configured models are {[m.name for m in cfg.models]}")
        model = cfg.models[0].name
    if model not in [m.name for m in cfg.models]:
        raise click.UsageError(f"--model: unknown model {model!r}; configured: {[m.name for m in cfg.models]}")
    require_models(cfg, config_path, [model])
    url = resolve_url(redis_url)
    if processes > 1:
        def argv_of(i: int) -> list[str]:
            argv = [sys.executable, "-m", "jet.workers.infer", "--config", config_path, "--model", model,
                    "--slot", str(slot + i)]
            argv += [x for o in overrides for x in ("--set", o)]
            argv += ["--backend", backend] if backend else []
            return argv + (["--device", device] if device else [])

        os.environ[REDIS_URL_ENV] = url  # children inherit it; a password never shows in `ps`
        raise SystemExit(Supervisor(lambda bank: [Child(f"infer-{model}-{slot + i}", argv_of(i))
                                                  for i in range(processes)]).run())
    run_role(lambda stop: run(cfg, model, url, stop, slot=slot, backend_kind=backend, device=device),
             "jet worker infer")


if __name__ == "__main__":
    from jet.cliopts import setup_logging

    setup_logging(os.environ.get("JET_LOG_LEVEL", "INFO"))
    cli()
