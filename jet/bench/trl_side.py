"""The TRL side of `jet bench trl`: `GRPOTrainer` on a built-in task until a wall-clock deadline.

Run as `python -P -m jet.bench.trl_side --args-json '{...}'` by jet/bench/trl.py, in an interpreter
that has trl (the `compare` extra, usually its own venv). The arguments: `shared` (every setting both
sides share, from one place: `jet.bench.trl.Shared`), `rows` (the JSONL file of training rows both sides
read), `model`, `out`, `t0` (the epoch second the parent launched this process: the budget counts from
it), `budget_s`, `threads` and `generation` ("generate": transformers' `generate`, TRL's default;
"continuous": `use_transformers_continuous_batching`).

Single-turn tasks (`add`) use TRL's own generation: prompts `messages(row)` in conversational form,
reward `score(row, reply)`. Multi-turn tasks (those with an `environment`, `tally`) use `rollout_func`,
TRL's documented hook for custom multi-turn rollouts (its `tools=` / `environment_factory=` need a chat
template that renders tools and a model that emits tool calls; SmolLM2's has no tool format): each
episode is played turn by turn with the same environment as Jet's agent, every live episode's turn
generated together by the trainer's model (`unwrap_model_for_generation` + `generate`, or
`generate_batch` for continuous batching), the prompt of a turn being the tokens so far plus the
environment's message rendered by the chat template (token in, token out); the episode is one
concatenated completion with `env_mask` 0 over the environment's tokens, its reward the environment's.

It writes `<out>/model` (the trained weights, with the base model's tokenizer files, so `jet eval`
loads it like the base) and `<out>/history.json`: one row per optimiser step (its end time since
launch, mean reward, trajectories, completion tokens, the tokens its training forward ran (prompt and
completion, no padding) and, for multi-turn rollouts, the prompt tokens its generation prefilled).

What it is not: imported by anything else in the package; only this module needs trl.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

# One optimiser step per generation batch, on-policy (num_iterations 1): the generation batch is
# groups x group size completions, trained one group per micro-batch (per_device_train_batch_size = group
# size, gradient_accumulation_steps = steps_per_generation = groups), as Jet's trainer splits a step into
# micro-batches: the whole batch in one forward does not fit in 24 GB on the multi-turn task (TRL's
# process was OOM-killed at 23.8 GB resident). "dapo" divides each micro-batch's completion-token sum by
# the token count of the whole generation batch, so the accumulated gradient is Jet's token_mean.
LOSS_TYPE = "dapo"
ENV_TOKENS_PER_TURN = 64  # room for one environment message in TRL's whole-episode completion budget


def completion_budget(s: dict) -> int:
    """TRL's max_completion_length: the whole episode (every turn's tokens and the environment's messages)."""
    turns = s["max_turns"]
    return s["max_tokens"] * turns + ENV_TOKENS_PER_TURN * (turns - 1)


def grpo_config(s: dict, out: str, generation: str = "generate"):
    """The GRPOConfig of the shared settings `s` (`jet.bench.trl.Shared`): nothing here is a constant the
    Jet side could read differently."""
    from trl import GRPOConfig

    G, B = s["group_size"], s["batch_groups"]
    return GRPOConfig(
        output_dir=str(Path(out) / "trainer"), seed=s["seed"], data_seed=s["seed"],
        learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=s["adam_betas"][0], adam_beta2=s["adam_betas"][1], adam_epsilon=s["adam_eps"],
        weight_decay=s["weight_decay"], max_grad_norm=s["grad_clip"], optim="adamw_torch",
        per_device_train_batch_size=G, gradient_accumulation_steps=B, steps_per_generation=B, num_generations=G,
        num_iterations=1, max_completion_length=completion_budget(s), temperature=s["temperature"],
        top_p=s["top_p"], top_k=0, beta=0.0, epsilon=s["clip_eps"], loss_type=LOSS_TYPE, scale_rewards="group",
        mask_truncated_completions=False, max_steps=1_000_000, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=s["device"] == "cpu", bf16=False, fp16=False, dataloader_num_workers=0,
        disable_tqdm=True, log_completions=False,
        gradient_checkpointing=False,  # TRL's default recomputes activations; Jet's trainer does not
        use_transformers_continuous_batching=generation == "continuous",
    )


