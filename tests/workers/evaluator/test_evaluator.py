"""The evaluator (jet.workers.evaluator) on the tiny model and the real Redis of the fixture: held-out
episodes played with the task's own workflow (two turns, jet's client and the OpenAI SDK through the
episode's gateway), greedy whatever the workflow asks; a broken row fails alone; versions followed
from `weights:<model>`, the due ones secured, a lagging evaluator skipping to the newest and saying so,
the final version evaluated last, and a restarted evaluator not evaluating a version twice."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid

import anyio
import pytest

from jet.llm import Tokenizers
from jet.queues.connect import connect
from jet.runs import RunDir, read_metrics
from jet.wire import WeightVersion
from jet.workers.evaluator.episodes import LocalClient, held_out_rows, play_rows
from jet.workers.evaluator.worker import Evaluator, done_versions
from jet.workers.inference.hf import HFBackend
from tests.weights import perturbed_weights
from tests.workers.conftest import MODEL, wait_for, write_config

FLOW = "tests.workers.evaluator.flows:workflow"


def config(tmp_path, tiny_model, rows: list[dict], *, every: int = 2, steps: int = 5):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = write_config(tmp_path / "config.yaml", f"ev{uuid.uuid4().hex[:8]}", tiny_model,
                       [{"name": "probe", "workflow": FLOW, "dataset": str(data), "episode_timeout_s": 30,
                         "eval": {"dataset": str(data), "n": len(rows), "every": every, "concurrency": 4}}])
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"steps": steps})})


@pytest.mark.anyio
async def test_held_out_episodes_are_played_greedily_with_the_tasks_workflow(tmp_path, tiny_model):
    rows = [{"q": f"What is {i} + {i}?"} for i in range(6)] + [{"q": "?", "fail": True}]
    cfg = config(tmp_path, tiny_model, rows)
    task = cfg.tasks[0]
    assert held_out_rows(task) == rows
    backend = HFBackend(tiny_model)
    tokenizers = Tokenizers({MODEL: str(tiny_model)})
    greedy = [await play_rows(cfg, task, rows, LocalClient(backend, tokenizers)) for _ in range(2)]
    assert greedy[0].results == greedy[1].results, "greedy: the same tokens every time"
    assert len(set(greedy[0].results[:6])) == 6, "each row its own two-turn dialogue"
    assert greedy[0].results[6] == 0.0 and greedy[0].failed == 1, "the broken row scores 0, alone"
    sampled = [await play_rows(cfg, task, rows, LocalClient(backend, tokenizers, greedy=False)) for _ in range(2)]
    assert sampled[0].results[:6] != sampled[1].results[:6], "sampled as the workflow asks (temperature 1)"


async def _evaluate(ev: Evaluator):
    stop = anyio.Event()
    with anyio.fail_after(120):
        await ev.run(stop)


@pytest.mark.anyio
async def test_a_lagging_evaluator_skips_to_the_newest_due_version_then_ends_with_the_final_one(
        tmp_path, tiny_model, redis_url, caplog):
    # every evaluation takes > 1 s (a slow row), so versions 1..5, announced while the base is evaluated,
    # wait together: 2 and 4 are due (every 2), 5 is the final one (trainer.steps 5); only 5 is evaluated
    rows = [{"q": "one"}, {"q": "two", "sleep": 1.2}]
    cfg = config(tmp_path, tiny_model, rows, every=2, steps=5)
    run = RunDir.of(cfg)
    r = await connect(redis_url)
    try:
        ev = Evaluator(cfg, MODEL, redis_url, HFBackend(tiny_model))
        caplog.set_level(logging.INFO, logger="jet.workers.evaluator.worker")
        async with anyio.create_task_group() as tg:
            tg.start_soon(_evaluate, ev)
            await wait_for(lambda: ev.evaluating == 0, timeout=30)
            for v in range(1, 6):
                file, sha = perturbed_weights(tiny_model, run.weight_version(MODEL, v), seed=v, scale=0.01)
                await r.xadd(ev.keys.weights(MODEL), WeightVersion(MODEL, v, str(file.parent), sha, v).to_fields())
        lines = read_metrics(run.evals(MODEL))
        assert [(x["version"], x["step"]) for x in lines] == [(0, 0), (5, 5)]
        assert all(x["eval/probe/n"] == 2 and 0 <= x["eval/probe/reward_mean"] <= 1 for x in lines)
        assert lines[0]["eval/probe/results"] != lines[1]["eval/probe/results"], "version 5's weights were loaded"
        assert "skipping version(s) [2, 4] for the newest due, 5" in caplog.text
        assert not (run.trainer(MODEL) / "eval-weights").exists(), "secured copies are removed"
        # a restarted evaluator starts after what its file holds
        assert done_versions(run.evals(MODEL)) == {0, 5}
        assert Evaluator(cfg, MODEL, redis_url, HFBackend(tiny_model)).last_due == 5
    finally:
        await r.aclose()


def test_jet_worker_eval_names_what_is_missing(tmp_path, tiny_model):
    from click.testing import CliRunner

    from jet.workers.cli import worker

    plain = tmp_path / "plain.yaml"
    plain.write_text(f"models: [{{name: tiny, path: {tiny_model}}}]\n"
                     "tasks: [{name: guess, workflow: 'jet.tasks.guess:workflow', dataset: guess}]\n")
    res = CliRunner().invoke(worker, ["eval", "--config", str(plain), "--model", "tiny"])
    assert res.exit_code == 1 and "no task of model 'tiny' has an `eval` section (tasks[].eval)" in res.output
    res = CliRunner().invoke(worker, ["eval", "--config", str(plain), "--model", "other"])
    assert res.exit_code == 2 and "unknown model 'other'" in res.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(plain.read_text().replace("dataset: guess}", "dataset: guess, eval: {n: 0}}"))
    res = CliRunner().invoke(worker, ["eval", "--config", str(bad), "--model", "tiny"])
    assert res.exit_code == 1 and "tasks[0].eval.n" in res.output


LOWERED = """
import os, sys, threading
from jet.workers.evaluator.worker import lower_priority
started = threading.Event(); stop = threading.Event()
t = threading.Thread(target=lambda: (started.set(), stop.wait())); t.start(); started.wait()
tids = [int(x) for x in os.listdir("/proc/self/task")]
before = {tid: os.getpriority(os.PRIO_PROCESS, tid) for tid in tids}
said = lower_priority(7, sys.argv[1] == "idle")
after = [(os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid) - before[tid]) for tid in tids]
stop.set(); t.join()
print(said); print(len(tids), *sorted(set(after)))
"""


@pytest.mark.slow  # a process of its own: lowering threads is for good
@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux: SCHED_IDLE and per-thread priorities")
@pytest.mark.parametrize("mode", ["idle", "nice"])
def test_the_evaluator_lowers_every_thread_already_started(mode):
    """Linux sets the scheduling class and the niceness per thread: a thread started before (torch's,
    anyio's) must be lowered too, or its work competes with training at full priority."""
    out = subprocess.run([sys.executable, "-c", LOWERED, mode], capture_output=True, text=True, check=True,
                         timeout=60).stdout.splitlines()
    n, *seen = out[1].split(" ", 1)
    assert int(n) >= 2
    if mode == "idle":
        assert out[0] == "idle scheduling class" and seen == [f"({os.SCHED_IDLE}, 0)"]
    else:
        assert out[0] == "nice +7" and seen == [f"({os.SCHED_OTHER}, 7)"]


def test_held_out_rows_come_from_a_built_in_split_or_a_file(tmp_path):
    from jet.config import load
    from jet.errors import ConfigError
    from jet.tasks.add import is_eval

    def task(train: str = "add", **ev):
        return load({"models": [{"name": "m", "path": "x"}], "tasks": [
            {"name": "t", "workflow": "jet.tasks.add:workflow", "dataset": train, "eval": ev}]}).tasks[0]

    rows = held_out_rows(task(n=30, seed=1))
    assert len(rows) == 30 and all(is_eval(r["a"], r["b"]) for r in rows), "add's own held-out split"
    assert held_out_rows(task(n=30, seed=1)) == rows and held_out_rows(task(n=30, seed=2)) != rows
    with pytest.raises(ConfigError, match=r"tasks.t.dataset: 'guess' has no built-in held-out split"):
        held_out_rows(task("guess"))
    file = tmp_path / "rows.jsonl"
    file.write_text('{"a": 1}\n{"a": 2}\n{"a": 3}\n')
    assert held_out_rows(task("guess", dataset=str(file), n=2)) == [{"a": 1}, {"a": 2}]


@pytest.mark.slow
@pytest.mark.realmodel
def test_on_a_real_model_the_evaluator_agrees_with_jet_eval_row_by_row(smollm2):
    """The evaluator plays `add` through its workflow (the OpenAI SDK, the gateway's chat template) and
    `jet eval` through the task's module (its own rendering): on SmolLM2 they score every row alike."""
    from jet.config import load
    from jet.eval import evaluate
    from jet.tokenizer import load_tokenizer

    path = str(smollm2[1])
    cfg = load({"models": [{"name": "policy", "path": path}], "tasks": [
        {"name": "add", "workflow": "jet.tasks.add:workflow", "dataset": "add", "eval": {"n": 40}}]})
    task = cfg.tasks[0]
    backend = HFBackend(path)
    played = anyio.run(play_rows, cfg, task, held_out_rows(task), LocalClient(backend, Tokenizers({"policy": path})))
    ref = evaluate(path, "add", 40, loaded=(backend, load_tokenizer(path), path))
    assert played.results == ref["results"] and played.failed == 0
    assert 0 < sum(played.results) < 40, "a real model: some right, some wrong"
