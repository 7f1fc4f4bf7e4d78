"""The TRL arm of `jet bench trl` (CI's TRL tier: a venv with the `compare` extra; skipped without trl).

- the GRPOConfig it builds holds the settings the Jet config holds, key by key (`MAPPING`), with the
  micro-batches chosen per task (the whole batch in one forward on `add`, a group per micro-batch on
  `tally`) or given;
- one step of TRL's GRPOTrainer and one step of Jet's trainer (staleness 0) on the same batch of the
  tiny model give the same loss, gradient norm and gradient of every parameter, with and without
  gradient accumulation on either side, single- and multi-turn: the same objective, checked instead of
  asserted through the settings mapping;
- the shared seed drives TRL's rows' order and its sampling;
- the weights kept at wall-clock marks are those current at each mark, and their writing is off the clock;
- GRPOTrainer trains the tiny model on the single-turn and the multi-turn task in a subprocess (slow),
  the latter through `rollout_func` with four model turns per episode and the environment's tokens masked.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest

trl = pytest.importorskip("trl", reason="the TRL tier: pip install 'jet-rl[compare]'")

import torch

from jet.bench.trl_arms import MAPPING, Shared, jet_config, write_rows
from jet.bench.trl_side import LOSS_TYPE, Clock, Marks, build, completion_budget, grpo_config, micro_batches_for

pytestmark = pytest.mark.trl


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from jet.models import init_model

    return init_model(tmp_path_factory.mktemp("tiny"), max_position=1024, seed=0)


def jet_value(cfg: dict, rows: list[dict], path: str):
    if path.startswith("rows[]."):
        values = {json.dumps(r[path[len("rows[]."):]]) for r in rows}
        assert len(values) == 1, f"{path} differs between rows"
        return json.loads(values.pop())
    where = cfg
    for part in path.replace("[0]", ".0").split("."):
        where = where[int(part)] if part.isdigit() else where[part]
    return where


def trl_value(g, attr: str):
    if attr == "per_device_train_batch_size * steps_per_generation / num_generations":
        return g.per_device_train_batch_size * g.steps_per_generation // g.num_generations
    if attr == "(adam_beta1, adam_beta2)":
        return [g.adam_beta1, g.adam_beta2]
    if attr == "loss_type":
        return {LOSS_TYPE: "token_mean"}[g.loss_type]  # dapo: normalised by the whole generation batch
    return getattr(g, attr)


@pytest.mark.parametrize("task", ["tally", "add"])
def test_the_grpo_config_holds_what_the_jet_config_holds(task, tmp_path):
    s = Shared(task=task, group_size=3, batch_groups=5, lr=3e-5, adam_betas=(0.8, 0.95), adam_eps=1e-7,
               weight_decay=0.01, grad_clip=0.5, clip_eps=0.3, temperature=0.9, top_p=0.95, max_tokens=7,
               max_turns=4 if task == "tally" else 1, seed=11)
    rows_file = write_rows(s, tmp_path / "rows.jsonl", n=20)
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    cfg = jet_config(s, "jet", "/m", rows_file, tmp_path, max_staleness=1)
    g = grpo_config(s.as_dict(), str(tmp_path))
    checked = 0
    for field, jet_path, trl_attr in MAPPING:
        want = getattr(s, field)
        want = list(want) if isinstance(want, tuple) else want
        assert jet_value(cfg, rows, jet_path) == want, field
        if trl_attr != "-":
            assert trl_value(g, trl_attr) == want, field
            checked += 1
    assert checked == len(MAPPING) - 1
    assert g.max_completion_length == completion_budget(s.as_dict()) >= s.max_tokens * s.max_turns
    assert (g.beta, g.num_iterations, g.data_seed) == (0.0, 1, s.seed)
    # one optimiser step per generation batch, in one forward on the single-turn task (memory allows it)
    # and one group per micro-batch on the multi-turn one (the whole batch was OOM-killed in 24 GB)
    n = 1 if task == "add" else s.batch_groups
    assert micro_batches_for(s.as_dict())[0] == n
    assert g.gradient_accumulation_steps == g.steps_per_generation == n
    assert g.per_device_train_batch_size == s.group_size * s.batch_groups // n
    given = grpo_config(s.as_dict(), str(tmp_path), micro_batches=3)
    assert (given.per_device_train_batch_size, given.gradient_accumulation_steps, given.steps_per_generation) == (
        5, 3, 3)
    with pytest.raises(ValueError, match="must divide the generation batch of 15"):
        micro_batches_for(s.as_dict(), 4)
    flat = jet_config(s, "jet-flat", "/m", rows_file, tmp_path, max_staleness=1)
    assert flat["tasks"][0]["merge"] == "none" and flat["trainer"]["prefix_trees"] is False
    assert cfg["tasks"][0]["merge"] == "exact" and cfg["trainer"]["prefix_trees"] is True


# ---- the same update


G, B, T = 4, 3, 0.7  # group size, groups, sampling temperature (both sides divide the logits by it)


def fixed_batch(multi: bool, seed: int = 0) -> dict:
    """B prompts (different lengths) with G completions each (different lengths, so the token mean of the
    advantages is not 0), and rewards whose group stds (22 to 42) make TRL's advantage eps (1e-4) and Jet's
    (1e-6) differ by under 5e-6 relatively. Both divide by the Bessel-corrected std (a biased one on
    either side would be off by sqrt(4/3) and fail). Multi-turn: each completion is a turn, an environment
    message, a turn."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, 1000) for _ in range(n)]  # no special tokens (0-2)

    batch = {}
    for i in range(B):
        members = []
        for k in range(G):
            turns = [ids(rng.randrange(2, 7))] + ([ids(rng.randrange(3, 6)), ids(rng.randrange(2, 6))] if multi else [])
            members.append({"turns": turns, "reward": round(rng.uniform(0, 100), 3)})
        batch[f"p{i}"] = {"prompt": ids(3 + 2 * i), "members": members}
    return batch


