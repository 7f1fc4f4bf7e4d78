"""The inference worker: `jet worker infer --model NAME [--backend hf|vllm] [-n N]`.

What it is: a consumer of `gen:<model>` (group `infer`, consumer
`<host>-infer-<model>-<slot>`) that serves each request on its own
(`jet.queues.runtime.Runtime.serve_each`, up to `models[].max_inflight` at
once): it hands the request to the backend's per-request API
(`agenerate_one`: `hf` decodes the calls in flight together, joining and
leaving between steps, `jet.workers.inference.hf_engine`; `vllm` is its async engine),
and answers on the requester's reply stream with a GenResult the moment that
request completes. The reply XADD, the request's ack and its idempotency marker
commit in one atomic step, so a request reclaimed from a crashed worker or
sent again by the client is answered at most once. Weights announced on
`weights:<model>` are checked and loaded as they come (`jet.workers.inference.weights`):
the backend's gate lets the requests in flight finish and holds new ones back
meanwhile, so every reply carries the one version its tokens came from, and a
bad announcement is dead-lettered while the old weights keep serving.

Requests that cannot be served get a reason, never a crash: an over-long or
invalid request gets an error reply (from the backend); a malformed one goes to
the dead-letter stream. A request whose deadline passed before it started, or
whose reply stream is gone (its client died, or lost it and sends it again), is
dropped (acked WITHOUT a marker, without generating, counted as `gen_skipped`):
its caller has given up or sends it again, and a copy under the same id is still
served. A copy of a request this worker is decoding (same request id: the client
sent it again after losing its reply stream, jet.llm) joins the first: it waits
for that decoding and commits the same reply, which the marker makes a no-op
(acked, nothing written), so a request is decoded once per worker. A reply is
written only to a reply stream that still exists (the SETTLE step's NOMKSTREAM;
a dropped reply is counted as `outputs_dropped`), so no reply stream outlives
its client's TTL.

Several models on one base: `--model a --model b` (what `jet up` starts for the models
`JetConfig.serving_groups` puts together: LoRA adapters of one base) loads the base
once (`HFBackend(slots=N)`) and serves each model as above, through a view of that
backend (`HFBackend.view`): each its own `gen:<model>` stream and consumer, weight
follower, versions and heartbeat, in one process.

What it is not: a scheduler across workers (more throughput = more processes).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import click

from jet.options import config_options, load_config, redis_url_option, require_models, resolve_url
from jet.config import JetConfig
from jet.errors import CodecError
from jet.keys import GROUP_INFER, Keys
from jet.queues.connect import connect, retry_forever, translated
from jet.queues.consumer import Settings, consumer_name
from jet.queues.messages import Commit, Dead, Delivery, Drop, Outcome
from jet.queues.runtime import Runtime
from jet.runs import RunDir
from jet.sampling import settings_of
from jet.wire import GenRequest, GenResult
from jet.workers.inference.backend import SamplingParams
from jet.workers.inference.weights import WeightFollower

log = logging.getLogger(__name__)

DEADLINE_GRACE_S = 1.0  # clock skew tolerated between client and worker (s)


def make_backend(kind: str, path: str, device: str, max_inflight: int = 64, dtype: str = "float32",
                 prefix_cache_mb: float | list[float] = 1024, slots: int = 1, lora_rank: int | None = None) -> Any:
    """Load the backend (blocking: call from a thread). `slots` > 1: several adapter models on one base;
    `prefix_cache_mb`: each model's prefix cache (hf), one size or one per slot; `lora_rank`: the model(s)
    publish adapter versions of at most this rank (vllm: LoRA on)."""
    if kind == "hf":
        from jet.workers.inference.hf import HFBackend

        return HFBackend(path, device=device, dtype=dtype, max_inflight=max_inflight,
                         prefix_cache_mb=prefix_cache_mb, slots=slots)
    if kind == "vllm":
        from jet.workers.inference.vllm import VLLMBackend

        return VLLMBackend(path, device=device, dtype=dtype, max_num_seqs=max_inflight,
                           lora_slots=slots if lora_rank else 0, max_lora_rank=lora_rank or 16)
    raise ValueError(f"unknown backend {kind!r}; expected 'hf' or 'vllm'")


def adapter_rank(cfg: JetConfig, models: list[str]) -> int | None:
    """The largest LoRA rank the models publish as adapter versions (None: none does)."""
    ranks = [cfg.model(x).adapter.r for x in models
             if cfg.model(x).adapter is not None and cfg.model(x).adapter.publish == "adapter"]
    return max(ranks) if ranks else None


def prefill_counts(backend) -> dict[str, int]:
    """The heartbeat's prompt counters (hf backend): prompt tokens admitted and those computed, the rest
    taken from the prefix cache (`jet.workers.inference.prefix_cache`); {} for a backend without one."""
    cache = getattr(backend, "prefix_cache", None)
    if cache is None:
        return {}
    return {"prompt_tokens": cache.stats.prompt_tokens, "prefill_tokens": cache.stats.computed_tokens}


class Handler:
    """Turns one delivery of `gen:<model>` into its outcome: a reply, a drop or a dead letter."""

    def __init__(self, rt: Runtime, backend: Any, model: str):
        self.rt, self.backend, self.model = rt, backend, model
        self.keys, self.url = rt.keys, rt.url
        self.decoding: dict[str, _Decoding] = {}  # request id -> its decoding in progress here

    async def __call__(self, d: Delivery) -> Outcome:
        req = self._decode(d)
        if isinstance(req, Dead):
            return req
        if req.deadline and time.time() > req.deadline + DEADLINE_GRACE_S:
            return Drop("gen_skipped")  # its caller gave up: nothing to decode for
        if not await self._client_alive(req.reply_to):
            return Drop("gen_skipped")
        out = await self._generate(req)
        return Commit([(req.reply_to, self._result(req, out).to_fields())])

    async def _generate(self, req: GenRequest):
        """The backend's output for `req`; a copy of a request decoding here waits for that one's
        (and decodes on its own only if that one failed or was cancelled)."""
        while (first := self.decoding.get(req.msg_id)) is not None:
            log.info("request %s arrived again while it decodes here: joining that decoding", req.msg_id)
            await first.done.wait()
            if first.out is not None:
                return first.out
        mine = self.decoding[req.msg_id] = _Decoding()
        try:
            mine.out = await self.backend.agenerate_one(list(req.prompt_ids), sampling(req))
            return mine.out
        finally:
            del self.decoding[req.msg_id]
            mine.done.set()

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

    async def _client_alive(self, reply_to: str) -> bool:
        with translated(self.url):
            return bool(await self.rt.client.exists(reply_to))

    def _result(self, req: GenRequest, out) -> GenResult:
        return GenResult(request_id=req.msg_id, model=self.model, token_ids=out.token_ids,
                         logprobs=out.logprobs, finish_reason=out.finish_reason, version=out.version,
                         error=out.error, worker=self.rt.name)


@dataclass(slots=True)
class _Decoding:
    done: anyio.Event = field(default_factory=anyio.Event)
    out: Any = None  # the backend's GenOutput once it finished


def sampling(req: GenRequest) -> SamplingParams:
    return SamplingParams(**settings_of(req), max_tokens=req.max_tokens, stop_token_ids=req.stop_token_ids,
                          seed=req.seed)


def weights_roots(cfg: JetConfig, model: str) -> list[Path]:
    """Where weight announcements of `model` may point: the run's weights folder, and the configured roots."""
    return [RunDir.of(cfg).weights(model), *map(Path, cfg.model(model).weights_roots)]


