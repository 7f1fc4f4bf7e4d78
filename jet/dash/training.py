"""Training curves for `jet dash` and `jet up`: the trainers' metrics files, read as they grow.

What it is: `Curves` follows every `runs/<run>/trainer/<model>/metrics.jsonl`
(the trainer's `jet.trainer.metrics` file, read by `jet.runs.MetricsFile`) and keeps each metric as a column
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
    """One metrics file (`jet.runs.MetricsFile`) with each metric kept as a column."""

    def __init__(self, path: Path):
        self.follower = MetricsFile(path, keep_rows=False)  # the columns below hold the points
        self.lines = 0  # complete lines parsed in this epoch
        self.series: dict[str, Series] = {}
        self.first_time: float | None = None

    @property
    def epoch(self) -> int:
        return self.follower.epoch

    @property
    def last(self) -> dict:
        return self.follower.last

    def refresh(self) -> None:
        epoch = self.follower.epoch
        _, rows = self.follower.refresh()
        if self.follower.epoch != epoch:
            self.lines, self.series, self.first_time = 0, {}, None
        for row in rows:
            self._add(row)

    def _add(self, row: dict) -> None:
        if not isinstance(row.get("step"), (int, float)):
            return
        step, n = float(row["step"]), self.lines
        self.lines += 1
        if self.first_time is None and isinstance(row.get("time"), (int, float)):
            self.first_time = float(row["time"])
        for name, value in row.items():
            if name in ("step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
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
            f = self._files[key] = _File(RunDir(self.runs_dir, run).metrics(model))
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

    def started(self, run: str, model: str) -> float | None:
        return self.file(run, model).first_time
