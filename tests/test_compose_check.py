"""scripts/compose_check.py (the ledger check of scripts/compose-test.sh) passes a consistent ledger and
names each fault: an entry gone from the stream but in no ledger, an entry decided twice, a trajectory
trained twice. Run as the compose test runs it: `python -P - ledger` reading the script on stdin."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml

ROOT = Path(__file__).resolve().parents[1]


def check(app: Path, url: str, decided: list[dict]) -> subprocess.CompletedProcess:
    ledger = app / "runs" / json.loads((app / "run.json").read_text()) / "trainer" / "tiny" / "ledger"
    ledger.mkdir(parents=True, exist_ok=True)
    (ledger / "step-00000002.json").write_text(json.dumps(decided))
    env = {**os.environ, "JET_REDIS_URL": url, "JET_CONFIG": str(app / "c.yaml")}
    return subprocess.run([sys.executable, "-P", "-", "ledger"], stdin=open(ROOT / "scripts" / "compose_check.py"),
                          cwd=app, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_the_ledger_check_passes_a_whole_ledger_and_names_each_fault(tmp_path, redis_url, keys):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"run": keys.run, "runs_dir": str(tmp_path / "runs"),
                                                     "models": [{"name": "tiny", "path": str(tmp_path)}]}))
    (tmp_path / "run.json").write_text(json.dumps(keys.run))
    r = redis.Redis.from_url(redis_url)
    ids = [r.xadd(keys.traj("tiny"), {"x": "1"}).decode() for _ in range(4)]
    r.xdel(keys.traj("tiny"), ids[0], ids[1])  # decided and trimmed; ids[2:] still in the stream

    def rec(entry, msg):
        return {"entry": entry, "msg": msg, "outcome": "trained", "step": 1}

    ok = check(tmp_path, redis_url, [rec(ids[0], "a"), rec(ids[1], "b")])
    assert ok.returncode == 0 and "4 trajectories added, 2 decided" in ok.stdout, ok.stdout + ok.stderr
    lost = check(tmp_path, redis_url, [rec(ids[0], "a")])
    assert lost.returncode == 1 and "1 trajectories neither in the ledger nor in the stream" in lost.stdout
    twice = check(tmp_path, redis_url, [rec(ids[0], "a"), rec(ids[1], "b"), rec(ids[1], "b")])
    assert twice.returncode == 1 and f"entries decided twice: ['{ids[1]}']" in twice.stdout
    retrained = check(tmp_path, redis_url, [rec(ids[0], "a"), rec(ids[1], "a")])
    assert retrained.returncode == 1 and "trajectories trained twice: ['a']" in retrained.stdout
    assert "decided twice" not in retrained.stdout


@pytest.mark.slow
def test_the_step_check_counts_only_steps_trained_since_a_time(tmp_path, keys):
    """After the crash the compose test waits for steps the restarted trainer wrote, not the old lines."""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"run": keys.run, "runs_dir": str(tmp_path / "runs"),
                                                     "models": [{"name": "tiny", "path": str(tmp_path)}]}))
    folder = tmp_path / "runs" / keys.run / "trainer" / "tiny"
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time": t}) + "\n"
                                                  for s, t in [(12, 100.0), (13, 200.0), (11, 300.0)]))

    def step(*since: str) -> str:
        p = subprocess.run([sys.executable, "-P", "-", "step", *since], stdin=open(ROOT / "scripts" / "compose_check.py"),
                           cwd=tmp_path, env={**os.environ, "JET_CONFIG": str(tmp_path / "c.yaml")},
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()

    assert step() == "13" and step("250") == "11" and step("400") == "0"
