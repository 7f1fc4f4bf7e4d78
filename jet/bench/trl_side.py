"""The TRL side of `jet bench trl`: `GRPOTrainer` on the `add` task until a wall-clock deadline.

Run as `python -P -m jet.bench.trl_side --args-json '{...}'` by jet/bench/trl.py, in an interpreter
that has trl (the `compare` extra, usually its own venv). The arguments are the bench's settings
plus `model` (a folder), `out` (a folder) and `t0` (the epoch second the parent launched this
process: the budget counts from it). It trains the model on `jet.tasks.add` rows, prompts
`messages(row)` in conversational form (TRL renders them with the model's chat template, as Jet's
env worker does), reward `score(row, reply)`, with the settings mapped onto GRPOConfig below;
a callback stops training after the first step that ends past the budget. It writes
`<out>/model` (the trained weights, with the base model's tokenizer files, so `jet eval` loads it
like the base) and `<out>/history.json` (one row per optimiser step: its end time since launch,
mean reward, trajectories and completion tokens).

What it is not: imported by anything else in the package; only this module needs trl.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

# One optimiser step per generation batch, on-policy: per_device_train_batch_size = groups x group size,
# no gradient accumulation, num_iterations 1. With one process and no accumulation, "bnpo" (sum over
# the batch's completion tokens / their count) and "dapo" (the same over the whole generation batch)
# are both Jet's token_mean; "dapo" stays equal to it if accumulation is ever added, so it is the one.
LOSS_TYPE = "dapo"


def grpo_config(a: dict):
    from trl import GRPOConfig

    G, B = a["group_size"], a["batch_groups"]
    adam = a["adam"]
    return GRPOConfig(
        output_dir=str(Path(a["out"]) / "trainer"), seed=a["seed"], data_seed=a["seed"],
        learning_rate=a["lr"], lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=adam["betas"][0], adam_beta2=adam["betas"][1], adam_epsilon=adam["eps"],
        weight_decay=adam["weight_decay"], max_grad_norm=a["grad_clip"], optim="adamw_torch",
        per_device_train_batch_size=G * B, gradient_accumulation_steps=1, num_generations=G,
        num_iterations=1, max_completion_length=a["max_tokens"], temperature=a["temperature"],
        top_p=1.0, top_k=0, beta=0.0, epsilon=a["clip_eps"], loss_type=LOSS_TYPE, scale_rewards="group",
        mask_truncated_completions=False, max_steps=1_000_000, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=a["device"] == "cpu", bf16=False, fp16=False, dataloader_num_workers=0,
        disable_tqdm=True, log_completions=False,
        gradient_checkpointing=False,  # TRL's default recomputes activations; Jet's trainer does not
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--args-json", required=True)
    a = json.loads(parser.parse_args().args_json)
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from jet.tasks import add

    torch.set_num_threads(a["threads"]["trl"])
    t0, deadline = a["t0"], a["t0"] + a["budget_s"]
    rows = add.rows(20_000, a["seed"])
    dataset = Dataset.from_list([{"prompt": add.messages(r), "answer": r["answer"]} for r in rows])

    def reward(completions, answer, **_):
        return [add.score({"answer": x}, c[-1]["content"] if isinstance(c, list) else c)
                for c, x in zip(completions, answer)]

    steps: list[dict] = []

    class Clock(TrainerCallback):
        """Records each step's log row with its end time; stops after the first step past the deadline."""

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                n = a["group_size"] * a["batch_groups"]
                steps.append({"step": state.global_step, "t": time.time() - t0, "reward": float(logs["reward"]),
                              "trajectories": n, "tokens": float(logs["completions/mean_length"]) * n})

        def on_step_end(self, args, state, control, **kw):
            if time.time() >= deadline:
                control.should_training_stop = True
            return control

    tokenizer = AutoTokenizer.from_pretrained(a["model"])
    model = AutoModelForCausalLM.from_pretrained(a["model"], dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=grpo_config(a), train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    out = Path(a["out"]) / "model"
    trainer.model.save_pretrained(out, safe_serialization=True)
    for f in Path(a["model"]).iterdir():  # the base model's own tokenizer files: evaluated like the base
        if f.is_file() and f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy2(f, out / f.name)
    (Path(a["out"]) / "history.json").write_text(json.dumps(
        {"model": str(out), "trl_version": trl.__version__, "loss_type": LOSS_TYPE, "steps": steps}))


if __name__ == "__main__":
    main()
