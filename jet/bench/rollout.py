"""`jet bench rollout`: generated tokens/s of an inference backend, served four ways, in one run.

What it is: one random tiny model (head_dim 64, so vLLM's CPU build runs it
too) and one workload: `requests` prompts whose completion lengths are heavy
tailed (4 x Pareto(1.2): median 7 tokens, a few up to `max_len`; EOS is ignored
so a request's length is its max_tokens), seeded, so every mode generates
the same tokens. Per backend (`hf`, and `vllm` where it is installed):

- `direct`: `concurrency` in-process callers of `backend.agenerate_one`, each
  taking the next request as soon as its last one completed (continuous);
- `full path`: the same callers through `jet.llm` (GenRequest on `gen:`, an
  inference worker `jet.workers.inference.worker.run` in this process with the same
  backend object, the reply stream), against an embedded server;
- `batch-synchronous`: batches of `concurrency` requests, each batch waiting
  for its longest completion before the next starts (how the worker served
  before per-request serving);
- `continuous` is `direct`.

Printed comparisons, each with its `ratio`: full path / direct (goal >= 0.8)
and continuous / batch-synchronous (goal >= 1.5 on this heavy-tailed load).

What it is not: a model-speed benchmark (the model is tiny, so per-token
overheads weigh more than on a real model), or a test: the ratios are measured,
never asserted.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import random
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import anyio
import click

from jet.bench import emit, progress, redis_url_option, server_url

MODEL = "bench"
DEFAULTS = {"requests": 128, "concurrency": 16, "max_len": 256, "prompt_len": 24, "repeats": 3}
QUICK = {"requests": 12, "concurrency": 4, "max_len": 24, "prompt_len": 8, "repeats": 1}
GOALS = {"full_path_vs_direct": 0.8, "continuous_vs_batch_synchronous": 1.5}


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int
    seed: int


def workload(n: int, max_len: int, prompt_len: int, vocab: int, seed: int = 0) -> list[Request]:
    """`n` requests with completion lengths 4 x Pareto(1.2), in [4, max_len] (median 7, a few at max_len)."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        length = min(max_len, max(2, math.ceil(4 * rnd.paretovariate(1.2))))
        prompt = [rnd.randrange(3, vocab) for _ in range(rnd.randint(prompt_len // 2, prompt_len))]
        out.append(Request(prompt, length, seed * 100_000 + i))
    return out


def bench_model(folder: Path) -> Path:
    from jet.models import init_model

    return init_model(folder, vocab_size=512, hidden_size=128, layers=2, heads=2, kv_heads=1, max_position=512,
                      seed=0)


def params_of(r: Request):
    from jet.workers.inference.backend import SamplingParams

    return SamplingParams(temperature=1.0, max_tokens=r.max_tokens, seed=r.seed)


def make_backend(kind: str, model_dir: Path, concurrency: int):
    if kind == "hf":
        from jet.workers.inference.hf import HFBackend

        backend = HFBackend(model_dir, max_inflight=concurrency)
        backend.eos_ids = frozenset()  # lengths are the workload's, not the random model's
        return backend
    from vllm.platforms import current_platform

    from jet.workers.inference.vllm import VLLMBackend

    return VLLMBackend(model_dir, device="cpu" if current_platform.is_cpu() else "cuda", dtype="float32",
                       gpu_memory_utilization=0.3, max_model_len=512, max_num_seqs=concurrency)


async def closed_loop(reqs: list[Request], concurrency: int, call) -> int:
    """`concurrency` callers, each awaiting `call(request)` (-> tokens generated) on the next request."""
    queue, total = list(reversed(reqs)), [0]

    async def caller() -> None:
        while queue:
            tokens = await call(queue.pop())
            total[0] += tokens

    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(caller)
    return total[0]


async def direct(backend, reqs: list[Request], concurrency: int) -> int:
    async def call(r: Request) -> int:
        return len((await backend.agenerate_one(r.prompt, params_of(r))).token_ids)

    return await closed_loop(reqs, concurrency, call)


async def batch_synchronous(backend, reqs: list[Request], concurrency: int) -> int:
    total = 0
    for i in range(0, len(reqs), concurrency):
        batch = reqs[i:i + concurrency]
        outs = [0] * len(batch)

        async def one(k: int) -> None:
            outs[k] = len((await backend.agenerate_one(batch[k].prompt, params_of(batch[k]))).token_ids)

        async with anyio.create_task_group() as tg:
            for k in range(len(batch)):
                tg.start_soon(one, k)
        total += sum(outs)
    return total


@contextlib.asynccontextmanager
async def served(backend, url: str, model_dir: Path, tmp: Path, concurrency: int):
    """An inference worker (`jet.workers.inference.worker.run`, this process, this backend) and an LLM client session."""
    from jet.config import load as load_config
    from jet.keys import Keys
    from jet.llm import Tokenizers, open_client
    from jet.workers.inference import worker as infer

    run = f"rollout{uuid.uuid4().hex[:8]}"
    cfg = load_config({"run": run, "runs_dir": str(tmp / "runs"), "queues": {"block_ms": 100},
                       "models": [{"name": MODEL, "path": str(model_dir), "max_batch": concurrency,
                                   "max_inflight": concurrency}]})
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: infer.run(cfg, MODEL, url, stop, backend=backend, close_backend=False))
        async with open_client(url, Keys(run), Tokenizers({MODEL: str(model_dir)}), timeout_s=600) as client:
            llm = client.session("bench", MODEL)
            await llm.generate([5, 6], max_tokens=1)  # the worker is up
            yield llm
        stop.set()


async def through(llm, reqs: list[Request], concurrency: int) -> int:
    """The direct workload sent through the full path: client -> gen: stream -> worker -> reply."""
    async def call(r: Request) -> int:
        out = await llm.generate(r.prompt, max_tokens=r.max_tokens, temperature=1.0, seed=r.seed)
        llm.calls.clear()  # the session records calls for training; a benchmark keeps none
        return len(out.token_ids)

    return await closed_loop(reqs, concurrency, call)


async def timed(coro) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = await coro
    return tokens, time.perf_counter() - t0


def comparison(backend: str, name: str, measured: dict, baseline: dict) -> dict:
    return {"backend": backend, "comparison": name, "tokens_per_s": measured["tokens_per_s"],
            "baseline_tokens_per_s": baseline["tokens_per_s"],
            "ratio": round(measured["tokens_per_s"] / baseline["tokens_per_s"], 3), "goal": GOALS[name]}


def mode(tokens: int, seconds: float) -> dict:
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)}