def completion(member: dict) -> tuple[list[int], list[int]]:
    """TRL's one completion of a member and its env_mask (0 over the environment's tokens)."""
    ids, mask = [], []
    for j, part in enumerate(member["turns"]):
        ids += part
        mask += [0 if j % 2 else 1] * len(part)
    return ids, mask


def trl_step(model_path, batch: dict, s: Shared, micro_batches: int, tmp_path) -> dict:
    """One GRPOTrainer step on `batch` through `rollout_func`: its logged loss and grad norm, every
    parameter's gradient just before the optimiser step, and how many micro-batches it ran."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    def rollout(prompts, trainer):
        seen = {p: 0 for p in prompts}
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": None, "env_mask": []}
        for p in prompts:
            ids, mask = completion(batch[p]["members"][seen[p]])
            seen[p] += 1
            out["prompt_ids"].append(batch[p]["prompt"])
            out["completion_ids"].append(ids)
            out["env_mask"].append(mask)
        return out

    rewards = {(p, tuple(completion(m)[0])): m["reward"] for p, b in batch.items() for m in b["members"]}

    def reward(prompts, completion_ids, **_):
        return [rewards[(p, tuple(c))] for p, c in zip(prompts, completion_ids)]

    got = {"substeps": 0}

    class Capture(TrainerCallback):
        def on_substep_end(self, args, state, control, **kw):
            got["substeps"] += 1

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            got["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:  # the step's row (the last log is train()'s summary)
                got.update(loss=float(logs["loss"]), grad_norm=float(logs["grad_norm"]))

    config = grpo_config(s.as_dict(), str(tmp_path / "trl"), micro_batches=micro_batches)
    config.max_steps = 1
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, processing_class=AutoTokenizer.from_pretrained(
        model_path), train_dataset=Dataset.from_list([{"prompt": p} for p in batch]), rollout_func=rollout,
        callbacks=[Capture()])
    trainer.train()
    got["micro_batches"] = got["substeps"] + 1
    return got


def jet_step(model_path, batch: dict, s: Shared, arm: str, micro_batch_tokens: int, tmp_path) -> dict:
    """One step of Jet's trainer (`prepare` + `TorchBackend.train_step`, as the trainer loop runs it) on
    `batch` as trajectories at staleness 0: behaviour logprobs are the model's own."""
    from transformers import AutoModelForCausalLM

    from jet.config import TrainerConfig
    from jet.timeline import Call, merge_calls
    from jet.trainer.backend_torch import TorchBackend
    from jet.trainer.guard import prepare
    from jet.wire import Trajectory

    cfg = jet_config(s, arm, str(model_path), tmp_path / "rows.jsonl", tmp_path, max_staleness=0)
    tc = TrainerConfig(**{**cfg["trainer"], "micro_batch_tokens": micro_batch_tokens})
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()

    def logprobs(context: list[int], new: list[int]) -> list[float]:
        with torch.no_grad():
            logits = model(torch.tensor([context + new])).logits[0, len(context) - 1:-1].float() / T
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(new)[:, None])[:, 0].tolist()

    groups = []
    for g, (p, b) in enumerate(batch.items()):
        members = []
        for k, m in enumerate(b["members"]):
            context, calls = list(b["prompt"]), []
            for j, part in enumerate(m["turns"]):
                if j % 2 == 0:
                    calls.append(Call(context, part, logprobs(context, part), 0, "policy", temperature=T))
                context = context + part
            samples = merge_calls(calls, cfg["tasks"][0]["merge"], episode_id=f"{p}-{k}", reward=m["reward"])
            assert len(samples) == (1 if arm == "jet" else len(calls))  # exact merging: one sample an episode
            members.append(Trajectory(task="t", group_id=p, index=k, episode_id=f"{p}-{k}", model="policy",
                                      reward=m["reward"], samples=tuple(samples), group_size=G, msg_id=f"{g}-{k}"))
        groups.append(members)
    backend = TorchBackend(str(model_path), tc)
    inputs, rows = prepare(groups, tc)
    stats = backend.train_step(rows, inputs, lr=tc.lr)
    return {"loss": stats.loss, "grad_norm": stats.grad_norm, "rows": len(rows), "ratio_max": stats.ratio_max,
            "grads": {n: p.grad.detach().clone() for n, p in backend.model.named_parameters()}}


