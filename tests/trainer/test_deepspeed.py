"""DeepSpeed ZeRO with 2 processes on CPU (gloo) trains like the torch backend.

The same trajectories go to two runs: `jet train` with the torch backend, and
`jet train --backend deepspeed --nproc 2` (ZeRO-2, then ZeRO-3), each through
the whole trainer (Redis, rank 0 broadcasting the rows, each rank its share,
checkpoints, weight publication). Per step, the loss must match the torch
backend's to rtol 1e-4 (float32 sums in a different order across ranks) and
the gradient norm to rtol 1e-3; steps 2 and 3 check the optimiser update too,
since their losses depend on it. Every trajectory is trained exactly once.
With a LoRA adapter (`models[].adapter`) too: the same match against the torch
backend training the same adapter, checkpoints without the frozen base, and
versions that are the adapter alone.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from jet.keys import Keys
from jet.runs import read_metrics as read
from jet.trainer.groups import no_signal
from tests.trainer.helpers import MODEL
from tests.trainer.rollouts import produce_sync, stream_state, synthetic_group, write_config

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def deepspeed_runs() -> str | None:
    """Why DeepSpeed cannot run here, or None."""
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: skip with the reason
        return f"deepspeed does not import: {type(e).__name__}: {e}"
    return None


def train(tmp_path: Path, url: str, tiny_model: Path, run: str, *extra: str, adapter: dict | None = None) -> list[dict]:
    rng = random.Random(7)
    trajs = [t for g in range(2 * STEPS) for t in synthetic_group(f"g{g}", 3, rng)]
    keys = Keys(run)
    produce_sync(url, keys, trajs)
    # each sample on its own (no group trees): 3 rows a step, so one rank of two runs a padding micro-batch
    config = write_config(tmp_path / f"{run}.yaml", run, tiny_model, tmp_path / "runs", adapter, steps=STEPS,
                          checkpoint_every=2, kl_coef=0.05, micro_batch_tokens=40, lr=1e-3, prefix_trees=False)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JET_LOG_LEVEL": "WARNING"}
    out = subprocess.run([sys.executable, "-m", "jet.trainer.cli", "--config", str(config), "--redis-url", url,
                          *extra], env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    import anyio

    assert anyio.run(stream_state, url, keys)["pending"] == 0
    rows = read(tmp_path / "runs" / run / "trainer" / MODEL / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["counts/trained"] == 6 * r["step"] for r in rows)
    # every group trained once: the steps' groups without an advantage signal are the workload's
    quiet = sum(no_signal([t.reward for t in trajs[i:i + 3]]) for i in range(0, len(trajs), 3))
    assert sum(round(r["rollout/no_signal_frac"] * r["rollout/groups"]) for r in rows) == quiet
    return rows


ADAPTER = {"r": 4, "alpha": 8.0}


@pytest.fixture(scope="module")
def torch_runs(tiny_model, redis_url, tmp_path_factory) -> dict:
    """The torch backend's metrics on the workload, full and with an adapter (each once for every stage)."""
    if deepspeed_runs():
        pytest.skip(deepspeed_runs())
    runs = {}

    def run(lora: bool) -> list[dict]:
        if lora not in runs:
            runs[lora] = train(tmp_path_factory.mktemp("torch"), redis_url, tiny_model, f"t{uuid.uuid4().hex[:10]}",
                               adapter=ADAPTER if lora else None)
        return runs[lora]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("stage,lora", [(2, False), (3, False), (2, True)], ids=["zero2", "zero3", "zero2-adapter"])
def test_deepspeed_two_ranks_match_the_torch_backend(stage, lora, torch_runs, tiny_model, redis_url, keys, tmp_path):
    base = torch_runs(lora)
    ds = train(tmp_path, redis_url, tiny_model, f"{keys.run}d", "--backend", "deepspeed", "--nproc", "2",
               "--set", f"trainer.zero_stage={stage}", adapter=ADAPTER if lora else None)
    for a, b in zip(base, ds):
        assert b["train/micro_batches"] == a["train/micro_batches"] == 3, "3 rows: one rank runs a padding micro-batch"
        assert b["train/tokens"] == a["train/tokens"]
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4, abs=1e-7), a["step"]
        assert b["train/kl"] == pytest.approx(a["train/kl"], rel=1e-3, abs=1e-8), a["step"]
        assert b["train/entropy"] == pytest.approx(a["train/entropy"], rel=1e-4), a["step"]  # summed over ranks
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-3), a["step"]
    assert ds[-1]["policy/version"] == STEPS
    ckpt = tmp_path / "runs" / f"{keys.run}d" / "trainer" / MODEL / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002", "step-00000003"]
    if lora:  # the checkpoint leaves the base out; the versions are the adapter alone
        from jet import adapters

        size = sum(f.stat().st_size for f in (ckpt / "step-00000003").rglob("*") if f.is_file())
        assert size < (tiny_model / "model.safetensors").stat().st_size, "no frozen base in the checkpoint"
        assert adapters.is_adapter(tmp_path / "runs" / f"{keys.run}d" / "weights" / MODEL / f"v{STEPS}")
        # a restart resumes from the adapter checkpoint (the base from the model folder) and trains on;
        # a checkpoint of another adapter shape is refused with the reason
        rng = random.Random(8)
        produce_sync(redis_url, Keys(f"{keys.run}d"), [t for g in range(2) for t in synthetic_group(f"h{g}", 3, rng)])
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JET_LOG_LEVEL": "WARNING"}
        argv = [sys.executable, "-m", "jet.trainer.cli", "--config", str(tmp_path / f"{keys.run}d.yaml"),
                "--redis-url", redis_url, "--backend", "deepspeed", "--nproc", "2"]
        wrong = subprocess.run(argv + ["--set", "models.0.adapter.r=2"], env=env, capture_output=True, text=True,
                               timeout=400)
        assert wrong.returncode != 0 and "was written with adapter" in wrong.stdout + wrong.stderr
        out = subprocess.run(argv + ["--set", f"trainer.steps={STEPS + 1}"], env=env, capture_output=True,
                             text=True, timeout=400)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        rows = read(tmp_path / "runs" / f"{keys.run}d" / "trainer" / MODEL / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(1, STEPS + 2)) and rows[-1]["counts/trained"] == 6 * (STEPS + 1)
