"""trainer.loggers: W&B (offline) and MLflow (local file store) get every step, and a resumed trainer
continues the same W&B and MLflow runs. What was logged is read back from the files they wrote."""

from __future__ import annotations

import json
import os
import random
import signal
import struct
from pathlib import Path

import pytest

from jet.config import load_file
from jet.runs import read_metrics as read
from jet.trainer.metrics import Metrics
from tests.trainer.helpers import MODEL
from tests.trainer.rollouts import produce_sync, synthetic_group, write_config
from tests.trainer.test_trainer_redis import signal_at_step, start_trainer, trainer_dir

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

ALL = ["jsonl", "tensorboard", "wandb", "mlflow"]


def wandb_records(path: Path):
    """The protobuf Records of a W&B transaction log (`run-<id>.wandb`): a 7-byte header (`:W&B`,
    magic, version), then LevelDB-log chunks in 32 KiB blocks (crc32c 4, length 2, type 1: full,
    first, middle, last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            yield rec


def wandb_runs(folder: Path) -> list[dict]:
    """Per offline run folder (in start order): its run id, config keys and the history rows logged."""
    out = []
    for run_dir in sorted((folder / "wandb").glob("offline-run-*")):
        [log] = run_dir.glob("run-*.wandb")
        info = {"id": None, "config": set(), "history": []}
        for rec in wandb_records(log):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                info["id"] = rec.run.run_id
                info["config"] |= {item.key for item in rec.run.config.update}
            elif kind == "history":
                info["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                        for item in rec.history.item})
        out.append(info)
    return out


def mlflow_history(folder: Path, metric: str) -> tuple[str, list[tuple[int, float]], str]:
    from unittest import mock

    from mlflow.tracking import MlflowClient

    run_id = json.loads((folder / "loggers.json").read_text())["mlflow"]
    with mock.patch.dict(os.environ, {"MLFLOW_ALLOW_FILE_STORE": "true"}):  # MLflow 3 wants the opt-in
        client = MlflowClient(tracking_uri=(folder / "mlruns").resolve().as_uri())
        history = [(m.step, m.value) for m in client.get_metric_history(run_id, metric)]
        return run_id, sorted(history, key=lambda x: x[0]), client.get_run(run_id).info.status


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the sink opts in by itself (and is undone)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)


@pytest.mark.slow
def test_every_logger_gets_the_steps_and_a_resume_continues_the_same_runs(tmp_path, offline):
    config = {"trainer": {"lr": 0.1}}
    m = Metrics(tmp_path, loggers=ALL, name="demo/tiny", config=config)
    for step in range(1, 6):
        m.log(step, {"train/loss": 1.0 / step, "rollout/reward_mean": step / 10})
    m.close()
    m = Metrics(tmp_path, resume_step=3, loggers=ALL, name="demo/tiny", config=config)
    for step in (4, 5, 6):
        m.log(step, {"train/loss": 10.0 * step, "rollout/reward_mean": 1.0})
    m.close()
    assert [r["step"] for r in read(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    ids = json.loads((tmp_path / "loggers.json").read_text())
    first, second = wandb_runs(tmp_path)
    assert first["id"] == second["id"] == ids["wandb"], "the resumed trainer continues the same W&B run"
    assert ids["wandb_closed"] == 6  # closed cleanly both times: nothing to log again
    assert "trainer" in first["config"]
    loss = lambda run: [(h["trainer/step"], h["train/loss"]) for h in run["history"] if "train/loss" in h]
    assert loss(first) == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3)), (4, 0.25), (5, 0.2)]
    assert loss(second) == [(4, 40.0), (5, 50.0), (6, 60.0)]
    run_id, history, status = mlflow_history(tmp_path, "train/loss")
    assert run_id == ids["mlflow"] and status == "FINISHED"
    assert [s for s, _ in history] == [1, 2, 3, 4, 4, 5, 5, 6] and (6, 60.0) in history and (4, 0.25) in history


def test_loggers_can_be_left_out_and_a_missing_package_is_a_clear_error(tmp_path, offline, monkeypatch):
    m = Metrics(tmp_path, loggers=["mlflow"], name="demo/tiny")
    m.log(1, {"train/loss": 2.0, "counts/groups": 3, "counts/groups/guess": 2})  # a name and its sub-name
    m.close()
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tensorboard").exists()
    assert mlflow_history(tmp_path, "train/loss")[1] == [(1, 2.0)]
    assert mlflow_history(tmp_path, "counts/groups.guess")[1] == [(1, 2.0)]
    import sys

    from jet.errors import ConfigError

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"'wandb' needs the wandb package"):
        Metrics(tmp_path / "other", loggers=["jsonl", "wandb"])


@pytest.mark.slow
def test_a_sigkilled_trainer_resumes_into_the_same_wandb_and_mlflow_runs(tiny_model, redis_url, keys, tmp_path,
                                                                        offline, monkeypatch):
    # wandb keeps its service's address in os.environ (WANDB_SERVICE) for child processes: the earlier
    # tests' service would be shared by both trainers and still hold the killed one's run
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    rng = random.Random(3)
    config = write_config(tmp_path / "c.yaml", keys.run, tiny_model, tmp_path / "runs", steps=6,
                          checkpoint_every=3, batch_groups=2, loggers=["jsonl", "wandb", "mlflow"],
                          resume="checkpoint")  # step 4 is lost, so W&B gets it twice
    cfg = load_file(config)
    log = tmp_path / "trainer.log"
    produce_sync(redis_url, keys, [t for g in range(8) for t in synthetic_group(f"a{g}", 2, rng)])
    signal_at_step(config, redis_url, log, cfg, 4, signal.SIGKILL, 10)  # step 4 is lost (checkpoint at 3)
    produce_sync(redis_url, keys, [t for g in range(4) for t in synthetic_group(f"b{g}", 2, rng)])
    proc = start_trainer(config, redis_url, log)
    try:
        assert proc.wait(180) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
    folder = trainer_dir(cfg)
    runs = wandb_runs(folder)
    ids = json.loads((folder / "loggers.json").read_text())
    assert len(runs) == 2 and runs[1]["id"] == ids["wandb"], "the restart continues the same W&B run"
    assert runs[0]["id"] in (None, ids["wandb"])  # None: W&B's buffer died with the SIGKILLed process
    steps = [[h["trainer/step"] for h in r["history"] if "train/loss" in h] for r in runs]
    assert steps[1][-3:] == [4, 5, 6], "the restart redoes step 4, then goes on"
    assert {1, 2, 3} <= set(steps[0]) | set(steps[1]), "the checkpointed steps are in W&B, lost buffer or not"
    assert ids["wandb_closed"] == 6
    run_id, history, status = mlflow_history(folder, "rollout/reward_mean")
    assert status == "FINISHED" and sorted({s for s, _ in history}) == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in history].count(4) == 2
    assert [r["step"] for r in read(folder / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert MODEL in str(folder)
