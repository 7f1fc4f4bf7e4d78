"""The evaluator as `jet up` runs it: a role of its own beside the trainer, SIGKILLed mid-run (restarted,
no version evaluated twice, training never held back), the final version evaluated before `jet up`
ends, its results in eval.jsonl and drawn by `jet plot`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from jet.config import default_config_path
from jet.runs import RunDir, read_metrics

pytestmark = pytest.mark.slow


def evaluator_pids(config: Path) -> list[int]:
    """The evaluator processes of this test's `jet up` (by their command line)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"jet.workers.evaluator.worker" in argv and str(config).encode() in argv:
                found.append(int(entry))
    return found


def test_jet_up_evaluates_versions_beside_training_and_survives_a_killed_evaluator(tmp_path):
    rows = tmp_path / "held_out.jsonl"
    rows.write_text("".join(json.dumps({"secret": s, "low": 1, "high": 10, "max_turns": 2, "max_tokens": 4}) + "\n"
                            for s in (3, 7, 9)))
    cfg = yaml.safe_load(default_config_path().read_text())
    cfg |= {"run": "evalup", "runs_dir": str(tmp_path / "runs")}
    cfg["models"][0]["path"] = str(tmp_path / ".jet" / "models" / "tiny")
    cfg["tasks"][0] |= {"concurrency": 4, "eval": {"dataset": str(rows), "every": 3, "concurrency": 3}}
    cfg["trainer"] |= {"steps": 10, "batch_groups": 2}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "JET_REDIS_URL"}
    up = subprocess.Popen([sys.executable, "-m", "jet.cli", "up", "--config", str(config), "--no-live", "--no-dash",
                           "--run-dir", str(tmp_path / ".jet")], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    run = RunDir(tmp_path / "runs", "evalup")
    try:
        deadline = time.monotonic() + 240
        while not read_metrics(run.evals("tiny")):  # the base weights' result
            assert time.monotonic() < deadline and up.poll() is None, "no evaluation of the base weights"
            time.sleep(0.2)
        killed = evaluator_pids(config)
        assert killed, "the evaluator runs as its own process"
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        out, _ = up.communicate(timeout=400)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate()
    assert up.returncode == 0, out[-4000:]
    evals = read_metrics(run.evals("tiny"))
    versions = [e["version"] for e in evals]
    assert versions == sorted(set(versions)), f"a version evaluated twice, or out of order: {versions}"
    assert versions[0] == 0 and versions[-1] == 10 and evals[-1]["step"] == 10, versions  # the final version
    # every 3 versions at least; a restarted evaluator that finds the due one pruned takes the next it can
    assert all(b - a >= 3 for a, b in zip(versions, versions[1:]) if b != 10), versions
    assert all(e["eval/guess/n"] == 3 and 0 <= e["eval/guess/reward_mean"] <= 1 for e in evals)
    assert [r["step"] for r in read_metrics(run.metrics("tiny"))] == list(range(1, 11)), "training went on"
    assert "eval-tiny exited with -9; restarting" in run.log("eval-tiny").read_text() + out
    assert "held-out guess" in out, "jet up's summary shows the newest held-out result"
    assert (run.trainer("tiny") / "plots" / "eval.png").is_file()