async def run(cfg: JetConfig, model: str, url: str, stop: anyio.Event, *, slot: int = 0,
              backend: Any = None, backend_kind: str | None = None, device: str | None = None,
              close_backend: bool = True) -> None:
    """Serve `gen:<model>` until `stop` is set, then drain (requests in flight finish or are released).

    `backend`: use this one instead of loading `models[].backend`; `close_backend=False` leaves it open."""
    m = cfg.model(model)
    keys, settings = Keys(cfg.run), Settings.of(cfg.queues, batch=m.max_inflight)
    if (device or m.device) == "cpu":
        import torch

        from jet.supervisor import check_threads

        if m.threads:
            torch.set_num_threads(m.threads)
        check_threads(f"jet worker infer --model {model}", torch.get_num_threads())  # warns on an oversubscribed host
    if backend is None:
        backend = await anyio.to_thread.run_sync(make_backend, backend_kind or m.backend, m.path, device or m.device,
                                                 m.max_inflight, m.dtype, m.prefix_cache_mb, 1,
                                                 adapter_rank(cfg, [model]))
    if m.adapter is not None and m.adapter.publish == "adapter" and hasattr(backend, "keep_base_of"):
        await anyio.to_thread.run_sync(backend.keep_base_of, m.adapter.target_modules)  # hf, one model: merged
    name = consumer_name(f"infer-{model}", slot)
    try:
        rw = await retry_forever(lambda: connect(url, block_ms=settings.block_ms, name=name), url=url,
                                 what="connect", stop=stop)
        beat = {"model": model, "backend": backend_kind or m.backend}
        async with Runtime(url, keys, keys.gen(model), GROUP_INFER, name, settings, stop=stop, role="infer",
                           beat=lambda: {**beat, "weight_version": backend.version, **prefill_counts(backend)}) as rt:
            follower = WeightFollower(rt.client, rw, url, keys, model, name, weights_roots(cfg, model),
                                      settings.block_ms)
            await follower.catch_up(backend)
            log.info("%s serving %s (weight version %d, %d requests in flight at most)", name, model,
                     backend.version, m.max_inflight)
            async with anyio.create_task_group() as tg:
                tg.start_soon(follower.run, backend)
                await rt.serve_each(Handler(rt, backend, model), stop, concurrency=m.max_inflight)
                tg.cancel_scope.cancel()
        with anyio.CancelScope(shield=True):
            await rw.aclose()
        counts = prefill_counts(backend)
        if counts:
            log.info("%s: %d prompt tokens admitted, %d prefilled (the rest from the prefix cache)", name,
                     counts["prompt_tokens"], counts["prefill_tokens"])
    finally:
        if close_backend and hasattr(backend, "close"):
            backend.close()


