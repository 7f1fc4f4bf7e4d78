"""Training curves for `jet dash` and `jet up`: the trainers' metrics files, read as they grow.

What it is: `Curves` follows every `runs/<run>/trainer/<model>/metrics.jsonl`
(the trainer's `jet.trainer.metrics` file, read by `jet.runs.MetricsFile`) and the evaluator's
`eval.jsonl` beside it (`jet.workers.evaluator`), and keeps each metric as a column
(step, value) in memory, reading only the bytes appended since the last look.
`since(model, epoch, offset)` returns the points of each series past a client's
last point, so a page that polls receives only new points.

Invariants: a file that shrank or was replaced (a resumed trainer drops the
lines of the steps it lost) starts a new `epoch`, and a client whose epoch is
older gets every point again; a torn last line (the trainer writing, or killed
mid-line) is not read until it is complete. No torch, no matplotlib.
"""

from __future__ import annotations

import bisect
import os
import threading
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from jet.runs import MetricsFile, RunDir


@dataclass
class Series:
    rows: array = field(default_factory=lambda: array("q"))  # index of the line the point came from
    steps: array = field(default_factory=lambda: array("d"))
    values: array = field(default_factory=lambda: array("d"))


class _File:
    """One model's metrics file (`jet.runs.MetricsFile`) with each metric kept as a column, and its
    evaluator's file (`eval.jsonl`: `eval/...` metrics per evaluated version, at that version's step) read
    into the same columns. Lines of both count as one sequence (`lines`), so a client's cursor covers both."""

    def __init__(self, path: Path, evals: Path | None = None):
        self.follower = MetricsFile(path, keep_rows=False)  # the columns below hold the points
        self.evals_path = evals
        self.evals = MetricsFile(evals, keep_rows=False) if evals else None
        self.epoch = 0  # bumped whenever either file started over: every column is read again
        self.lines = 0  # complete lines parsed in this epoch
        self.series: dict[str, Series] = {}
        self.first_time: float | None = None  # of the trainer's first line

    @property
    def last(self) -> dict:
        return self.follower.last

    def refresh(self) -> None:
        before = self._epochs()
        rows, evals = self._read()
        if self._epochs() != before:  # a file appeared or started over: every column again, both from the start
            self.follower = MetricsFile(self.follower.path, keep_rows=False)
            self.evals = MetricsFile(self.evals_path, keep_rows=False) if self.evals_path else None
            rows, evals = self._read()
            self.epoch += 1
            self.lines, self.series, self.first_time = 0, {}, None
        for row in rows:
            self._add(row)
        for row in evals:
            self._add(row, trainer=False)

    def _epochs(self) -> tuple[int, int]:
        return self.follower.epoch, self.evals.epoch if self.evals else 0

    def _read(self) -> tuple[list[dict], list[dict]]:
        return self.follower.refresh()[1], self.evals.refresh()[1] if self.evals else []

    def _add(self, row: dict, trainer: bool = True) -> None:
        if not isinstance(row.get("step"), (int, float)):
            return
        step, n = float(row["step"]), self.lines
        self.lines += 1
        if trainer and self.first_time is None and isinstance(row.get("time"), (int, float)):
            self.first_time = float(row["time"])
        for name, value in row.items():
            if name in ("step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not trainer and not name.startswith("eval/"):  # the evaluator's version, its times: not curves
                continue
            s = self.series.get(name)
            if s is None:
                s = self.series[name] = Series()
            s.rows.append(n)
            s.steps.append(step)
            s.values.append(float(value))


class Curves:
    """The metrics files of the runs under `runs_dir`, one `_File` per (run, model)."""

    def __init__(self, runs_dir: str | os.PathLike):
        self.runs_dir = Path(runs_dir)
        self._files: dict[tuple[str, str], _File] = {}
        self._lock = threading.Lock()  # pages read from worker threads

    def models(self, run: str) -> list[str]:
        return RunDir(self.runs_dir, run).trained_models()

    def file(self, run: str, model: str) -> _File:
        with self._lock:
            return self._file(run, model)

    def _file(self, run: str, model: str) -> _File:
        key = (run, model)
        f = self._files.get(key)
        if f is None:
            run_dir = RunDir(self.runs_dir, run)
            f = self._files[key] = _File(run_dir.metrics(model), run_dir.evals(model))
        f.refresh()
        return f

    def since(self, run: str, model: str, epoch: int = 0, lines: int = 0) -> dict:
        """{epoch, lines, reset, series: {name: [[step, value], ...]}}: the points from line `lines` on,
        or all of them when `epoch` is not the file's current one (`reset` true)."""
        with self._lock:
            f = self._file(run, model)
            reset = epoch != f.epoch
            start = 0 if reset else lines
            out: dict[str, list] = {}
            for name, s in f.series.items():
                i = bisect.bisect_left(s.rows, start)
                if i < len(s.rows):
                    out[name] = [[s.steps[j], s.values[j]] for j in range(i, len(s.rows))]
            return {"epoch": f.epoch, "lines": f.lines, "reset": reset, "series": out}

    def latest(self, run: str, model: str) -> dict:
        """The last metrics line of a model's trainer ({} before its first step)."""
        with self._lock:
            return dict(self._file(run, model).last)

    def values(self, run: str, model: str, name: str) -> list[float]:
        with self._lock:
            s = self._file(run, model).series.get(name)
            return list(s.values) if s else []

    def held_out(self, run: str, model: str) -> dict[str, tuple[float, float]]:
        """{task: (step, result)} of the evaluator's newest held-out result per task ({} without evaluator)."""
        with self._lock:
            series = self._file(run, model).series
            return {name.split("/")[1]: (s.steps[-1], s.values[-1]) for name, s in series.items()
                    if name.startswith("eval/") and name.endswith("/reward_mean") and len(s.values)}

    def started(self, run: str, model: str) -> float | None:
        return self.file(run, model).first_time
