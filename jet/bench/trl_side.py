"""The TRL side of `jet bench trl`: `GRPOTrainer` on a built-in task until a wall-clock deadline.

Run as `python -P -m jet.bench.trl_side --args-json '{...}'` by jet/bench/trl_arms.py, in an interpreter
that has trl (the `compare` extra, usually its own venv). The arguments: `shared` (every setting both
sides share, from one place: `jet.bench.trl_arms.Shared`), `rows` (the JSONL file of training rows both
sides read), `model` (a local folder), `out`, `t0` (the epoch second the parent launched this process:
the budget counts from it), `budget_s`, `threads`, `generation` ("generate": transformers' `generate`,
TRL's default; "continuous": `use_transformers_continuous_batching`), and optionally `micro_batches`
(gradient accumulation steps per optimiser step; None: `micro_batches_for`'s default for the task) and
`marks_s` (seconds since `t0` at which to keep the weights, below).

How TRL's users run it: one optimiser step per generation batch (groups x group size completions),
on-policy (num_iterations 1), loss "dapo", the shared seed as TRL's `seed` (its sampling: the trainer
seeds torch at init) and `data_seed` (the rows' order). The generation batch is trained in
`micro_batches` forwards: by default the whole batch in one forward on a single-turn task, where memory
does not require accumulation, and one micro-batch per group on a multi-turn task, whose whole batch in
one forward was OOM-killed at 23.8 GB resident on a 24 GB machine. Either way the update is Jet's
token_mean one (tests/bench/test_trl_side.py checks the loss and every gradient against Jet's trainer).

The task is loaded and checked by `jet.tasks.held_out_task` (the protocol: `jet.tasks.protocol`).
Single-turn tasks (`add`) use TRL's own generation: prompts `messages(row)` in conversational form,
reward `score(row, reply)`. Multi-turn tasks (those with an `environment`, `tally`) use `rollout_func`,
TRL's documented hook for custom multi-turn rollouts (its `tools=` / `environment_factory=` need a chat
template that renders tools and a model that emits tool calls; SmolLM2's has no tool format): each
episode is played turn by turn with the same environment as Jet's agent, every live episode's turn
generated together by the trainer's model (`unwrap_model_for_generation` + `generate`, or
`generate_batch` for continuous batching), the prompt of a turn being the tokens so far plus the
environment's message rendered by the chat template (token in, token out); the episode is one
concatenated completion with `env_mask` 0 over the environment's tokens, its reward the environment's.

Weights at wall-clock marks (`Marks`), for time to accuracy: for each mark m the weights current at m,
those after the last optimiser step that ended at or before m (the base model's before the first), are
written as a model folder `<out>/marks/<m>/` (marks that fall between the same two steps share one
folder; a mark after the run's end gets `<out>/model`). They are written from the trainer's callbacks:
just before an optimiser step, every mark passed gets the current weights; a mark that passes during the
update itself gets a CPU copy of the weights taken before it (taken only when a mark is due within a few
update-lengths, so about 0.5 GB for SmolLM2-135M, briefly, now and then). The time spent copying and
writing is measured and left off TRL's clock (`Clock`): every time TRL reports (each step's `t`, the
marks, the deadline) is wall time since `t0` minus that time, so the marks cost TRL no budget.

It writes `<out>/model` (the trained weights, with the base model's tokenizer files, so `jet eval`
loads it like the base) and `<out>/history.json`: one row per optimiser step (its end time since
launch, the time its update ended (`weights_time_s`), loss, mean reward, trajectories, completion tokens, the
tokens its training forward ran (prompt and completion, no padding) and, for multi-turn rollouts, the
prompt tokens its generation prefilled), `marks` ([{mark_s, path, step, version, weights_time_s}]),
`micro_batches` (and `micro_batch_size`, `micro_batches_why`), `seed`, and `excluded_s` (the time left
off the clock).

What it is not: imported by the rest of the package, except for `micro_batches_for` (this module's top
level imports nothing heavy); only this module needs trl.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import time
from pathlib import Path

# "dapo" divides each micro-batch's completion-token sum by the token count of the whole generation batch
# (`num_items_in_batch`), so the micro-batches' losses sum to the token mean over the batch, Jet's
# token_mean, however TRL's shuffle before the split spreads the groups over the micro-batches (the
# advantages are computed over the whole batch before it). A per-micro-batch normaliser ("bnpo", "grpo")
# would make the update depend on the split.
LOSS_TYPE = "dapo"
ENV_TOKENS_PER_TURN = 64  # room for one environment message in TRL's whole-episode completion budget
GUARD_MIN_S = 5.0  # a mark due within this (or 4 longest updates) of an update: copy the weights before it


def multi_turn(task: str) -> bool:
    """Whether built-in task `task` has an environment (a multi-turn dialogue through `rollout_func`)."""
    from jet.tasks import held_out_task

    return held_out_task(task).kind == "multi"


def micro_batches_for(s: dict, given: int | None = None) -> tuple[int, str]:
    """(gradient accumulation steps per optimiser step, why): `given`, or by the task's memory need."""
    batch = s["group_size"] * s["batch_groups"]
    if given is not None:
        if given < 1 or batch % given:
            raise ValueError(f"micro_batches {given} must divide the generation batch of {batch} completions "
                             f"(group_size {s['group_size']} x batch_groups {s['batch_groups']})")
        return given, "given"
    if multi_turn(s["task"]):
        return s["batch_groups"], ("default for a multi-turn task: one micro-batch per group (the whole batch in "
                                   "one forward was OOM-killed at 23.8 GB on a 24 GB machine)")
    return 1, "default for a single-turn task: the whole generation batch in one forward, as memory allows"


