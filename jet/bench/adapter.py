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
its 95% t interval, bytes per version and per checkpoint with their ratios, the Redis path's
seconds (put; fetch + load) per repeat, and, from a real inference worker process whose run folder is
its own (the announced path does not exist for it), the seconds from each version's announcement to
the first reply that carries it.

A team on one base (`--team N`, default 3): the resident memory of an inference backend serving N
adapter models of one base (`HFBackend(slots=N)`, what `jet worker infer --model a --model b ...`
loads) against one serving a single adapter model (merged, what a worker of one model loads: it also
keeps the base's own copy of the adapted layers), one serving the base alone (no adapter), and N
workers of one model (the layout without a shared base: N times the single one). Each is a fresh
process (`python -m jet.bench.adapter --child ...`) that loads the base and the adapters (its own
copy of each, read from the version folder) and decodes the same requests per model (the prompt,
requests and tokens of `--serve-*`), reporting its peak RSS (VmHWM) and decoding seconds; the
sides rotate order over `--repeats`.

What it is not: a learning benchmark (`jet bench trl --arms jet,jet-lora` trains).
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


def adapter_version(model: str, adapter, p: dict, folder: Path, say) -> Path:
    """An adapter version of `model` after one training step on the synthetic workload (for `--team-only`)."""
    from jet.config import TrainerConfig
    from jet.trainer.backend_torch import TorchBackend
    from jet.trainer.guard import prepare
    from jet.trainer.weights import write_version

    say(f"an adapter of {model}: one training step")
    cfg = TrainerConfig(lr=1e-3, micro_batch_tokens=p["micro_batch_tokens"])
    b = TorchBackend(model, cfg, adapter=adapter)
    groups = synthetic_groups(b.model.config.vocab_size, p["groups"], p["group_size"], p["prompt"], p["turns"],
                              p["completion"], p["reply"])
    inputs, rows = prepare(groups, cfg)
    b.train_step(rows, inputs, lr=cfg.lr)
    with b.full_module() as module:
        write_version(module, folder)
    return folder


def run(model: str, r: int, alpha: float, targets: str, p: dict, repeats: int, threads: int | None, say,
        team_n: int = 0, team_p: dict | None = None, team_only: bool = False) -> dict:
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
    if team_only:
        with tempfile.TemporaryDirectory(prefix="jet-bench-adapter-") as tmp:
            folder = adapter_version(model, adapter, p, Path(tmp) / "v1", say)
            return {"model": model, "adapter": adapter.model_dump(mode="json"), "threads": torch.get_num_threads(),
                    "team": team(model, folder, team_n, team_p, repeats, threads, say)}
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
        del worker
        say("a worker process with no shared folder: announcement to serving")
        serving = announce_to_serving(model, tmp / "adapter" / "v1", repeats, threads, r, say)
        team_report = team(model, tmp / "adapter" / "v1", team_n, team_p, repeats, threads, say) if team_n else None
    full, lora = written["full"], written["adapter"]
    return {
        "model": model, "adapter": adapter.model_dump(mode="json"), "workload": p, "threads": torch.get_num_threads(),
        "forward_tokens_per_step": int(sum(row.n_real for row in rows)), "params": params,
        "step_s": seconds, "step_ratio_adapter_over_full": mean_interval(ratios), "ratios": ratios,
        "version_bytes": {"full": full["version_bytes"], "adapter": lora["version_bytes"],
                          "fraction": lora["version_bytes"] / full["version_bytes"]},
        "checkpoint_bytes": {"full": full["checkpoint_bytes"], "adapter": lora["checkpoint_bytes"],
                             "fraction": lora["checkpoint_bytes"] / full["checkpoint_bytes"]},
        "redis": redis_s, "announce_to_serving": serving, "team": team_report,
    }


def announce_to_serving(model: str, adapter_folder: Path, versions: int, threads: int | None, r: int, say) -> dict:
    """Seconds from a version's announcement to the first reply carrying it, from a real inference worker
    process that shares no folder with the "trainer": its config's run folder is its own, and the
    announced path does not exist, so every version comes through Redis (`jet.queues.blobs`)."""
    import os
    import subprocess
    import sys

    import anyio
    import yaml

    from jet.adapters import FILES
    from jet.keys import Keys
    from jet.llm import Tokenizers, open_client
    from jet.queues import blobs
    from jet.queues.connect import connect
    from jet.wire import WeightVersion, file_sha256

    with tempfile.TemporaryDirectory(prefix="jet-bench-serve-") as tmp:
        tmp = Path(tmp)
        keys = Keys("bench-adapter-serve")
        cfg = tmp / "worker" / "config.yaml"
        cfg.parent.mkdir()
        cfg.write_text(yaml.safe_dump({"run": keys.run, "runs_dir": str(tmp / "worker" / "runs"),
                                       "queues": {"block_ms": 200},
                                       "models": [{"name": "policy", "path": model, "adapter": {"r": r}}]}))
        sha = file_sha256(adapter_folder / FILES[1])
        with server_url(None, tmp / "server") as url:
            env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}), "JET_LOG_LEVEL": "INFO"}
            log = open(tmp / "worker.log", "w")
            worker = subprocess.Popen([sys.executable, "-m", "jet.workers.inference.worker", "--config", str(cfg),
                                       "--redis-url", url], env=env, stdout=log, stderr=subprocess.STDOUT)

            async def go() -> list[dict]:
                r = await connect(url)
                out = []
                try:
                    async with open_client(url, keys, Tokenizers({"policy": model}), timeout_s=600) as client:
                        llm = client.session("bench", "policy")
                        await llm.generate([1, 2, 3], max_tokens=1, temperature=0)  # serving: the base
                        say("worker serving; announcing adapter versions")
                        for v in range(1, versions + 1):
                            first, n = await blobs.put(r, keys, "policy", v, adapter_folder, FILES)
                            w = WeightVersion("policy", v, str(tmp / "trainer-only" / f"v{v}"), sha, v, blob=first,
                                              blob_chunks=n)
                            t0 = time.perf_counter()
                            await r.xadd(keys.weights("policy"), w.to_fields())
                            polls = 0
                            while (await llm.generate([1, 2, 3], max_tokens=1, temperature=0)).version != v:
                                polls += 1
                            out.append({"version": v, "chunks": n, "seconds": time.perf_counter() - t0,
                                        "polls": polls})
                            say(f"version {v}: served {out[-1]['seconds']:.2f} s after its announcement")
                finally:
                    await r.aclose()
                return out

            try:
                served = anyio.run(go)
            finally:
                worker.terminate()
                worker.wait(timeout=60)
                log.close()
        if worker.returncode not in (0, -15):
            raise click.ClickException(f"the worker failed:\n{(tmp / 'worker.log').read_text()[-3000:]}")
    return {"versions": served, "note": "announcement XADD to the first reply naming the version; the worker's "
                                        "weights follower blocks on XREAD (wakes at once), fetches the chunks, checks "
                                        "and merges them; replies poll with 1-token requests"}


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM: of its own address space, which getrusage's ru_maxrss
    is not: Linux carries that over exec from the parent that forked it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def serve_child(model: str, adapter_folder: str, slots: int, requests: int, prompt: int, tokens: int,
                threads: int | None) -> dict:
    """In a fresh process: load the base with `slots` adapter models (1: merged, as a one-model worker
    does; 0: the base alone, no adapter), decode `requests` requests per model, return peak RSS and seconds."""
    import torch

    from jet.workers.inference.backend import SamplingParams
    from jet.workers.inference.hf import HFBackend

    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    backend = HFBackend(model, slots=max(slots, 1))
    for slot in range(slots):
        backend.load_weights(adapter_folder, None, 1, slot=slot)
    loaded = time.perf_counter() - t0
    rng = random.Random(0)
    head = [rng.randrange(10, backend.vocab_size) for _ in range(prompt)]
    prompts, params, which = [], [], []
    for slot in range(max(slots, 1)):
        for i in range(requests):
            prompts.append(head + [rng.randrange(10, backend.vocab_size) for _ in range(8)])
            params.append(SamplingParams(temperature=1.0, max_tokens=tokens, seed=1000 * slot + i))
            which.append(slot)
    t1 = time.perf_counter()
    outs = backend.generate(prompts, params, which)
    decode = time.perf_counter() - t1
    assert all(o.finish_reason != "error" for o in outs), [o.error for o in outs if o.error]
    return {"slots": slots, "peak_rss_mib": peak_rss_mib(),
            "load_s": loaded, "decode_s": decode, "generated_tokens": sum(len(o.token_ids) for o in outs),
            "lora_mib": backend.adapters.nbytes() / 2**20 if slots > 1 else None}  # adapters held beside the base


