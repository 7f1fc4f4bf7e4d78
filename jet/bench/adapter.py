"""`jet bench adapter`: a LoRA adapter (`models[].adapter`) against full training on the same model and batch.

What it is: one process, no clock games. The same synthetic step (GRPO groups of multi-turn episodes of
random token ids shaped like the tally task: a shared prompt per group, several short turns) trained by
the trainer's own `TorchBackend`, full and with an adapter, alternating which goes first in each repeat;
each side's step time is the wall time of `train_step` after one warm-up step. Then what each side
writes: a published version (`jet.trainer.weights.write_version`) and a checkpoint (`save`), in bytes;
and the adapter's path through Redis (`jet.queues.blobs`, an embedded server): `put` by the trainer,
then `fetch` plus `HFBackend.load_weights` (hash check and merge) by an inference backend, the part of
"announced to serving" that depends on the version's size.

Reported: parameter counts, step seconds per side per repeat with the mean ratio adapter / full and
its 95% t interval, bytes per version and per checkpoint with their ratios, and the Redis path's
seconds (put; fetch + load) per repeat.

What it is not: a learning benchmark (`jet bench trl` trains), nor a measure of a worker process's
reaction time (the follower's XREAD block adds up to its wake-up; `tests/workers/inference/
test_weights_redis.py` prints that on the tiny model).
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import click

from jet.bench import emit, progress, server_url


def synthetic_groups(vocab: int, groups: int, size: int, prompt: int, turns: int, completion: int, reply: int,
                     seed: int = 0):
    """GRPO groups of multi-turn episodes of random ids: each group one prompt, each turn a completion and
    an environment reply; rewards 0/1 with both in every group."""
    from jet.timeline import Call, merge_calls
    from jet.wire import Trajectory

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        shared = [rng.randrange(vocab) for _ in range(prompt)]
        members = []
        for i in range(size):
            ids, calls = list(shared), []
            for _ in range(turns):
                done = [rng.randrange(vocab) for _ in range(completion)]
                calls.append(Call(tuple(ids), tuple(done), [-2.0] * len(done), 0, "policy", "main"))
                ids += done + [rng.randrange(vocab) for _ in range(reply)]
            reward = float(i % 2)
            samples = merge_calls(calls, "exact", episode_id=f"g{g}-{i}", reward=reward)
            members.append(Trajectory(task="bench", group_id=f"g{g}", index=i, episode_id=f"g{g}-{i}", model="policy",
                                      reward=reward, samples=tuple(samples), group_size=size))
        out.append(members)
    return out


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def run(model: str, r: int, alpha: float, targets: str, p: dict, repeats: int, threads: int | None, say) -> dict:
    import torch

    from jet.adapters import FILES
    from jet.bench.trl import mean_interval
    from jet.config import AdapterConfig, TrainerConfig
    from jet.keys import Keys
    from jet.queues import blobs
    from jet.queues.connect import connect
    from jet.trainer.backend_torch import TorchBackend
    from jet.trainer.guard import prepare
    from jet.trainer.weights import write_version
    from jet.workers.inference.hf import HFBackend

    if threads:
        torch.set_num_threads(threads)
    cfg = TrainerConfig(lr=1e-5, micro_batch_tokens=p["micro_batch_tokens"])
    adapter = AdapterConfig(r=r, alpha=alpha, target_modules="all-linear" if targets == "all-linear"
                            else [t.strip() for t in targets.split(",")])
    say(f"loading {model} twice: full training and an adapter (r {r}, alpha {alpha}, {targets})")
    sides = {"full": TorchBackend(model, cfg), "adapter": TorchBackend(model, cfg, adapter=adapter)}
    vocab = sides["full"].model.config.vocab_size
    groups = synthetic_groups(vocab, p["groups"], p["group_size"], p["prompt"], p["turns"], p["completion"], p["reply"])
    inputs, rows = prepare(groups, cfg)
    params = {name: {"trainable": sum(x.numel() for x in b.params),
                     "total": sum(x.numel() for x in b.model.parameters())} for name, b in sides.items()}
    for name, b in sides.items():
        say(f"{name}: warm-up step")
        b.train_step(rows, inputs, lr=cfg.lr)
    seconds = {"full": [], "adapter": []}
    for k in range(repeats):
        order = ["full", "adapter"] if k % 2 == 0 else ["adapter", "full"]
        for name in order:
            t0 = time.perf_counter()
            stats = sides[name].train_step(rows, inputs, lr=cfg.lr)
            seconds[name].append(time.perf_counter() - t0)
            say(f"repeat {k + 1} {name}: {seconds[name][-1]:.2f} s ({stats.forward_tokens} tokens forwarded)")
    ratios = [a / f for a, f in zip(seconds["adapter"], seconds["full"])]

    with tempfile.TemporaryDirectory(prefix="jet-bench-adapter-") as tmp:
        tmp = Path(tmp)
        written = {}
        for name, b in sides.items():
            with b.full_module() as module:
                sha = write_version(module, tmp / name / "v1")
            (tmp / name / "ckpt").mkdir()
            b.save(tmp / name / "ckpt")
            written[name] = {"version_bytes": folder_bytes(tmp / name / "v1"), "checkpoint_bytes": folder_bytes(tmp / name / "ckpt"),
                             "sha": sha}
        say("the adapter through Redis: put, then fetch + load into an inference backend")
        worker = HFBackend(model)
        redis_s = []
        with server_url(None, tmp / "server") as url:
            import anyio

            async def once(version: int) -> dict:
                client = await connect(url)
                try:
                    keys = Keys("bench-adapter")
                    t0 = time.perf_counter()
                    first, n = await blobs.put(client, keys, "policy", version, tmp / "adapter" / "v1", FILES)
                    t1 = time.perf_counter()
                    out = await blobs.fetch(client, keys, "policy", version, first, n, tmp / "fetched" / f"v{version}")
                    worker.load_weights(out, written["adapter"]["sha"], version)
                    t2 = time.perf_counter()
                    return {"chunks": n, "put_s": t1 - t0, "fetch_and_load_s": t2 - t1}
                finally:
                    await client.aclose()

            for version in range(1, repeats + 1):
                redis_s.append(anyio.run(once, version))
    full, lora = written["full"], written["adapter"]
    return {
        "model": model, "adapter": adapter.model_dump(mode="json"), "workload": p, "threads": torch.get_num_threads(),
        "forward_tokens_per_step": int(sum(row.n_real for row in rows)), "params": params,
        "step_s": seconds, "step_ratio_adapter_over_full": mean_interval(ratios), "ratios": ratios,
        "version_bytes": {"full": full["version_bytes"], "adapter": lora["version_bytes"],
                          "fraction": lora["version_bytes"] / full["version_bytes"]},
        "checkpoint_bytes": {"full": full["checkpoint_bytes"], "adapter": lora["checkpoint_bytes"],
                             "fraction": lora["checkpoint_bytes"] / full["checkpoint_bytes"]},
        "redis": redis_s,
    }


def table(report: dict):
    from rich.table import Table

    t = Table(title=f"LoRA adapter vs full training: {report['model']} ({report['threads']} threads)")
    t.add_column("")
    t.add_column("full", justify="right")
    t.add_column("adapter", justify="right")
    t.add_column("adapter / full", justify="right")
    pa, pf = report["params"]["adapter"], report["params"]["full"]
    t.add_row("trainable parameters", f"{pf['trainable']:,}", f"{pa['trainable']:,}", f"{pa['trainable'] / pf['trainable']:.4f}")
    s = report["step_s"]
    ci = report["step_ratio_adapter_over_full"]
    interval = f" [{ci['ci95'][0]:.2f}, {ci['ci95'][1]:.2f}]" if ci["ci95"] else ""
    t.add_row("step seconds (mean)", f"{sum(s['full']) / len(s['full']):.2f}", f"{sum(s['adapter']) / len(s['adapter']):.2f}",
              f"{ci['mean']:.2f}{interval}")
    for key, label in (("version_bytes", "bytes per published version"), ("checkpoint_bytes", "bytes per checkpoint")):
        v = report[key]
        t.add_row(label, f"{v['full']:,}", f"{v['adapter']:,}", f"1/{1 / v['fraction']:.1f}")
    worst = max(x["fetch_and_load_s"] for x in report["redis"])
    t.add_row("Redis: fetch + load of a version (worst)", "", f"{worst:.2f} s", "")
    return t


@click.command()
@click.option("--model", "model_spec", default=None, help="HF model folder (default: SmolLM2-135M-Instruct, converted once).")
@click.option("--cache", default="~/.cache/jet-bench/smollm2", show_default=True, help="Where the default model goes.")
@click.option("--r", "rank", type=click.IntRange(1), default=16, show_default=True, help="LoRA rank.")
@click.option("--alpha", type=float, default=32.0, show_default=True)
@click.option("--targets", default="all-linear", show_default=True, help="'all-linear' or comma-separated module names.")
@click.option("--groups", type=click.IntRange(1), default=4, show_default=True)
@click.option("--group-size", type=click.IntRange(2), default=8, show_default=True)
@click.option("--prompt", type=click.IntRange(1), default=330, show_default=True, help="Shared prompt tokens per group.")
@click.option("--turns", type=click.IntRange(1), default=4, show_default=True)
@click.option("--repeats", type=click.IntRange(2), default=3, show_default=True)
@click.option("--threads", type=click.IntRange(1), default=None, help="torch threads (default: torch's).")
@click.option("--quick", is_flag=True, help="A small workload (tests).")
@click.option("--json", "as_json", is_flag=True)
def cli(model_spec, cache, rank, alpha, targets, groups, group_size, prompt, turns, repeats, threads, quick, as_json):
    """A LoRA adapter against full training: step time, bytes per version and checkpoint, the Redis path."""
    say = progress(as_json)
    if model_spec is None:
        from jet.bench.trl import default_model

        model_spec = str(default_model(Path(cache).expanduser()))
    p = {"groups": groups, "group_size": group_size, "prompt": prompt, "turns": turns, "completion": 12, "reply": 8,
         "micro_batch_tokens": 8192}
    if quick:
        p.update(groups=2, group_size=2, prompt=16, turns=2, completion=4, reply=2, micro_batch_tokens=256)
    report = run(model_spec, rank, alpha, targets, p, repeats, threads, say)
    emit(report, as_json, table)