def completion_budget(s: dict) -> int:
    """TRL's max_completion_length: the whole episode (every turn's tokens and the environment's messages)."""
    turns = s["max_turns"]
    return s["max_tokens"] * turns + ENV_TOKENS_PER_TURN * (turns - 1)


def grpo_config(s: dict, out: str, generation: str = "generate", micro_batches: int | None = None):
    """The GRPOConfig of the shared settings `s` (`jet.bench.trl_arms.Shared`): nothing here is a constant
    the Jet side could read differently. `micro_batches`: `micro_batches_for`."""
    from trl import GRPOConfig

    G, B = s["group_size"], s["batch_groups"]
    n, _ = micro_batches_for(s, micro_batches)
    return GRPOConfig(
        output_dir=str(Path(out) / "trainer"), seed=s["seed"], data_seed=s["seed"],
        learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=s["adam_betas"][0], adam_beta2=s["adam_betas"][1], adam_epsilon=s["adam_eps"],
        weight_decay=s["weight_decay"], max_grad_norm=s["grad_clip"], optim="adamw_torch",
        per_device_train_batch_size=G * B // n, gradient_accumulation_steps=n, steps_per_generation=n,
        num_generations=G, num_iterations=1, max_completion_length=completion_budget(s),
        temperature=s["temperature"], top_p=s["top_p"], top_k=0, beta=0.0, epsilon=s["clip_eps"],
        loss_type=LOSS_TYPE, scale_rewards="group", mask_truncated_completions=False, max_steps=1_000_000,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=s["device"] == "cpu", bf16=False, fp16=False,
        dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
        gradient_checkpointing=False,  # TRL's default recomputes activations; Jet's trainer does not
        use_transformers_continuous_batching=generation == "continuous",
    )


class MultiTurn:
    """`rollout_func` for a task with an environment (`task`: its `jet.tasks.protocol.TaskSpec`): plays
    each prompt's episode to its end."""

    def __init__(self, task, s: dict, generation: str):
        self.task, self.s, self.generation = task, s, generation
        self.prefilled: list[int] = []  # per episode of the last rollout: prompt tokens its turns prefilled
        self.model_turns: list[int] = []  # per episode of the last rollout: runs of model tokens (env_mask 1)

    def __call__(self, prompts: list, trainer) -> dict:
        import copy

        tok = trainer.processing_class
        envs = [self.task.environment(json.loads(p[0]["episode"])) for p in prompts]
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