@pytest.mark.parametrize("multi, micro_batches, arm, micro_batch_tokens", [
    (False, 1, "jet", 4096),  # TRL: the whole batch in one forward (add's default); Jet: one row
    (False, B, "jet-flat", 40),  # TRL: 3 micro-batches of a shuffled batch; Jet: several rows
    (True, B, "jet", 4096),  # multi-turn, TRL accumulating (tally's default), env tokens masked on both
    (True, G * B, "jet-flat", 64),  # a completion per micro-batch; Jet: one sample per turn
])
def test_one_trl_step_and_one_jet_step_give_the_same_loss_and_gradients(multi, micro_batches, arm,
                                                                        micro_batch_tokens, tiny, tmp_path):
    model = tiny
    # grad_clip 1.0 (the bench's) clips here on both sides: the gradients compared are the clipped ones
    s = Shared(task="tally" if multi else "add", group_size=G, batch_groups=B, lr=1e-3, temperature=T,
               max_turns=2 if multi else 1, seed=3)
    batch = fixed_batch(multi)
    trl_ = trl_step(model, batch, s, micro_batches, tmp_path)
    jet = jet_step(model, batch, s, arm, micro_batch_tokens, tmp_path)
    assert trl_["micro_batches"] == micro_batches and (jet["rows"] > 1) == (micro_batch_tokens < 100)
    assert abs(jet["ratio_max"] - 1) < 1e-5  # staleness 0: the behaviour policy is the current one
    assert abs(jet["loss"]) > 1e-3, "a loss of 0 would compare nothing"
    assert jet["loss"] == pytest.approx(trl_["loss"], rel=1e-4, abs=1e-6)
    assert jet["grad_norm"] == pytest.approx(trl_["grad_norm"], rel=1e-4)
    assert jet["grads"].keys() == trl_["grads"].keys()
    scale = max(float(g.abs().max()) for g in jet["grads"].values())
    for name, g in jet["grads"].items():  # float32 sums in other orders (padding, trees, rows): ~1e-6 of scale
        torch.testing.assert_close(g, trl_["grads"][name], rtol=1e-4, atol=1e-5 * scale, msg=name)


