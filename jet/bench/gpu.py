"""`jet bench gpu`: the device check. Generation and training throughput on a model of a real shape.

What it runs, on one device, in this order:
1. the hf inference backend (`jet.workers.inference.hf`, KV cache, bf16)
   generating `--batch` completions of `--new-tokens` tokens at temperature
   1.0 / top_p 0.9 (the nucleus path): generated tokens per second;
2. optimiser steps of the torch training backend (`trainer.dtype: bfloat16`,
   autocast over float32 master weights) on synthetic GRPO groups, packed by
   `--row-tokens`, through the trainer's own `prepare` / `train_step`;
3. the same steps on DeepSpeed ZeRO-2 in one process, its process group on
   nccl (gloo with --cpu), the rows and plan going through
   `jet.trainer.dist.Comm` as in `jet train` (collectives on the group's
   device: a rank's GPU under nccl, the CPU under gloo).
Each training phase prints tokens/s and the model-FLOPs utilisation:
tokens/s x (6 N + 12 L d T) / peak, with N the parameters that do matmuls
(the input embedding excluded, a tied LM head counted), L layers, d hidden
size, T the mean packed row length (PaLM's accounting, attention counted
dense), and the peak the device's dense bf16 rate (`--peak-tflops`; known
for H100/H200/A100, else not printed).

The default shape is Qwen2-0.5B's (hidden 896, 24 layers, 14 heads, 2 KV
heads, intermediate 4864, vocabulary 151936, tied embeddings), randomly
initialised and saved as bf16 safetensors: no hub access is needed.
`--cpu` runs the same three phases on the CPU with a tiny shape, which is
how the test suite runs this module (`tests/bench/test_gpu.py`).
`scripts/gpu-check.sh` installs what a bare GPU machine lacks and runs it.

What it is not: a benchmark with a baseline ratio (it measures a device
against its own peak), or part of any role: it imports both
`jet.workers` and `jet.trainer`, which only the top floor may.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from pathlib import Path

import click

from jet.bench import emit, progress

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                 tie_word_embeddings=True)
CPU_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=True)
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}  # dense, SXM


def build_model(folder: Path, shape: dict, device: str) -> Path:
    """A randomly initialised Qwen2 of `shape`, saved as bf16 safetensors in `folder`."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    vocab = shape["vocab_size"]
    config = Qwen2Config(**shape, bos_token_id=0, eos_token_id=vocab - 1, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=vocab - 1, pad_token_id=0)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def matmul_params(shape: dict) -> int:
    """Parameters that take part in a matmul per token: every layer's, the final norm's and the LM head."""
    h, i, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h  # q(+bias), k, v (+bias), o, mlp, norms
    return L * per_layer + h + h * shape["vocab_size"]


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def generation(model_dir: Path, device: str, batch: int, prompt_len: int, new_tokens: int) -> dict:
    import torch

    from jet.workers.inference.backend import SamplingParams
    from jet.workers.inference.hf import HFBackend

    backend = HFBackend(model_dir, device=device, dtype="bfloat16")
    rng = torch.Generator().manual_seed(1)
    vocab = backend.vocab_size - 1  # the last id is EOS: prompts avoid it
    prompts = [torch.randint(1, vocab, (prompt_len,), generator=rng).tolist() for _ in range(batch)]
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=new_tokens, seed=i) for i in range(batch)]
    backend.generate(prompts[:2], [SamplingParams(max_tokens=4, seed=0)] * 2)  # warm-up: kernels, allocator
    synchronize(device)
    t0 = time.perf_counter()
    outs = backend.generate(prompts, params)
    synchronize(device)
    seconds = time.perf_counter() - t0
    errors = [o.error for o in outs if o.finish_reason == "error"]
    if errors:
        raise click.ClickException(f"generation failed: {errors[0]}")
    tokens = sum(len(o.token_ids) for o in outs)
    del backend
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
            "batch": batch, "prompt_len": prompt_len}


def synthetic_groups(vocab: int, groups: int, size: int, prompt_len: int, completion_len: int):
    """GRPO groups of one-call episodes with random tokens and alternating rewards (real wire types)."""
    import random

    from jet.timeline import Call, merge_calls
    from jet.wire import Trajectory

    rng = random.Random(2)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(1, vocab - 1) for _ in range(prompt_len)]
        members = []
        for i in range(size):
            completion = [rng.randrange(1, vocab - 1) for _ in range(completion_len)]
            call = Call(prompt, completion, [-5.0] * completion_len, 0, "gpu-check", "main", temperature=1.0,
                        top_p=0.9)
            samples = merge_calls([call], "exact", episode_id=f"{g}-{i}", reward=float(i % 2))
            members.append(Trajectory(task="t", group_id=str(g), index=i, episode_id=f"{g}-{i}", model="gpu-check",
                                      reward=float(i % 2), samples=tuple(samples), group_size=size))
        out.append(members)
    return out