class Clock:
    """Seconds since the launch `t0`, less the time spent inside `excluded()` (writing marks)."""

    def __init__(self, t0: float):
        self.t0, self.excluded_s = t0, 0.0

    def now(self) -> float:
        return time.time() - self.t0 - self.excluded_s

    @contextlib.contextmanager
    def excluded(self):
        began = time.time()
        try:
            yield
        finally:
            self.excluded_s += time.time() - began


def cpu_copy(model) -> dict:
    """The model's state dict copied to CPU, tied tensors still one tensor (so it saves like the model)."""
    copies: dict = {}
    return {k: copies.setdefault((v.data_ptr(), v.dtype, tuple(v.shape), v.stride()),
                                 v.detach().to("cpu", copy=True))
            for k, v in model.state_dict().items()}


def save_model(model, base: str, dest: Path, state_dict: dict | None = None) -> None:
    """`model` (or its `state_dict`) as a safetensors model folder with the base model's tokenizer files (so
    `jet eval` loads it like the base), flushed to disk (the write is over when this returns)."""
    model.save_pretrained(dest, safe_serialization=True, state_dict=state_dict)
    for f in Path(base).iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy2(f, dest / f.name)
    for f in dest.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Marks:
    """The weights current at each of `marks_s` (module docstring), kept from the trainer's callbacks:
    `before_update` just before each optimiser step, `after_update` just after it, `finish` after training.
    `save(model, dest, state_dict)` writes a model folder. Every copy and write is off the `clock`."""

    def __init__(self, marks_s: list[float], clock: Clock, base: str, out: Path, save):
        self.pending, self.clock, self.out, self.save = sorted(marks_s), clock, out, save
        self.kept: list[dict] = []
        self.step, self.since, self.path = 0, 0.0, base  # the current weights: after `step` updates
        self.copy: dict | None = None  # the weights before the update under way, when a mark may pass in it
        self.began, self.longest = 0.0, 0.0

    def before_update(self, model) -> None:
        now = self.clock.now()
        with self.clock.excluded():
            while self.pending and self.pending[0] <= now:
                self.keep(self.pending.pop(0), model)
            if self.pending and self.pending[0] <= now + max(GUARD_MIN_S, 4 * self.longest):
                self.copy = cpu_copy(model)
        self.began = self.clock.now()

    def after_update(self, model) -> None:
        now = self.clock.now()
        self.longest = max(self.longest, now - self.began)
        with self.clock.excluded():
            while self.copy is not None and self.pending and self.pending[0] < now:
                self.keep(self.pending.pop(0), model, self.copy)  # passed during the update: the weights before it
            self.copy = None
            self.step, self.since, self.path = self.step + 1, now, None
            # without a copy (an update longer than the guard), a mark passed during it gets the weights
            # after it; its weights_time_s > mark_s says so
            while self.pending and self.pending[0] < now:
                self.keep(self.pending.pop(0), model)

    def finish(self, model, final: Path | None = None) -> list[dict]:
        """Every mark not passed yet gets the last weights (`final`: a folder that already holds them)."""
        if self.pending and self.path is None and final is not None:
            self.path = str(final)
        while self.pending:
            self.keep(self.pending.pop(0), model)
        return self.kept

    def keep(self, mark: float, model, state_dict: dict | None = None) -> None:
        if self.path is None:
            dest = self.out / "marks" / f"{mark:g}"
            self.save(model, dest, state_dict)
            self.path = str(dest)
        self.kept.append({"mark_s": mark, "path": self.path, "step": self.step, "version": self.step,
                          "weights_time_s": round(self.since, 3)})