# ---- seeds, marks, the subprocess


def test_the_shared_seed_drives_trls_rows_order_and_sampling(tiny, tmp_path):
    one = write_rows(Shared(task="add", max_tokens=6), tmp_path / "one.jsonl", n=1).read_text()
    rows = tmp_path / "rows.jsonl"
    rows.write_text(one * 40)  # one prompt 40 times: the order differs by seed, the completions only by sampling
    orders, completions = [], []
    for seed in (0, 0, 1):
        s = Shared(task="add", group_size=4, batch_groups=1, lr=1e-3, max_tokens=6, seed=seed)
        trainer, _, _ = build({"shared": s.as_dict(), "rows": str(rows), "model": str(tiny),
                               "out": str(tmp_path / "out"), "generation": "generate"})
        orders.append(list(trainer._get_train_sampler()))
        trainer.args.max_steps = 1
        trainer.train()
        completions.append(trainer.last_completions.tolist())
    assert orders[0] == orders[1] != orders[2]
    assert completions[0] == completions[1] != completions[2]


class Stepped(Clock):
    """A clock the test moves by hand; time spent in `excluded()` never shows."""

    def __init__(self):
        super().__init__(0.0)
        self.t = 0.0

    def now(self) -> float:
        return self.t


def test_marks_keep_the_weights_current_at_each_mark_and_share_folders_between_steps(tmp_path):
    model = torch.nn.Linear(2, 1)
    written = {}

    def save(m, dest, state):
        written[str(dest)] = float((state or m.state_dict())["bias"])

    clock = Stepped()
    marks = Marks([1, 2, 3, 10, 12, 20, 30, 40], clock, "/base", tmp_path, save)

    def update(began: float, ended: float) -> None:
        clock.t = began
        marks.before_update(model)
        clock.t = ended
        with torch.no_grad():
            model.bias += 1.0
        marks.after_update(model)

    model.bias.data.fill_(0.0)
    update(2.5, 3.5)  # marks 1 and 2 passed before the first update: the base; 3 passes during it
    update(10.5, 11)  # 10 passed before it: the weights after step 1
    update(19.9, 21)  # 12 is still step 2's; 20 passes during the update: a copy of step 2's
    update(24, 60)  # an update longer than the guard: 30 and 40 pass during it, no copy was due
    kept = marks.finish(model)
    by = {k["mark_s"]: k for k in kept}
    assert [by[m]["step"] for m in (1, 2, 3)] == [0, 0, 0] and by[1]["path"] == "/base"
    assert (by[10]["step"], by[12]["step"], by[20]["step"]) == (1, 2, 2)
    assert by[12]["path"] == by[20]["path"] and by[12]["weights_time_s"] == 11
    assert [written[by[m]["path"]] for m in (10, 12)] == [1.0, 2.0]
    assert by[30]["step"] == by[40]["step"] == 4 and by[30]["weights_time_s"] == 60  # > 30: said so
    assert written[by[40]["path"]] == 4.0 and len(written) == 3