async def measure_backend(kind: str, p: dict, model_dir: Path, url: str, tmp: Path, say) -> dict:
    """Every mode `repeats` times, interleaved (so load on a shared machine hits all alike); medians."""
    backend = await anyio.to_thread.run_sync(make_backend, kind, model_dir, p["concurrency"])
    c = p["concurrency"]
    reqs = workload(p["requests"], p["max_len"], p["prompt_len"], backend.vocab_size)
    runs: dict[str, list[dict]] = {"continuous": [], "batch_synchronous": [], "full_path": []}
    try:
        await direct(backend, reqs[:c], c)  # warm up (kernels, allocator)
        async with served(backend, url, model_dir, tmp, c) as llm:
            for rep in range(p["repeats"]):
                runs["continuous"].append(mode(*await timed(direct(backend, reqs, c))))
                runs["batch_synchronous"].append(mode(*await timed(batch_synchronous(backend, reqs, c))))
                runs["full_path"].append(mode(*await timed(through(llm, reqs, c))))
                say(f"{kind} run {rep + 1}/{p['repeats']}: " + ", ".join(
                    f"{m} {r[-1]['tokens_per_s']}" for m, r in runs.items()) + " tokens/s")
    finally:
        if hasattr(backend, "close"):
            backend.close()
    modes = {m: median(rs) for m, rs in runs.items()}
    return {"backend": kind, "modes": modes,
            "comparisons": [comparison(kind, "full_path_vs_direct", modes["full_path"], modes["continuous"]),
                            comparison(kind, "continuous_vs_batch_synchronous", modes["continuous"],
                                       modes["batch_synchronous"])]}


def median(rs: list[dict]) -> dict:
    ordered = sorted(rs, key=lambda r: r["tokens_per_s"])
    return {**ordered[len(ordered) // 2], "all_tokens_per_s": [r["tokens_per_s"] for r in rs]}


def table(report: dict):
    from rich.table import Table

    t = Table(title=f"jet bench rollout: {report['workload']}")
    for col in ("backend", "comparison", "tokens/s", "baseline tokens/s", "ratio", "goal"):
        t.add_column(col)
    for c in report["comparisons"]:
        t.add_row(c["backend"], c["comparison"], str(c["tokens_per_s"]), str(c["baseline_tokens_per_s"]),
                  f"{c['ratio']:.2f}", f">= {c['goal']}")
    return t


@click.command("rollout")
@click.option("--backend", "backends", type=click.Choice(["hf", "vllm", "all"]), default="all", show_default=True,
              help="'all': hf, and vllm where it is installed.")
@click.option("--requests", type=click.IntRange(min=1), default=None, help=f"Default {DEFAULTS['requests']}.")
@click.option("--concurrency", type=click.IntRange(min=1), default=None,
              help=f"Requests in flight (and the batch size of batch-synchronous). Default {DEFAULTS['concurrency']}.")
@click.option("--repeats", type=click.IntRange(min=1), default=None,
              help=f"Runs of every mode, interleaved; medians are reported. Default {DEFAULTS['repeats']}.")
@click.option("--quick", is_flag=True, help="A tiny workload (for tests).")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="Torch CPU threads (a tiny model gains nothing from more; a shared CPU loses a lot).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@redis_url_option
def cli(backends, requests, concurrency, repeats, quick, threads, as_json, redis_url) -> None:
    """Tokens/s: backend direct vs the full path, continuous vs batch-synchronous serving."""
    import torch

    torch.set_num_threads(threads)
    p = dict(QUICK if quick else DEFAULTS)
    p.update({k: v for k, v in {"requests": requests, "concurrency": concurrency, "repeats": repeats}.items() if v})
    kinds = ["hf", "vllm"] if backends == "all" else [backends]
    if backends == "all" and importlib.util.find_spec("vllm") is None:
        kinds = ["hf"]
    say = progress(as_json)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the report's
    with tempfile.TemporaryDirectory(prefix="jet-bench-rollout-") as tmp_name:
        tmp = Path(tmp_name)
        with server_url(redis_url, tmp / "server") as url:
            model_dir = bench_model(tmp / "model")
            results = [anyio.run(measure_backend, kind, p, model_dir, url, tmp, say) for kind in kinds]
    report = {"workload": (f"{p['requests']} requests, 4 x Pareto(1.2) lengths up to {p['max_len']}, "
                           f"{p['concurrency']} in flight"), "params": {**p, "threads": threads}, "backends": results,
              "comparisons": [c for r in results for c in r["comparisons"]]}
    emit(report, as_json, table)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        cli()