def build(a: dict):
    """(the GRPOTrainer of the arguments `a`, its `MultiTurn` rollout or None, its token counters)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from jet.tasks import held_out_task

    s = a["shared"]
    task = held_out_task(s["task"])
    rows = [json.loads(line) for line in Path(a["rows"]).read_text().splitlines() if line.strip()]
    rollout = MultiTurn(task, s, a["generation"]) if task.kind == "multi" else None
    if rollout is not None:
        def opening(row):
            first, *rest = task.environment(row).opening()
            return [{**first, "episode": json.dumps(row)}, *[{**m, "episode": None} for m in rest]]

        dataset = Dataset.from_list([{"prompt": opening(r)} for r in rows])

        def reward(completions, episode_reward, **_):
            return [float(r) for r in episode_reward]
    else:
        dataset = Dataset.from_list([{"prompt": task.messages(r), "row": json.dumps(r)} for r in rows])

        def reward(completions, row, **_):
            return [task.score(json.loads(x), c[-1]["content"] if isinstance(c, list) else c)
                    for c, x in zip(completions, row)]

    counted = {"forward": 0, "prefilled": 0}

    class Counting(GRPOTrainer):
        """GRPOTrainer unchanged, but for counting the real tokens of each step's training forward (and
        keeping the last generation batch's completion ids)."""

        last_completions = None

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            counted["forward"] += int(out["prompt_mask"].sum() + out["completion_mask"].sum())
            if rollout is not None:
                counted["prefilled"] += sum(rollout.prefilled)
            self.last_completions = out["completion_ids"]
            return out

    tokenizer = AutoTokenizer.from_pretrained(a["model"])
    model = AutoModelForCausalLM.from_pretrained(a["model"], dtype=torch.float32)
    config = grpo_config(s, a["out"], a["generation"], a.get("micro_batches"))
    trainer = Counting(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                       processing_class=tokenizer, rollout_func=rollout)
    return trainer, rollout, counted


def timing(s: dict, budget_s: float, clock: Clock, marks: Marks, steps: list[dict], counted: dict):
    """The callback that keeps the marks, records each step's log row and stops after the first step
    that ends past the budget."""
    from transformers import TrainerCallback

    class Timing(TrainerCallback):
        updated = 0.0

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            marks.before_update(model)

        def on_optimizer_step(self, args, state, control, model=None, **kw):
            marks.after_update(model)
            self.updated = marks.since

        def on_step_end(self, args, state, control, **kw):
            if clock.now() >= budget_s:
                control.should_training_stop = True
            return control

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                n = s["group_size"] * s["batch_groups"]
                steps.append({"step": state.global_step, "t": clock.now(), "weights_time_s": self.updated,
                              "reward": float(logs["reward"]), "trajectories": n,
                              "tokens": float(logs["completions/mean_length"]) * n,
                              "forward_tokens": counted["forward"], "prefill_tokens": counted["prefilled"],
                              "loss": float(logs["loss"]) if "loss" in logs else None})
                counted.update(forward=0, prefilled=0)

    return Timing()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--args-json", required=True)
    a = json.loads(parser.parse_args().args_json)
    import torch
    import transformers
    import trl

    s, out = a["shared"], Path(a["out"])
    torch.set_num_threads(a["threads"])
    n, why = micro_batches_for(s, a.get("micro_batches"))
    clock = Clock(a["t0"])
    marks = Marks(a.get("marks_s") or [], clock, a["model"], out,
                  lambda model, dest, state: save_model(model, a["model"], dest, state))
    steps: list[dict] = []
    trainer, rollout, counted = build(a)
    trainer.add_callback(timing(s, a["budget_s"], clock, marks, steps, counted))
    trainer.train()
    final = out / "model"
    save_model(trainer.model, a["model"], final)
    kept = marks.finish(trainer.model, final)
    (out / "history.json").write_text(json.dumps(
        {"model": str(final), "trl_version": trl.__version__, "loss_type": LOSS_TYPE, "steps": steps,
         "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
         "generation": a["generation"], "rollout": "rollout_func" if rollout else "trl",
         "micro_batches": n, "micro_batch_size": s["group_size"] * s["batch_groups"] // n, "micro_batches_why": why,
         "seed": s["seed"], "marks": kept, "excluded_s": round(clock.excluded_s, 3),
         "last_rollout_model_turns": rollout.model_turns if rollout else None}))


if __name__ == "__main__":
    main()
