"""jet eval (jet/cli/eval.py over jet.eval) and the add task: the held-out split, the reward, the interval,
published versions."""

import json
import shutil

import pytest
import yaml
from click.testing import CliRunner

from jet.cli.eval import cli
from jet.eval import evaluate, published_version
from jet.stats import wilson
from jet.tasks import add, dataset


def test_the_eval_split_shares_no_problem_with_training():
    train = {(r["a"], r["b"]) for r in add.rows(len(add._split(False)))}
    held = {(r["a"], r["b"]) for r in add.eval_rows(10_000)}
    assert len(train) + len(held) == 90 * 90 and not train & held
    assert len(held) == len(add._split(True)) > 500  # about one in ten
    assert dataset("add", 5, seed=3) == add.rows(5, seed=3) and add.eval_rows(5) == add.eval_rows(5)
    assert all(r["answer"] == r["a"] + r["b"] for r in add.rows(50))


def test_the_reward_pays_only_the_right_sum():
    row = {"a": 47, "b": 38, "answer": 85}
    assert add.score(row, "85") == 1.0 and add.score(row, "47 + 38 = 85.") == 1.0
    assert add.score(row, "85? no, 86") == 0.0 and add.score(row, "eighty-five") == 0.0 and add.score(row, None) == 0.0
    assert add.messages(row) == [{"role": "user", "content": "What is 47 + 38? Answer with just the number."}]


def test_wilson_interval_matches_hand_computed_values():
    lo, hi = wilson(9, 100)
    assert (round(lo, 4), round(hi, 4)) == (0.0481, 0.1623)  # p = .09, z = 1.96: centre .1052, half-width .0571
    assert wilson(0, 10)[0] == 0.0 and round(wilson(0, 10)[1], 4) == 0.2775
    assert round(wilson(10, 10)[1], 12) == 1.0 and round(wilson(10, 10)[0], 4) == 0.7225


def test_tasks_without_an_eval_split_are_refused():
    """Before any model is loaded: the task is checked first."""
    for task, why in (("guess", "task 'guess' has no held-out split"), ("nope", "task 'nope' is no built-in task")):
        res = CliRunner().invoke(cli, ["--model", "/no/such/model", "--task", task])
        assert res.exit_code == 1 and why in res.output, res.output


@pytest.fixture(scope="module")
def run_with_a_version(tmp_path_factory):
    """A tiny model and a run folder holding a published version of it (perturbed weights)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from jet.models import init_model

    root = tmp_path_factory.mktemp("eval")
    model = init_model(root / "tiny", vocab_size=512, hidden_size=32, layers=2, heads=4, kv_heads=2, seed=0)
    run = root / "runs" / "r"
    (run / "weights" / "tiny" / "v3").mkdir(parents=True)
    (run / "config.resolved.yaml").write_text(yaml.safe_dump({"models": [{"name": "tiny", "path": str(model)}]}))
    m = AutoModelForCausalLM.from_pretrained(model)
    state = {k: (v + 0.5 * torch.randn_like(v)).contiguous() for k, v in m.state_dict().items()
             if k != "lm_head.weight" or not m.config.tie_word_embeddings}
    save_file(state, str(run / "weights" / "tiny" / "v3" / "model.safetensors"))
    shutil.copy(model / "config.json", run / "weights" / "tiny" / "v3" / "config.json")
    return model, run / "weights" / "tiny" / "v3"


def test_evaluate_a_model_folder_and_a_published_version(run_with_a_version):
    model, v3 = run_with_a_version
    base = evaluate(str(model), "add", 6, max_tokens=4, batch=4)
    assert base["n"] == 6 and len(base["results"]) == 6 and set(base["results"]) <= {0, 1}
    assert base["correct"] == sum(base["results"]) and base["version"] == 0
    assert published_version(v3) == (v3.parent.parent.parent, "tiny", 3)
    after = evaluate(str(v3), "add", 6, max_tokens=4, batch=4)
    assert after["version"] == 3 and after["model"].startswith("tiny v3 of ")
    res = CliRunner().invoke(cli, ["--model", str(v3), "--n", "3", "--max-tokens", "2", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output[res.output.index("{"):])
    assert report["n"] == 3 and report["task"] == "add" and len(report["ci95"]) == 2


def test_a_published_version_without_its_run_config_is_a_clear_error(run_with_a_version, tmp_path):
    _, v3 = run_with_a_version
    copy = tmp_path / "x" / "weights" / "tiny" / "v3"
    shutil.copytree(v3, copy)
    res = CliRunner().invoke(cli, ["--model", str(copy), "--n", "2"])
    assert res.exit_code == 1 and "config.resolved.yaml is missing" in res.output
