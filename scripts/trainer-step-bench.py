"""Seconds of one trainer step's forward+backward on a real model, the trainer's layout against the old one;
with `--part optimizer`, its AdamW step against torch's per-tensor one; with `--part publish`, writing a
version (`jet.trainer.weights.write_weights`) against the same with every tensor copied out first.

    python scripts/trainer-step-bench.py MODEL_DIR [--threads 1] [--samples 32] [--budget 2048]
    python scripts/trainer-step-bench.py MODEL_DIR --part optimizer|publish [--repeats 6]

The workload is the `add` task's shape: linear samples of 40-50 prompt tokens and 24 completion tokens.
Baseline (measured in the same run): every sample packed back to back in rows of `--budget` tokens
under a dense L x L tree mask, logits at every position (the trainer before padded batches). Now: the
trainer's own `pack(..., batch_linear=True)` and `row_logprobs` (right-padded batches, causal
attention, logits only where a trained token is predicted). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--part", choices=["step", "optimizer", "publish"], default="step")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    if a.part != "step":
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
        print(json.dumps({"model": a.model, "threads": a.threads, **(optimizer if a.part == "optimizer" else publish)(
            model, a.repeats)}))
        return

    from jet.timeline import Call, merge_calls
    from jet.trainer.losses import token_logprobs
    from jet.trainer.packing import pack, row_logprobs

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).train()
    rng = random.Random(0)
    hi = min(40000, model.config.vocab_size)  # token ids of a real model's ordinary range, within any vocabulary
    lo = min(1000, hi // 2)
    samples = []
    for i in range(a.samples):
        prompt = [rng.randrange(lo, hi) for _ in range(40 + rng.randint(0, 10))]
        completion = [rng.randrange(lo, hi) for _ in range(24)]
        samples += merge_calls([Call(prompt, completion, [-1.0] * 24, 0, "m", temperature=1.0)], "exact",
                               episode_id=f"e{i}", reward=1.0)

    def old_step(rows):
        for r in rows:
            mask = None if r.causal else r.attention_mask(torch.float32)
            logits = model(input_ids=r.input_ids, position_ids=r.position_ids, attention_mask=mask,
                           use_cache=False).logits.float()
            (token_logprobs(logits, r.input_ids, r.parent_index) * r.loss_mask).sum().backward()

    def new_step(rows):
        for r in rows:
            (row_logprobs(model, r) * r.loss_mask).sum().backward()

    layouts = {"packed rows, dense mask, every logit (before)": (old_step, pack(samples, a.budget)),
               "padded batches, trained logits only (now)": (new_step, pack(samples, a.budget, batch_linear=True))}
    out = {"model": a.model, "threads": a.threads, "samples": a.samples, "budget": a.budget, "layouts": {}}
    for _ in range(a.repeats):  # alternating, after one warm-up step each
        for name, (step, rows) in layouts.items():
            model.zero_grad()
            step(rows)
            model.zero_grad()
            t = time.perf_counter()
            step(rows)
            entry = out["layouts"].setdefault(name, {"shapes": [list(r.input_ids.shape) for r in rows],
                                                     "seconds": []})
            entry["seconds"].append(time.perf_counter() - t)
    before, now = (min(v["seconds"]) for v in out["layouts"].values())
    out["speedup"] = round(before / now, 2)  # of the unrounded times: a tiny model's step rounds to 0
    for v in out["layouts"].values():
        v["seconds"] = [round(x, 3) for x in v["seconds"]]
    print(json.dumps(out))


def alternate(sides: dict, repeats: int) -> dict:
    """Each side's seconds, the sides alternating (the first call of each a warm-up), and before/now."""
    for fn in sides.values():
        fn()
    seconds = {name: [] for name in sides}
    for i in range(repeats):
        for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            t = time.perf_counter()
            sides[name]()
            seconds[name].append(time.perf_counter() - t)
    before, now = (sorted(v)[len(v) // 2] for v in seconds.values())  # unrounded: a tiny model's step rounds to 0
    return {"seconds": {k: [round(x, 3) for x in v] for k, v in seconds.items()}, "median_ratio": round(before / now, 2)}


def optimizer(model, repeats: int) -> dict:
    """torch's AdamW as a CPU gets it by default (a loop over tensors) against the trainer's (`make_adamw`)."""
    from jet.config import TrainerConfig
    from jet.trainer.optim import make_adamw

    cfg, params = TrainerConfig(), list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    plain, trainer = make_adamw(params, cfg, fused=False), make_adamw(params, cfg)
    return {"fused": trainer.param_groups[0]["fused"],
            **alternate({"per-tensor AdamW (before)": plain.step, "the trainer's AdamW (now)": trainer.step}, repeats)}


def publish(model, repeats: int) -> dict:
    """`write_weights` as the trainer runs it, against the same with every tensor copied out first (before)."""
    import tempfile
    from pathlib import Path

    from jet.trainer import weights

    whole = weights.whole_storage
    folder = Path(tempfile.mkdtemp())

    def write(copy: bool):
        weights.whole_storage = (lambda t: False) if copy else whole
        try:
            weights.write_weights(model, folder / ("copy" if copy else "now"))
        finally:
            weights.whole_storage = whole

    try:
        return alternate({"every tensor copied (before)": lambda: write(True),
                          "whole-storage tensors as they are (now)": lambda: write(False)}, repeats)
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