def test_marks_of_a_training_run_hold_the_weights_after_the_right_step(tiny, tmp_path, monkeypatch):
    """The callbacks of a real run, on a clock that makes update k span [10k - 5, 10k - 2]: mark 6 passes
    during update 1 (the base), 16 and 17 during update 2 (a copy of step 1's weights, written once), 40
    after the run (the final model)."""
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    import jet.tasks.add
    from jet.bench.trl_side import save_model, timing

    monkeypatch.setattr(jet.tasks.add, "score", lambda row, reply: float(len(reply) % 5))  # rewards that differ
    s = Shared(task="add", group_size=4, batch_groups=1, lr=1e-2, max_tokens=6)
    trainer, _, counted = build({"shared": s.as_dict(), "rows": str(write_rows(s, tmp_path / "rows.jsonl", n=20)),
                                 "model": str(tiny), "out": str(tmp_path / "out"), "generation": "generate"})
    clock, after, steps = Stepped(), [], []
    marks = Marks([1, 6, 16, 17, 40], clock, str(tiny), tmp_path, lambda m, d, sd: save_model(m, str(tiny), d, sd))

    class Ticks(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            clock.t = 10 * len(after) + 5

        def on_optimizer_step(self, args, state, control, model=None, **kw):
            clock.t = 10 * len(after) + 8
            after.append({k: v.detach().clone() for k, v in model.state_dict().items()})

    trainer.add_callback(Ticks())  # before `timing`: it moves the clock first
    trainer.add_callback(timing(s.as_dict(), 1e9, clock, marks, steps, counted))
    trainer.args.max_steps = 3
    trainer.train()
    save_model(trainer.model, str(tiny), tmp_path / "model")
    by = {k["mark_s"]: k for k in marks.finish(trainer.model, tmp_path / "model")}
    assert [st["weights_time_s"] for st in steps] == [8, 18, 28]
    assert [(by[m]["step"], by[m]["path"]) for m in (1, 6)] == [(0, str(tiny))] * 2
    assert by[16] == {"mark_s": 16, "path": str(tmp_path / "marks" / "16"), "step": 1, "version": 1,
                      "weights_time_s": 8}
    assert by[17]["path"] == by[16]["path"] and not (tmp_path / "marks" / "17").exists()
    assert (by[40]["step"], by[40]["path"]) == (3, str(tmp_path / "model"))
    kept = load_file(tmp_path / "marks" / "16" / "model.safetensors")
    assert (tmp_path / "marks" / "16" / "tokenizer.json").is_file() and kept.keys() <= after[0].keys()
    assert all(torch.equal(kept[k], after[0][k]) for k in kept)
    assert not all(torch.equal(kept[k], after[1][k]) for k in kept), "the steps must move the weights"
    assert clock.excluded_s > 0


def test_the_clock_leaves_off_the_time_spent_keeping_marks():
    clock = Clock(time.time())
    before = clock.now()
    with clock.excluded():
        time.sleep(0.2)
    assert clock.now() - before < 0.1 and clock.excluded_s >= 0.2


@pytest.mark.slow
@pytest.mark.parametrize("task", ["add", "tally"])
def test_grpo_trainer_trains_a_step_of_the_task(task, tiny, tmp_path):
    s = Shared(task=task, group_size=2, batch_groups=2, lr=1e-3, max_tokens=3, max_turns=4 if task == "tally" else 1)
    rows = write_rows(s, tmp_path / "rows.jsonl", n=50)
    args = {"shared": s.as_dict(), "rows": str(rows), "model": str(tiny), "out": str(tmp_path / "out"),
            "t0": time.time(), "budget_s": 1, "threads": 2, "generation": "generate", "marks_s": [0.5, 1000]}
    proc = subprocess.run([sys.executable, "-P", "-m", "jet.bench.trl_side", "--args-json", json.dumps(args)],
                          capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    info = json.loads((tmp_path / "out" / "history.json").read_text())
    [step, *_] = info["steps"]
    assert step["trajectories"] == 4 and step["forward_tokens"] > 0 and 0 <= step["reward"] <= 1
    assert info["versions"]["trl"] == trl.__version__ and (tmp_path / "out" / "model" / "model.safetensors").is_file()
    n = 1 if task == "add" else 2
    assert (info["micro_batches"], info["micro_batch_size"], info["seed"]) == (n, 4 // n, s.seed)
    if task == "tally":
        assert info["rollout"] == "rollout_func" and info["last_rollout_model_turns"] == [4] * 4
        assert step["prefill_tokens"] > 4 * 4 * 300  # every turn prefills the whole dialogue again
    else:
        assert info["rollout"] == "trl" and step["prefill_tokens"] == 0
    # 0.5 s: before the first step (the imports alone take longer): the base; 1000 s: after the run, the final
    # weights; nothing written while timed, so nothing left off the clock
    assert [(k["mark_s"], k["step"], k["path"]) for k in info["marks"]] == [
        (0.5, 0, str(tiny)), (1000, len(info["steps"]), str(tmp_path / "out" / "model"))]
    assert info["excluded_s"] == 0 and info["steps"][-1]["t"] >= 1