def team(model: str, adapter_folder: Path, n: int, p: dict, repeats: int, threads: int | None, say) -> dict:
    """Peak RSS of one process serving `n` adapter models on one base, vs one serving one (fresh processes)."""
    import json
    import subprocess
    import sys

    from jet.bench.trl import mean_interval

    def child(slots: int) -> dict:
        argv = [sys.executable, "-m", "jet.bench.adapter", "--child", json.dumps(
            {"model": model, "adapter_folder": str(adapter_folder), "slots": slots, "requests": p["requests"],
             "prompt": p["prompt"], "tokens": p["tokens"], "threads": threads})]
        out = subprocess.run(argv, capture_output=True, text=True, check=False)
        if out.returncode:
            raise click.ClickException(f"the serving process ({slots} models) failed:\n{out.stderr[-3000:]}")
        got = json.loads(out.stdout.strip().splitlines()[-1])
        say(f"{slots} model(s) on one base: peak RSS {got['peak_rss_mib']:.0f} MiB, decoding {got['decode_s']:.1f} s")
        return got

    sides = {"base": 0, "one": 1, "shared": n}
    runs = {side: [] for side in sides}
    for k in range(repeats):
        order = list(sides)[k % 3:] + list(sides)[:k % 3]  # each side first, middle and last in turn
        for side in order:
            runs[side].append(child(sides[side]))
    ratios = [s["peak_rss_mib"] / o["peak_rss_mib"] for s, o in zip(runs["shared"], runs["one"])]
    over_base = [s["peak_rss_mib"] / o["peak_rss_mib"] for s, o in zip(runs["shared"], runs["base"])]
    return {"models": n, "workload": p, "runs": runs, "rss_ratio_shared_over_one": mean_interval(ratios),
            "ratios": ratios, "rss_ratio_shared_over_base": mean_interval(over_base), "ratios_over_base": over_base,
            "separate_workers_ratio": float(n),
            "note": f"'one': a worker of one adapter model (merged: it keeps the base's own copy of the adapted "
                    f"layers); 'base': the base alone, no adapter, one model's requests; 'shared': {n} adapter "
                    f"models on one base, each with its own requests; {n} workers of one model each hold {n} x "
                    f"'one'"}


