"""A two-agent, two-model team trained in one run: the real roles (an inference worker per model, an env
worker, a trainer per model, each its own process, as `jet up` starts them) on a real Redis; and the same
team as two LoRA adapters of one base (configs/team-lora.yaml's layout), served by ONE inference worker.

The `propose` task has a proposer model pick a secret and a solver model guess it. Checked: each model's
weight version advances on its own (the models' own `trainer.steps` differ: 2 and 3), and traj:<model>
holds only that model's agent and tokens: the proposer's samples are its "Pick a number" turn, the
solver's its "Guess a number" game, never the other's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import anyio
import pytest
import yaml

from jet.cli.up import roles_for
from jet.config import load_file
from jet.models import init_model
from jet.queues import codec
from jet.queues.connect import connect
from jet.queues.producer import Producer
from jet.tasks import dataset
from jet.wire import Task, Trajectory, WeightVersion

ROOT = Path(__file__).resolve().parents[2]
STEPS = {"proposer": 2, "solver": 3}


def team_config(tmp_path: Path, run: str, lora: bool = False) -> Path:
    models = []
    for seed, name in enumerate(STEPS, start=1):
        folder = tmp_path / ("base" if lora else name)
        if not folder.exists():
            init_model(folder, vocab_size=512, hidden_size=32, layers=2, heads=4, kv_heads=2, max_position=256,
                       seed=seed)
        models.append({"name": name, "path": str(folder), "max_batch": 8,
                       "trainer": {"seed": seed, "steps": STEPS[name], **({"lr": 1e-2} if lora else {})},
                       **({"adapter": {"r": 4, "alpha": 8.0}} if lora else {})})
    data = {"run": run, "runs_dir": str(tmp_path / "runs"), "queues": {"block_ms": 200, "lease_ms": 3000},
            "models": models,
            "tasks": [{"name": "propose", "workflow": "jet.tasks.propose:workflow", "dataset": "propose",
                       "group_size": 2, "concurrency": 4, "episode_timeout_s": 60, "model": "solver"}],
            "trainer": {"lr": 1e-3, "batch_groups": 1, "micro_batch_tokens": 512, "max_staleness": 1000,
                        "checkpoint_every": 10, "group_timeout_s": 30, "lease_s": 60, "min_group_size": 2}}
    path = tmp_path / "team.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


async def enqueue(url, keys, rows):
    tasks = [Task("propose", row, group_id=f"g{i}", index=j, group_size=2) for i, row in enumerate(rows)
             for j in range(2)]
    r = await connect(url)
    try:
        await Producer(r, url, keys, keys.tasks("propose")).send([t.to_fields() for t in tasks])
    finally:
        await r.aclose()


async def snapshot(url, keys, seen: dict[str, dict[str, Trajectory]]) -> dict[str, list[WeightVersion]]:
    """Add every trajectory now in traj:<model> to `seen` (acked ones get trimmed: look often);
    return the weights announcements per model."""
    r = await connect(url)
    try:
        announced = {}
        for model in STEPS:
            for _, f in await r.xrange(keys.traj(model)):
                t = Trajectory.from_payload(codec.decode(f))
                seen[model][t.msg_id] = t
            announced[model] = [WeightVersion.from_payload(codec.decode(f))
                                for _, f in await r.xrange(keys.weights(model))]
        return announced
    finally:
        await r.aclose()


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["two-models", "adapters-of-one-base"])
def test_two_models_train_at_once_each_on_its_own_agent(redis_url, keys, tmp_path, lora):
    config = team_config(tmp_path, keys.run, lora)
    cfg = load_file(config)
    anyio.run(enqueue, redis_url, keys, dataset("propose", 5, seed=0))  # 3 groups needed, 2 spare
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JET_REDIS_URL": redis_url, "JET_LOG_LEVEL": "INFO"}
    procs = {}
    for role in roles_for(cfg, str(config), (), 1):
        # at the end, episodes in flight are not worth waiting for
        argv = role.argv + (["--drain-timeout", "2"] if role.name == "env" else [])
        log = open(tmp_path / f"{role.name}.log", "wb")
        procs[role.name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    infer = ["infer-proposer+solver"] if lora else ["infer-proposer", "infer-solver"]
    assert sorted(procs) == ["env", *infer, "train-proposer", "train-solver"]
    seen: dict[str, dict[str, Trajectory]] = {m: {} for m in STEPS}
    try:
        deadline = time.monotonic() + 120
        while any(procs[f"train-{m}"].poll() is None for m in STEPS):
            for name, p in procs.items():
                assert p.poll() in (None, 0), f"{name} exited {p.returncode}:\n" + \
                    (tmp_path / f"{name}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "trainers did not finish:\n" + \
                "\n".join((tmp_path / f"train-{m}.log").read_text()[-1500:] for m in STEPS)
            anyio.run(snapshot, redis_url, keys, seen)
            time.sleep(0.3)
        announced = anyio.run(snapshot, redis_url, keys, seen)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    # each model's version advanced on its own, to its own trainer's step count
    for model, steps in STEPS.items():
        assert procs[f"train-{model}"].returncode == 0
        assert [w.version for w in announced[model]] == list(range(1, steps + 1)), model
        assert all(w.model == model and f"/{model}/" in w.path for w in announced[model])
        if lora:  # versions are adapters, and the one worker served each model's newest
            from jet import adapters

            assert adapters.is_adapter(announced[model][-1].path)
            log = (tmp_path / "infer-proposer+solver.log").read_text()
            assert f"{model}: now serving weight version {steps - 1}" in log or \
                f"{model}: now serving weight version {steps}" in log, log[-2000:]

    # each model's stream holds its own agent's samples and tokens only
    from transformers import AutoTokenizer

    for model, other in (("proposer", "solver"), ("solver", "proposer")):
        trajs = [t for t in seen[model].values() if not t.failed]
        assert len(trajs) >= 2 * STEPS[model], f"too few trajectories seen on traj:{model}"
        tok = AutoTokenizer.from_pretrained(cfg.model(model).path)
        for t in trajs:
            assert t.model == model and set(t.reward) >= {model}
            assert t.samples and all(s.model == model and tuple(s.agents) == (model,) for s in t.samples)
            text = "".join(tok.decode(s.tokens) for s in t.samples)
            mine, theirs = ("Pick a number", "Guess a number") if model == "proposer" else \
                ("Guess a number", "Pick a number")
            assert mine in text and theirs not in text, text
        # the episodes are the same ones: both models trained on one run of the team
        episodes = {t.episode_id for t in trajs}
        assert episodes & {t.episode_id for t in seen[other].values()}
