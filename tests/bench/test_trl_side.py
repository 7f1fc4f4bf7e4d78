"""The TRL arm of `jet bench trl` (CI's TRL tier: a venv with the `compare` extra; skipped without trl):
the GRPOConfig it builds holds the settings the Jet config holds, key by key (`MAPPING`), and TRL's
GRPOTrainer trains the tiny model for a step on the single-turn and the multi-turn task, the latter
through `rollout_func` with four model turns per episode and the environment's tokens masked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

trl = pytest.importorskip("trl", reason="the TRL tier: pip install 'jet-rl[compare]'")

from jet.bench.trl_arms import MAPPING, Shared, jet_config, write_rows  # noqa: E402
from jet.bench.trl_side import LOSS_TYPE, completion_budget, grpo_config  # noqa: E402

pytestmark = pytest.mark.trl


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


def test_the_grpo_config_holds_what_the_jet_config_holds(tmp_path):
    s = Shared(task="tally", group_size=3, batch_groups=5, lr=3e-5, adam_betas=(0.8, 0.95), adam_eps=1e-7,
               weight_decay=0.01, grad_clip=0.5, clip_eps=0.3, temperature=0.9, top_p=0.95, max_tokens=7,
               max_turns=4, seed=11)
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
    assert (g.beta, g.num_iterations) == (0.0, 1)
    # one group per micro-batch, one optimiser step per generation batch
    assert g.per_device_train_batch_size == g.num_generations
    assert g.gradient_accumulation_steps == g.steps_per_generation == s.batch_groups
    flat = jet_config(s, "jet-flat", "/m", rows_file, tmp_path, max_staleness=1)
    assert flat["tasks"][0]["merge"] == "none" and flat["trainer"]["prefix_trees"] is False
    assert cfg["tasks"][0]["merge"] == "exact" and cfg["trainer"]["prefix_trees"] is True


@pytest.mark.slow
@pytest.mark.parametrize("task", ["add", "tally"])
def test_grpo_trainer_trains_a_step_of_the_task(task, tmp_path):
    from jet.models import init_model

    model = init_model(tmp_path / "tiny", max_position=1024, seed=0)
    s = Shared(task=task, group_size=2, batch_groups=1, lr=1e-3, max_tokens=3, max_turns=4 if task == "tally" else 1)
    rows = write_rows(s, tmp_path / "rows.jsonl", n=50)
    args = {"shared": s.as_dict(), "rows": str(rows), "model": str(model), "out": str(tmp_path / "out"),
            "t0": time.time(), "budget_s": 1, "threads": 2, "generation": "generate"}
    proc = subprocess.run([sys.executable, "-P", "-m", "jet.bench.trl_side", "--args-json", json.dumps(args)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    info = json.loads((tmp_path / "out" / "history.json").read_text())
    [step, *_] = info["steps"]
    assert step["trajectories"] == 2 and step["forward_tokens"] > 0 and 0 <= step["reward"] <= 1
    assert info["versions"]["trl"] == trl.__version__ and (tmp_path / "out" / "model" / "model.safetensors").is_file()
    if task == "tally":
        assert info["rollout"] == "rollout_func" and info["last_rollout_model_turns"] == [4, 4]
        assert step["prefill_tokens"] > 2 * 4 * 300  # every turn prefills the whole dialogue again
    else:
        assert info["rollout"] == "trl" and step["prefill_tokens"] == 0