def table(report: dict):
    from rich.table import Table

    t = Table(title=f"LoRA adapter vs full training: {report['model']} ({report['threads']} threads)")
    t.add_column("")
    t.add_column("full", justify="right")
    t.add_column("adapter", justify="right")
    t.add_column("adapter / full", justify="right")
    if "params" in report:  # not with --team-only
        pa, pf = report["params"]["adapter"], report["params"]["full"]
        t.add_row("trainable parameters", f"{pf['trainable']:,}", f"{pa['trainable']:,}",
                  f"{pa['trainable'] / pf['trainable']:.4f}")
        s = report["step_s"]
        ci = report["step_ratio_adapter_over_full"]
        interval = f" [{ci['ci95'][0]:.2f}, {ci['ci95'][1]:.2f}]" if ci["ci95"] else ""
        t.add_row("step seconds (mean)", f"{sum(s['full']) / len(s['full']):.2f}",
                  f"{sum(s['adapter']) / len(s['adapter']):.2f}", f"{ci['mean']:.2f}{interval}")
        for key, label in (("version_bytes", "bytes per published version"), ("checkpoint_bytes", "bytes per checkpoint")):
            v = report[key]
            t.add_row(label, f"{v['full']:,}", f"{v['adapter']:,}", f"1/{1 / v['fraction']:.1f}")
    if "redis" in report:
        worst = max(x["fetch_and_load_s"] for x in report["redis"])
        t.add_row("Redis: fetch + load of a version (worst)", "", f"{worst:.2f} s", "")
        worst = max(x["seconds"] for x in report["announce_to_serving"]["versions"])
        t.add_row("worker without a shared folder: announced to served (worst)", "", f"{worst:.2f} s", "")
    if report.get("team"):
        tm = report["team"]
        one = sum(r["peak_rss_mib"] for r in tm["runs"]["one"]) / len(tm["runs"]["one"])
        shared = sum(r["peak_rss_mib"] for r in tm["runs"]["shared"]) / len(tm["runs"]["shared"])
        ci = tm["rss_ratio_shared_over_one"]
        interval = f" [{ci['ci95'][0]:.2f}, {ci['ci95'][1]:.2f}]" if ci["ci95"] else ""
        t.add_row(f"peak RSS, 1 model | {tm['models']} on one base (MiB)", f"{one:,.0f}", f"{shared:,.0f}",
                  f"{ci['mean']:.2f}{interval}")
        t.add_row(f"peak RSS, {tm['models']} workers of one model (MiB)", f"{tm['models'] * one:,.0f}", "",
                  f"{tm['models']:.2f}")
        base = sum(r["peak_rss_mib"] for r in tm["runs"]["base"]) / len(tm["runs"]["base"])
        cb = tm["rss_ratio_shared_over_base"]
        t.add_row(f"peak RSS, the base alone | {tm['models']} on one base (MiB)", f"{base:,.0f}", f"{shared:,.0f}",
                  f"{cb['mean']:.2f}")
    return t


