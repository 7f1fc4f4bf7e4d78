"""Metrics JSONL (resume drops the lost steps' lines), `jet plot` PNGs, and `jet train` usage errors."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from jet.runs import read_metrics as read
from jet.trainer.cli import plot, train
from jet.trainer.metrics import Metrics


def test_resume_drops_lines_past_the_checkpoint_and_a_torn_line(tmp_path):
    m = Metrics(tmp_path)
    for step in range(1, 6):
        m.log(step, {"train/loss": 1.0 / step, "rollout/reward_mean": step / 10, "bad": float("nan")})
    m.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "train/lo')  # a process killed mid-line
    Metrics(tmp_path, resume_step=3).close()
    rows = read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and "bad" not in rows[0]
    Metrics(tmp_path, resume_step=0).close()  # a fresh start keeps nothing
    assert read(tmp_path / "metrics.jsonl") == []


@pytest.mark.slow  # matplotlib runs fc-list the first time it builds its font cache
def test_jet_plot_writes_the_four_curves(tmp_path):
    run = tmp_path / "runs" / "demo"
    m = Metrics(run / "trainer" / "tiny")
    for step in range(1, 4):
        m.log(step, {"train/loss": 1.0 / step, "rollout/reward_mean": step, "policy/staleness": 1,
                     "perf/steps_per_min": 60.0})
    m.close()
    result = CliRunner().invoke(plot, [str(run)])
    assert result.exit_code == 0, result.output
    written = result.output.split()
    assert sorted(p.rsplit("/", 1)[1] for p in written) == ["loss.png", "reward.png", "staleness.png",
                                                             "throughput.png"]
    for p in written:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert CliRunner().invoke(plot, [str(tmp_path)]).exit_code != 0  # no metrics there


def test_jet_train_names_the_trainable_models(tmp_path, tiny_model):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"models": [{"name": "a", "path": str(tiny_model)},
                                           {"name": "b", "path": str(tiny_model), "trainable": False}]}))
    result = CliRunner().invoke(train, ["--config", str(path), "--model", "b", "--redis-url", "redis://x"])
    assert result.exit_code == 2 and "'b' is not a trainable model; trainable: ['a']" in result.output
    bad = CliRunner().invoke(train, ["--config", str(path), "--set", "trainer.lr=fast", "--redis-url", "redis://x"])
    assert bad.exit_code == 1 and "trainer.lr: expected float, got 'fast'" in bad.output


@pytest.mark.slow
def test_the_trainer_cli_starts_quickly_without_torch():
    code = "import sys, jet.trainer.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_tensorboard_mirrors_the_jsonl_and_hides_lost_steps_on_resume(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    m = Metrics(tmp_path)
    for step in range(1, 6):
        m.log(step, {"train/loss": 1.0 / step, "rollout/reward_mean": step / 10})
    m.close()
    # TensorBoard reads a folder's event files in name order: time (s), host, pid, then a per-process
    # counter, which sorts "10" before "9". A resumed trainer is a later process; in one process (pytest
    # workers have made other writers) the second file must at least start in a later second.
    time.sleep(1.05)
    m = Metrics(tmp_path, resume_step=3)  # steps 4 and 5 were lost with the process and are trained again
    for step in (4, 5):
        m.log(step, {"train/loss": 10.0 * step, "rollout/reward_mean": 1.0})
    m.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/loss", "rollout/reward_mean"}
    loss = [(e.step, round(e.value, 6)) for e in acc.Scalars("train/loss")]
    assert loss == [(1, 1.0), (2, 0.5), (3, round(1 / 3, 6)), (4, 40.0), (5, 50.0)]
    assert [e.value for e in acc.Scalars("rollout/reward_mean")][3:] == [1.0, 1.0]