class MultiTurn:
    """`rollout_func` for a task with an environment: plays each prompt's episode to its end."""

    def __init__(self, module, s: dict, generation: str):
        self.module, self.s, self.generation = module, s, generation
        self.prefilled: list[int] = []  # per episode of the last rollout: prompt tokens its turns prefilled
        self.model_turns: list[int] = []  # per episode of the last rollout: runs of model tokens (env_mask 1)

    def __call__(self, prompts: list, trainer) -> dict:
        import copy

        tok = trainer.processing_class
        envs = [self.module.environment(json.loads(p[0]["episode"])) for p in prompts]
        dialogues = [[{"role": m["role"], "content": m["content"]} for m in p] for p in prompts]
        prompt_ids = [render(tok, d) for d in dialogues]
        seqs = [list(p) for p in prompt_ids]
        completion, mask = [[] for _ in prompts], [[] for _ in prompts]
        self.prefilled = [0] * len(prompts)
        gc = copy.deepcopy(trainer.generation_config)
        gc.max_new_tokens = self.s["max_tokens"]
        live = list(range(len(prompts)))
        while live:
            for i in live:
                self.prefilled[i] += len(seqs[i])  # generate prefills the whole dialogue every turn
            outs = generate(trainer, [seqs[i] for i in live], gc, self.generation)
            still = []
            for i, new in zip(live, outs):
                completion[i] += new
                mask[i] += [1] * len(new)
                seqs[i] += new
                text = tok.decode([t for t in new if t not in eos_ids(trainer)], skip_special_tokens=True)
                follow = envs[i].answer(text)
                if follow is None:
                    continue
                dialogues[i] += [{"role": "assistant", "content": text}, {"role": "user", "content": follow}]
                env = continuation(tok, seqs[i], dialogues[i], eos_ids(trainer))
                completion[i] += env
                mask[i] += [0] * len(env)
                seqs[i] += env
                still.append(i)
            live = still
        self.model_turns = [sum(1 for k, m in enumerate(ms) if m and (k == 0 or not ms[k - 1])) for ms in mask]
        return {"prompt_ids": prompt_ids, "completion_ids": completion, "logprobs": None, "env_mask": mask,
                "episode_reward": [e.reward for e in envs]}


def render(tok, messages: list[dict]) -> list[int]:
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def eos_ids(trainer) -> set[int]:
    return set(trainer.eos_token_ids if isinstance(trainer.eos_token_ids, list) else [trainer.eos_token_ids])


def continuation(tok, seq: list[int], dialogue: list[dict], eos: set[int]) -> list[int]:
    """The tokens that follow `seq` (the dialogue so far, as generated) up to the next assistant turn: the
    chat template's rendering of the new user message. A reply cut by the token limit first gets the end
    of its turn, as the template closes an assistant message."""
    text = tok.apply_chat_template(dialogue, tokenize=False, add_generation_prompt=True)
    head = tok.decode(seq, skip_special_tokens=False)
    if not seq or seq[-1] not in eos:
        head += tok.decode([next(iter(eos))], skip_special_tokens=False)
        extra = [next(iter(eos))]
    else:
        extra = []
    cut = text.rfind(head[-20:]) + 20 if head[-20:] and head[-20:] in text else len(head)
    return extra + tok.encode(text[cut:], add_special_tokens=False)