def training(kind: str, model_dir: Path, shape: dict, device: str, row_tokens: int, steps: int,
             peak_tflops: float | None) -> dict:
    """`steps` timed optimiser steps (after one warm-up) of backend `kind` ('torch' or 'deepspeed')."""
    import torch

    from jet.config import TrainerConfig
    from jet.trainer.dist import Comm, Plan
    from jet.trainer.guard import prepare

    tc = TrainerConfig.of(lr=1e-5, micro_batch_tokens=row_tokens, device=device, dtype="bfloat16", zero_stage=2,
                       backend=kind, kl_coef=0.0, grad_clip=1.0)
    completion = max(8, row_tokens // 16)
    prompt = max(8, row_tokens // 16)
    per_row = row_tokens // (prompt + completion)
    groups = synthetic_groups(shape["vocab_size"], groups=max(1, per_row), size=4, prompt_len=prompt,
                              completion_len=completion)
    inputs, rows = prepare(groups, tc)
    if kind == "torch":
        from jet.trainer.backend_torch import TorchBackend

        comm, engine = Comm(), TorchBackend(str(model_dir), tc, device)
    else:
        from jet.trainer.backend_deepspeed import DeepSpeedBackend, init_distributed

        for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
            os.environ.setdefault(k, v)
        if "MASTER_PORT" not in os.environ:
            from jet.queues.server import free_port

            os.environ["MASTER_PORT"] = str(free_port())
        comm = init_distributed(device)
        engine = DeepSpeedBackend(str(model_dir), tc, comm, device)

    def step() -> float:
        plan = comm.share_plan(Plan(step=0, lr=tc.lr))
        step_rows, step_inputs = comm.share(rows, inputs)
        stats = engine.train_step(comm.mine(step_rows), step_inputs, plan.lr, pad_row=step_rows[0])
        return stats.row_tokens

    step()  # warm-up: kernels, optimiser state
    synchronize(device)
    t0 = time.perf_counter()
    tokens = sum(step() for _ in range(steps))
    synchronize(device)
    seconds = time.perf_counter() - t0
    row_len = tokens / steps / len(rows)
    flops_per_token = 6 * matmul_params(shape) + 12 * shape["num_hidden_layers"] * shape["hidden_size"] * row_len
    out = {"backend": kind, "steps": steps, "rows_per_step": len(rows), "tokens": int(tokens),
           "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
           "tflops": round(tokens / seconds * flops_per_token / 1e12, 2)}
    if peak_tflops:
        out["mfu"] = round(out["tflops"] / peak_tflops, 4)
    if device.startswith("cuda"):
        out["max_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del engine
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def device_peak(device: str, given: float | None) -> tuple[str, float | None]:
    import torch

    if not device.startswith("cuda"):
        return "cpu", given
    name = torch.cuda.get_device_name()
    known = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    return name, given or known


def table(report: dict):
    from rich.table import Table

    t = Table(title=f"jet bench gpu: {report['device']} ({report['params'] / 1e6:.1f}M params, bf16)")
    for col in ("phase", "tokens", "seconds", "tokens/s", "TFLOP/s", "MFU"):
        t.add_column(col, justify="right" if col != "phase" else "left")
    g = report["generate"]
    t.add_row(f"generate (hf, batch {g['batch']})", str(g["tokens"]), str(g["seconds"]), str(g["tokens_per_s"]),
              "", "")
    for r in report["train"]:
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "n/a"
        t.add_row(f"train ({r['backend']})", str(r["tokens"]), str(r["seconds"]), str(r["tokens_per_s"]),
                  str(r["tflops"]), mfu)
    return t


@click.command("gpu")
@click.option("--cpu", "on_cpu", is_flag=True, help="Tiny shape on the CPU (gloo): the same code paths, for tests.")
@click.option("--device", default="cuda", show_default=True, help="Torch device (ignored with --cpu).")
@click.option("--batch", type=click.IntRange(min=1), default=32, show_default=True, help="Prompts generated at once.")
@click.option("--new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--row-tokens", type=click.IntRange(min=64), default=4096, show_default=True,
              help="trainer.micro_batch_tokens of the training phases.")
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True, help="Timed steps per backend.")
@click.option("--backends", default="torch,deepspeed", show_default=True, help="Training backends to run.")
@click.option("--peak-tflops", type=float, default=None, help="Dense bf16 peak for MFU (default: known GPUs).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def cli(on_cpu, device, batch, new_tokens, row_tokens, steps, backends, peak_tflops, as_json) -> None:
    """Generation and training tokens/s and MFU on one device, Qwen2-0.5B shape, bf16."""
    say = progress(as_json)
    shape, device = (CPU_SHAPE, "cpu") if on_cpu else (QWEN2_05B, device)
    if on_cpu:
        batch, new_tokens, row_tokens = min(batch, 4), min(new_tokens, 16), min(row_tokens, 256)
    name, peak = device_peak(device, peak_tflops)
    report: dict = {"device": name, "params": matmul_params(shape), "peak_tflops": peak, "train": []}
    with tempfile.TemporaryDirectory(prefix="jet-gpu-check-") as tmp:
        say(f"building a random model of {report['params'] / 1e6:.1f}M matmul parameters on {name}")
        model_dir = build_model(Path(tmp) / "model", shape, device)
        say("generating with the hf backend")
        report["generate"] = generation(model_dir, device, batch, 32 if on_cpu else 256, new_tokens)
        for kind in [b.strip() for b in backends.split(",") if b.strip()]:
            if kind not in ("torch", "deepspeed"):
                raise click.BadParameter(f"unknown backend {kind!r}", param_hint="--backends")
            say(f"training with the {kind} backend")
            report["train"].append(training(kind, model_dir, shape, device, row_tokens, steps, peak))
    emit(report, as_json, table)
