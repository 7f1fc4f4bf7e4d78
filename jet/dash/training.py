"""Training curves for `jet dash` and `jet up`: the trainers' metrics files, read as they grow.

What it is: `Curves` follows every `runs/<run>/trainer/<model>/metrics.jsonl`
(the trainer's `jet.trainer.metrics` file) and keeps each metric as a column
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

import orjson

FILE = "metrics.jsonl"  # jet.trainer.metrics.FILE; not imported, so jet.dash never imports the trainer


@dataclass
class Series:
    rows: array = field(default_factory=lambda: array("q"))  # index of the line the point came from
    steps: array = field(default_factory=lambda: array("d"))
    values: array = field(default_factory=lambda: array("d"))


@dataclass
class _File:
    path: Path
    inode: int = -1
    offset: int = 0  # bytes parsed
    lines: int = 0  # complete lines parsed
    epoch: int = 0
    series: dict[str, Series] = field(default_factory=dict)
    first_time: float | None = None
    last: dict = field(default_factory=dict)  # the last line, whole
    tail: bytes = b""  # the last parsed line's bytes, to notice a file rewritten in place

    def refresh(self) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return
        with open(self.path, "rb") as f:
            if st.st_ino != self.inode or st.st_size < self.offset or not self._same_tail(f):
                self.inode, self.offset, self.lines, self.series, self.last = st.st_ino, 0, 0, {}, {}
                self.first_time, self.tail, self.epoch = None, b"", self.epoch + 1
            if st.st_size == self.offset:
                return
            f.seek(self.offset)
            chunk = f.read(st.st_size - self.offset)
        end = chunk.rfind(b"\n") + 1  # only whole lines
        lines = chunk[:end].splitlines()
        for line in lines:
            self._add(line)
        if lines:
            self.tail = lines[-1][-256:] + b"\n"
        self.offset += end

    def _same_tail(self, f) -> bool:
        """Whether the bytes before `offset` are still the line parsed last (a resumed trainer
        rewrites the file in place: same inode, maybe no shorter by the time we look)."""
        if not self.tail:
            return True
        f.seek(self.offset - len(self.tail))
        return f.read(len(self.tail)) == self.tail

    def _add(self, line: bytes) -> None:
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            return  # a garbled line (a crash mid-write, then a restart): skip it, keep the rest
        if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
            return
        step, n = float(row["step"]), self.lines
        self.lines += 1
        self.last = row
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
        return sorted(p.parent.name for p in (self.runs_dir / run / "trainer").glob(f"*/{FILE}"))

    def file(self, run: str, model: str) -> _File:
        with self._lock:
            return self._file(run, model)

    def _file(self, run: str, model: str) -> _File:
        key = (run, model)
        f = self._files.get(key)
        if f is None:
            f = self._files[key] = _File(self.runs_dir / run / "trainer" / model / FILE)
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
