"""`scripts/gpu-check.sh` and `jet bench gpu`, run as far as a CPU allows.

No GPU is available where this suite runs, so this runs the script with
`--cpu` (a tiny Qwen2 shape, the process group on gloo, installs skipped):
the same phases and code paths as on a GPU (the hf backend generating with
top_p 0.9, a bf16-autocast torch-backend step, a one-process DeepSpeed
ZeRO-2 bf16 step whose rows and plan go through `jet.trainer.dist.Comm`'s
collectives), and the same report. What it cannot check: CUDA itself, nccl,
and the figures; MFU is not computed on a CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jet.bench.gpu import QWEN2_05B, matmul_params

ROOT = Path(__file__).resolve().parents[2]


def test_the_real_shape_is_qwen2_05b():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    assert round(matmul_params(QWEN2_05B) / 1e6) == 494  # Qwen2-0.5B's published parameter count
    small = {**QWEN2_05B, "num_hidden_layers": 1, "vocab_size": 1024}
    with __import__("torch").device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**small))
    assert matmul_params(small) == sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_gpu_check_runs_every_phase_on_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "JET_GPU_CHECK_NO_INSTALL": "1", "TMPDIR": str(tmp_path),
           "JET_GPU_CHECK_LIMIT_S": "500"}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--", "--cpu", "--steps", "1", "--json"],
                         env=env, capture_output=True, text=True, timeout=560)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = out.stdout.splitlines()
    report = json.loads("\n".join(lines[lines.index("{"):]))
    assert report["device"] == "cpu" and report["generate"]["tokens"] > 0
    assert [r["backend"] for r in report["train"]] == ["torch", "deepspeed"]
    for r in report["train"]:
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["rows_per_step"] >= 1 and "mfu" not in r