def shared_group(cfg: JetConfig, models: list[str]) -> str | None:
    """Why `models` cannot be served by one worker (None when they can: one serving group's members)."""
    for group in cfg.serving_groups():
        if set(models) <= set(group):
            return None
    return (f"models {models} are not adapters of one base: one inference worker serves several models only when "
            f"each trains an adapter (models[].adapter, publish: adapter, share_base) of the same path, backend, "
            f"device and dtype; serving groups of this config: {cfg.serving_groups()}")


async def run_shared(cfg: JetConfig, models: list[str], url: str, stop: anyio.Event, *, slot: int = 0,
                     device: str | None = None) -> None:
    """Serve several models that are adapters of one base from one copy of it, until `stop` is set."""
    problem = shared_group(cfg, models)
    if problem:
        raise ValueError(problem)
    m = cfg.model(models[0])
    backend = await anyio.to_thread.run_sync(
        make_backend, m.backend, m.path, device or m.device, sum(cfg.model(x).max_inflight for x in models), m.dtype,
        [cfg.model(x).prefix_cache_mb for x in models], len(models), adapter_rank(cfg, models))  # each its own
    log.info("one %s base for %d models: %s (%s backend)", m.path, len(models), ", ".join(models), m.backend)
    try:
        async with anyio.create_task_group() as tg:
            for i, model in enumerate(models):
                tg.start_soon(lambda i=i, model=model: run(cfg, model, url, stop, slot=slot, backend=backend.view(i),
                                                           backend_kind=m.backend, device=device, close_backend=False))
    finally:
        if hasattr(backend, "close"):
            backend.close()


@click.command("infer")
@config_options("models, queues, run")
@click.option("--model", "models", multiple=True,
              help="Model to serve (default: the only configured one); repeated: several adapter models of one "
                   "base, served from one copy of it.")
@click.option("--backend", type=click.Choice(["hf", "vllm"]), default=None, help="Overrides models[].backend.")
@click.option("--device", default=None, help="Torch device; overrides models[].device.")
@click.option("-n", "processes", type=click.IntRange(min=1), default=1, show_default=True, help="Worker processes.")
@click.option("--slot", type=click.IntRange(min=0), default=0, show_default=True,
              help="First slot number (stable consumer names: host-infer-<model>-<slot>).")
@redis_url_option
def cli(config_path, overrides, models, backend, device, processes, slot, redis_url) -> None:
    """Serve generation requests of one model (gen:<model>) with the hf or vllm backend (or of several
    LoRA adapter models of one base, from one copy of it)."""
    from jet.config import REDIS_URL_ENV
    from jet.supervisor import Child, Supervisor, python_module, run_role

    cfg = load_config(config_path, overrides)
    if not models:
        if len(cfg.models) != 1:
            raise click.UsageError(f"--model is required: configured models are {[m.name for m in cfg.models]}")
        models = (cfg.models[0].name,)
    for model in models:
        if model not in [m.name for m in cfg.models]:
            raise click.UsageError(f"--model: unknown model {model!r}; configured: {[m.name for m in cfg.models]}")
    models = list(dict.fromkeys(models))
    if len(models) > 1:
        if backend is not None and backend != cfg.model(models[0]).backend:
            raise click.UsageError("--backend: several models on one base are served by their configured backend")
        if problem := shared_group(cfg, models):
            raise click.UsageError(problem)
    model = models[0]
    cfg, raw = require_models(cfg, config_path, models), cfg
    url = resolve_url(redis_url)
    if processes > 1:
        from jet.config import pins

        sets = (*overrides, *pins(raw, cfg))  # every process loads the commit a Hub id resolved to here

        def argv_of(i: int) -> list[str]:
            argv = [*python_module("jet.workers.inference.worker"), "--config", config_path,
                    *[x for m in models for x in ("--model", m)], "--slot", str(slot + i)]
            argv += [x for o in sets for x in ("--set", o)]
            argv += ["--backend", backend] if backend else []
            return argv + (["--device", device] if device else [])

        os.environ[REDIS_URL_ENV] = url  # children inherit it; a password never shows in `ps`
        raise SystemExit(Supervisor(lambda bank: [Child(f"infer-{'+'.join(models)}-{slot + i}", argv_of(i))
                                                  for i in range(processes)]).run())
    if len(models) > 1:
        run_role(lambda stop: run_shared(cfg, models, url, stop, slot=slot, device=device), "jet worker infer")
    else:
        run_role(lambda stop: run(cfg, model, url, stop, slot=slot, backend_kind=backend, device=device),
                 "jet worker infer")


if __name__ == "__main__":
    from jet.options import setup_logging

    setup_logging(os.environ.get("JET_LOG_LEVEL", "INFO"))
    cli()