@click.command()
@click.option("--model", "model_spec", default="builtin:smollm2", show_default=True,
              help="HF model folder, Hub id, or builtin:smollm2 (SmolLM2-135M-Instruct, converted once).")
@click.option("--r", "rank", type=click.IntRange(1), default=16, show_default=True, help="LoRA rank.")
@click.option("--alpha", type=float, default=32.0, show_default=True)
@click.option("--targets", default="all-linear", show_default=True, help="'all-linear' or comma-separated module names.")
@click.option("--groups", type=click.IntRange(1), default=4, show_default=True)
@click.option("--group-size", type=click.IntRange(2), default=8, show_default=True)
@click.option("--prompt", type=click.IntRange(1), default=330, show_default=True, help="Shared prompt tokens per group.")
@click.option("--turns", type=click.IntRange(1), default=4, show_default=True)
@click.option("--repeats", type=click.IntRange(2), default=3, show_default=True)
@click.option("--threads", type=click.IntRange(1), default=None, help="torch threads (default: torch's).")
@click.option("--team", "team_n", type=click.IntRange(0), default=3, show_default=True,
              help="Models of one base served by one backend, against one model (peak RSS); 0: skip.")
@click.option("--team-only", is_flag=True, help="Only the team's memory (no training step times, bytes, Redis).")
@click.option("--serve-requests", type=click.IntRange(1), default=8, show_default=True,
              help="Team: requests decoded per model.")
@click.option("--serve-prompt", type=click.IntRange(1), default=330, show_default=True,
              help="Team: shared prompt tokens (plus 8 of each request's own).")
@click.option("--serve-tokens", type=click.IntRange(1), default=16, show_default=True,
              help="Team: tokens generated per request.")
@click.option("--quick", is_flag=True, help="A small workload (tests).")
@click.option("--json", "as_json", is_flag=True)
def cli(model_spec, rank, alpha, targets, groups, group_size, prompt, turns, repeats, threads, team_n, team_only,
        serve_requests, serve_prompt, serve_tokens, quick, as_json):
    """A LoRA adapter against full training: step time, bytes per version and checkpoint, the Redis path."""
    say = progress(as_json)
    from jet.sources import resolve_model

    model_spec = resolve_model(model_spec, "--model")
    p = {"groups": groups, "group_size": group_size, "prompt": prompt, "turns": turns, "completion": 12, "reply": 8,
         "micro_batch_tokens": 8192}
    team_p = {"requests": serve_requests, "prompt": serve_prompt, "tokens": serve_tokens}
    if quick:
        p.update(groups=2, group_size=2, prompt=16, turns=2, completion=4, reply=2, micro_batch_tokens=256)
        team_p.update(requests=2, prompt=16, tokens=4)
    if team_only and not team_n:
        raise click.BadParameter("--team-only needs --team N > 0", param_hint="--team")
    report = run(model_spec, rank, alpha, targets, p, repeats, threads, say, team_n, team_p, team_only)
    emit(report, as_json, table)


if __name__ == "__main__":  # one serving process of `team`
    import json
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "--child":
        raise SystemExit("usage: python -m jet.bench.adapter --child JSON (`jet bench adapter --team N` runs it)")
    print(json.dumps(serve_child(**json.loads(sys.argv[2]))))