def generate(trainer, seqs: list[list[int]], gc, mode: str) -> list[list[int]]:
    """One turn of every sequence, with the trainer's model as TRL generates: its tokens up to and with
    the first end-of-turn token."""
    import torch
    from trl.models import unwrap_model_for_generation

    eos = eos_ids(trainer)
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model, torch.no_grad():
        if mode == "continuous":
            outs = model.generate_batch(seqs, generation_config=gc,
                                        continuous_batching_config=trainer.continuous_batching_config,
                                        progress_bar=False)
            model.train()
            raw = [list(o.generated_tokens) for o in outs.values()]
        else:
            width = max(map(len, seqs))
            pad = trainer.processing_class.pad_token_id
            ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
            attention = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
            out = model.generate(input_ids=ids, attention_mask=attention, generation_config=gc)
            raw = out[:, width:].tolist()
    result = []
    for r in raw:
        cut = next((k + 1 for k, t in enumerate(r) if t in eos), len(r))
        result.append([t for t in r[:cut]])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--args-json", required=True)
    a = json.loads(parser.parse_args().args_json)
    import importlib

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    s = a["shared"]
    module = importlib.import_module(f"jet.tasks.{s['task']}")
    torch.set_num_threads(a["threads"])
    t0, deadline = a["t0"], a["t0"] + a["budget_s"]
    rows = [json.loads(line) for line in Path(a["rows"]).read_text().splitlines() if line.strip()]
    multi = hasattr(module, "environment")
    rollout = MultiTurn(module, s, a["generation"]) if multi else None
    if multi:
        def opening(row):
            first, *rest = module.environment(row).opening()
            return [{**first, "episode": json.dumps(row)}, *[{**m, "episode": None} for m in rest]]

        dataset = Dataset.from_list([{"prompt": opening(r)} for r in rows])

        def reward(completions, episode_reward, **_):
            return [float(r) for r in episode_reward]
    else:
        dataset = Dataset.from_list([{"prompt": module.messages(r), "row": json.dumps(r)} for r in rows])

        def reward(completions, row, **_):
            return [module.score(json.loads(x), c[-1]["content"] if isinstance(c, list) else c)
                    for c, x in zip(completions, row)]

    steps: list[dict] = []
    counted = {"forward": 0, "prefilled": 0}

    class Clock(TrainerCallback):
        """Records each step's log row with its end time; stops after the first step past the deadline."""

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                n = s["group_size"] * s["batch_groups"]
                steps.append({"step": state.global_step, "t": time.time() - t0, "reward": float(logs["reward"]),
                              "trajectories": n, "tokens": float(logs["completions/mean_length"]) * n,
                              "forward_tokens": counted["forward"], "prefill_tokens": counted["prefilled"]})
                counted.update(forward=0, prefilled=0)

        def on_step_end(self, args, state, control, **kw):
            if time.time() >= deadline:
                control.should_training_stop = True
            return control

    class Counting(GRPOTrainer):
        """GRPOTrainer unchanged, but for counting the real tokens of each step's training forward."""

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            counted["forward"] += int(out["prompt_mask"].sum() + out["completion_mask"].sum())
            if rollout is not None:
                counted["prefilled"] += sum(rollout.prefilled)
            return out

    tokenizer = AutoTokenizer.from_pretrained(a["model"])
    model = AutoModelForCausalLM.from_pretrained(a["model"], dtype=torch.float32)
    trainer = Counting(model=model, reward_funcs=reward, args=grpo_config(s, a["out"], a["generation"]),
                       train_dataset=dataset, processing_class=tokenizer, callbacks=[Clock()],
                       rollout_func=rollout)
    trainer.train()
    out = Path(a["out"]) / "model"
    trainer.model.save_pretrained(out, safe_serialization=True)
    for f in Path(a["model"]).iterdir():  # the base model's own tokenizer files: evaluated like the base
        if f.is_file() and f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy2(f, out / f.name)
    import transformers

    (Path(a["out"]) / "history.json").write_text(json.dumps(
        {"model": str(out), "trl_version": trl.__version__, "loss_type": LOSS_TYPE, "steps": steps,
         "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
         "generation": a["generation"], "rollout": "rollout_func" if multi else "trl",
         "last_rollout_model_turns": rollout.model_turns if rollout else None}))


if __name__ == "__main__":
    main()
