"""The framework tasks trained by a short `jet up` (docs/gateway.md): LangChain ("units"), the OpenAI Agents SDK on
the Responses API and on chat completions ("lookup"), plain httpx ("spell"), each its own task of one run on
the random tiny model: real role processes (inference, env worker with its embedded gateway, trainer), a few
optimiser steps, every task's trajectories holding tokens recorded through the gateway and trained on, a
finite loss at every step, and published weights that differ from the initial model's in every tensor
(where a step had a gradient).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch
import yaml
from safetensors.torch import load_file

from jet.queues import codec
from jet.queues.connect import connect
from jet.wire import WeightVersion
from tests.workers.conftest import MODEL, trajectories
from tests.workers.test_arith import long_model  # noqa: F401 - a fixture

TASKS = {  # task: (workflow, dataset)
    "langchain": ("jet.tasks.units:workflow", "units"),
    "agents-responses": ("jet.tasks.lookup:workflow", "lookup"),
    "agents-chat": ("jet.tasks.lookup:chat_workflow", "lookup"),
    "httpx": ("jet.tasks.spell:workflow", "spell"),
}
STEPS = 2


@pytest.mark.slow
def test_jet_up_trains_every_framework_task(redis_url, keys, tmp_path, long_model):
    tasks = [{"name": name, "workflow": wf, "dataset": data, "group_size": 2, "concurrency": 4, "max_retries": 1,
              "episode_timeout_s": 60} for name, (wf, data) in TASKS.items()]
    cfg = {"run": keys.run, "runs_dir": str(tmp_path / "runs"),
           "queues": {"lease_ms": 10000, "block_ms": 500},
           "models": [{"name": MODEL, "path": str(long_model), "max_batch": 16}], "tasks": tasks,
           "trainer": {"lr": 1e-3, "batch_groups": len(TASKS), "steps": STEPS, "min_group_size": 1,
                       "micro_batch_tokens": 4096, "max_staleness": 100, "checkpoint_every": 100, "mix_wait_s": 60}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "jet.cli", "up", "--config", str(path), "--no-live",
                          "--redis-url", redis_url, "--run-dir", str(tmp_path / ".jet")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    logs = tmp_path / "runs" / keys.run / "logs"
    shown = res.stderr[-3000:] + "".join(f"\n--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(logs.glob("*.log")))
    assert res.returncode == 0, shown
    metrics = [json.loads(line) for line in
               (tmp_path / "runs" / keys.run / "trainer" / MODEL / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == STEPS, shown
    trajs = anyio.run(trajectories, redis_url, keys)
    for name in TASKS:
        mine = [t for t in trajs if t.task == name and not t.failed]
        assert mine, (name, [t.error for t in trajs if t.task == name])
        for t in mine:  # tokens recorded through the gateway: calls, samples, trained tokens
            assert t.meta["calls"] > 0 and t.samples, (name, t.meta)
            assert all(len(s.tokens) > 0 and sum(s.mask) > 0 for s in t.samples)
        assert sum(m.get(f"train/{name}/groups", 0) for m in metrics[-1:]) > 0, (name, metrics[-1])
    # Trained: every step has a finite loss, and the weights the trainer published last (one version per
    # step) differ from the initial model's in every tensor, where a step had a gradient. On the random
    # model a group of 2 often scores alike (both 0), so now and then every group of both steps carries
    # no signal (`rollout/no_signal_frac` 1, `train/grad_norm` 0): with no gradient ever, the optimiser
    # has no momentum either, so the weights must not move at all.
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1)), metrics
    assert all(math.isfinite(m["train/loss"]) for m in steps), steps
    announced = anyio.run(weight_versions, redis_url, keys)
    assert [(w.version, w.step) for w in announced][-1] == (STEPS, STEPS), announced
    before = load_file(long_model / "model.safetensors")
    after = load_file(Path(announced[-1].path) / "model.safetensors")
    assert set(after) <= set(before) and after, (sorted(before), sorted(after))
    unchanged = [n for n in after if torch.equal(after[n], before[n])]
    signal = [(m["step"], m["rollout/no_signal_frac"], m["train/grad_norm"]) for m in steps]
    if any(grad > 0 for _, _, grad in signal):
        assert unchanged == [], ("tensors the training did not change", unchanged, signal)
    else:
        assert all(frac == 1 for _, frac, _ in signal) and set(unchanged) == set(after), (unchanged, signal)


async def weight_versions(url, keys) -> list[WeightVersion]:
    r = await connect(url)
    try:
        return [WeightVersion.from_payload(codec.decode(f)) for _, f in await r.xrange(keys.weights(MODEL))]
    finally:
        await r.aclose()
