"""The run folder's owner (jet.runs): its paths, and MetricsFile following a metrics file."""

from __future__ import annotations

import json
import os

from jet.config import load
from jet.runs import MetricsFile, RunDir, TrainerFiles, metrics_files, read_metrics, weight_version_of


def line(step: int, **values) -> str:
    return json.dumps({"step": step, "time": 1000.0 + step, **values}) + "\n"


def test_paths_of_a_run(tmp_path):
    run = RunDir.of(load({"run": "demo", "runs_dir": str(tmp_path / "runs")}))
    assert run.root == tmp_path / "runs" / "demo"
    assert run.metrics("m") == run.root / "trainer" / "m" / "metrics.jsonl"
    assert run.trainer_files("m").checkpoints == run.root / "trainer" / "m" / "checkpoints"
    assert TrainerFiles(run.trainer("m")).ledger == run.root / "trainer" / "m" / "ledger"
    assert run.weight_version("m", 7) == run.root / "weights" / "m" / "v7"
    assert run.log("env") == run.root / "logs" / "env.log"
    assert not run.exists() and run.trained_models() == [] and run.versions("m") == []
    for v in (3, 10, 2):
        run.weight_version("m", v).mkdir(parents=True)
    (run.weights("m") / "v-junk").mkdir()
    assert run.versions("m") == [2, 3, 10]
    found = weight_version_of(run.weight_version("m", 10))
    assert found is not None and found[0].root == run.root and found[1:] == ("m", 10)
    assert weight_version_of(tmp_path / "v3") is None
    run.metrics("m").parent.mkdir(parents=True)
    run.metrics("m").write_text(line(1))
    assert run.exists() and run.trained_models() == ["m"]
    assert metrics_files(run.root) == [run.metrics("m")] and metrics_files(run.metrics("m")) == [run.metrics("m")]


def test_metrics_file_follows_growth_and_waits_for_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    f = MetricsFile(path)
    assert f.refresh() == (False, []) and f.last == {}  # no file yet
    path.write_text(line(1, loss=0.5) + line(2, loss=0.4) + '{"step": 3, "lo')
    reset, rows = f.refresh()
    assert not reset and [r["step"] for r in rows] == [1, 2] and f.epoch == 1
    with open(path, "a") as out:
        out.write('ss": 0.3}\n' + "garbage\n" + line(4))
    reset, rows = f.refresh()
    assert not reset and [r["step"] for r in rows] == [3, 4]  # the torn line once whole; garbage skipped
    assert [r["step"] for r in f.rows] == [1, 2, 3, 4] and f.last["step"] == 4
    assert f.refresh() == (False, [])
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]


def test_metrics_file_notices_truncation_replacement_and_a_rewrite_in_place(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(line(1) + line(2) + line(3))
    f = MetricsFile(path)
    f.refresh()
    path.write_text(line(1))  # a resumed trainer cut steps 2 and 3: shorter
    reset, rows = f.refresh()
    assert reset and [r["step"] for r in rows] == [1] and f.epoch == 2 and [r["step"] for r in f.rows] == [1]
    # rewritten in place, same inode, no shorter by the time it is read: the tail changed
    ino = os.stat(path).st_ino
    with open(path, "r+") as out:
        out.write(line(1, loss=9.0)[:-1].replace("1000.0", "1001.0") + "\n" + line(2, loss=8.0))
        out.truncate()
    assert os.stat(path).st_ino == ino
    reset, rows = f.refresh()
    assert reset and [r.get("loss") for r in rows] == [9.0, 8.0] and f.epoch == 3
    replaced = tmp_path / "new.jsonl"
    replaced.write_text(line(5))
    os.replace(replaced, path)  # another file under the name
    reset, rows = f.refresh()
    assert reset and [r["step"] for r in rows] == [5]


def test_keep_rows_false_keeps_only_the_last(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(line(1) + line(2))
    f = MetricsFile(path, keep_rows=False)
    reset, rows = f.refresh()
    assert [r["step"] for r in rows] == [1, 2] and f.rows == [rows[-1]] and f.last["step"] == 2
