"""The run folder, `<runs_dir>/<run>/`: every path in it, and the one reader of the trainers' metrics files.

What it is: as `jet.keys` owns the Redis key names of a run, `RunDir` owns its files; every module that
writes or reads one asks it for the path:

    <runs_dir>/<run>/
      config.resolved.yaml            the config every role of the run loaded (jet up, jet study)
      logs/<role>.log                 each role's output under jet up
      trainer/<model>/metrics.jsonl   one JSON line per optimiser step (jet.trainer.metrics writes it)
      trainer/<model>/eval.jsonl      one JSON line per evaluated weight version (the evaluator writes it)
      trainer/<model>/tensorboard/    TensorBoard events (trainer.loggers)
      trainer/<model>/plots/          jet plot's PNGs
      trainer/<model>/checkpoints/    jet.trainer.checkpoint
      trainer/<model>/ledger/         the trainer's exactly-once ledger
      weights/<model>/v<N>/           published weight version N (jet.trainer.weights)

`MetricsFile` follows a metrics file as it grows: each `refresh()` parses only the bytes appended since
the last one, and notices a file that was truncated, replaced or rewritten in place (a resumed trainer
drops the lines of the steps it lost): it then starts a new `epoch` and reads the file again from
its start. A torn last line (the trainer writing, or killed mid-line) is read once it is complete; a
garbled line is skipped. `read_metrics(path)` is the one-shot read. `jet dash`, `jet up`'s summary,
`jet study`, `jet plot` and the trainer's own loggers read metrics through these two.

What it is not: a writer (the trainer's `jet.trainer.metrics.Metrics` appends the lines), and no torch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import orjson

RESOLVED_CONFIG = "config.resolved.yaml"
METRICS = "metrics.jsonl"
EVALS = "eval.jsonl"
_VERSION = re.compile(r"v(\d+)")


class RunDir:
    """The paths of one run's folder (nothing is created here but by `mkdir` callers)."""

    def __init__(self, runs_dir: str | os.PathLike, run: str):
        self.runs_dir, self.run = Path(runs_dir), run
        self.root = self.runs_dir / run

    @classmethod
    def of(cls, cfg) -> RunDir:
        """The folder of a JetConfig's run."""
        return cls(cfg.runs_dir, cfg.run)

    @classmethod
    def at(cls, root: str | os.PathLike) -> RunDir:
        """The run whose folder is `root`."""
        root = Path(root)
        return cls(root.parent, root.name)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    # -- the run
    @property
    def resolved_config(self) -> Path:
        return self.root / RESOLVED_CONFIG

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, role: str) -> Path:
        return self.logs / f"{role}.log"

    def exists(self) -> bool:
        """Whether this looks like a run folder (a trainer's folder or a resolved config in it)."""
        return (self.root / "trainer").is_dir() or self.resolved_config.is_file()

    # -- a model's trainer
    def trainer(self, model: str) -> Path:
        return self.root / "trainer" / model

    def trainer_files(self, model: str) -> TrainerFiles:
        return TrainerFiles(self.trainer(model))

    def metrics(self, model: str) -> Path:
        return self.trainer_files(model).metrics

    def evals(self, model: str) -> Path:
        """The evaluator's rows of `model`: one per evaluated weight version (`eval/<task>/...` metrics)."""
        return self.trainer_files(model).evals

    def trained_models(self) -> list[str]:
        """The models with a metrics file (or an evaluator's file: a node that only evaluates), sorted."""
        found = [*(self.root / "trainer").glob(f"*/{METRICS}"), *(self.root / "trainer").glob(f"*/{EVALS}")]
        return sorted({p.parent.name for p in found})

    # -- published weights
    def weights(self, model: str) -> Path:
        return self.root / "weights" / model

    def weight_version(self, model: str, version: int) -> Path:
        return self.weights(model) / f"v{version}"

    def versions(self, model: str) -> list[int]:
        """The versions N with a `v<N>` folder, oldest first."""
        root = self.weights(model)
        names = [d.name for d in root.iterdir() if d.is_dir()] if root.is_dir() else []
        return sorted(int(m.group(1)) for n in names if (m := _VERSION.fullmatch(n)))


class TrainerFiles:
    """The files of one model's trainer folder, `<run>/trainer/<model>/` (or any folder a trainer is
    given: the tests and `jet.trainer.metrics.Metrics` use bare folders)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def evals(self) -> Path:
        return self.root / EVALS

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger"


def weight_version_of(path: str | os.PathLike) -> tuple[RunDir, str, int] | None:
    """(run, model, N) when `path` is a run's `weights/<model>/v<N>` folder, else None."""
    path = Path(path)
    m = _VERSION.fullmatch(path.name)
    if not m or path.parent.parent.name != "weights":
        return None
    return RunDir.at(path.parent.parent.parent), path.parent.name, int(m.group(1))


def metrics_files(where: str | os.PathLike) -> list[Path]:
    """The metrics files of a run folder (one per trained model), or `where` itself if it is one."""
    where = Path(where)
    if where.is_file():
        return [where]
    return [RunDir.at(where).metrics(m) for m in RunDir.at(where).trained_models()] + sorted(where.glob(METRICS))


def _row(line: bytes) -> dict | None:
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None  # a garbled or torn line (a crash mid-write, then a restart): skip it, keep the rest
    return row if isinstance(row, dict) else None


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Every complete, parseable line of a metrics file ([] when there is none)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    return [row for line in data[: data.rfind(b"\n") + 1].splitlines() if (row := _row(line)) is not None]


class MetricsFile:
    """A metrics file followed as it grows (see the module docstring)."""

    TAIL = 256  # bytes of the last parsed line kept to notice a rewrite in place

    def __init__(self, path: str | os.PathLike, keep_rows: bool = True):
        self.path, self.keep_rows = Path(path), keep_rows
        self.epoch = 0  # bumped each time the file is read from its start: first seen, truncated, replaced, rewritten
        self.rows: list[dict] = []  # the parsed lines of this epoch (only the last one without keep_rows)
        self._inode, self._offset, self._tail = -1, 0, b""

    def refresh(self) -> tuple[bool, list[dict]]:
        """(reset, the rows parsed now): `reset` when the file started over (a new epoch, `rows` cleared
        and read again from the start)."""
        try:
            st = os.stat(self.path)
            f = open(self.path, "rb")
        except FileNotFoundError:
            return False, []
        with f:
            reset = False
            if st.st_ino != self._inode or st.st_size < self._offset or not self._same_tail(f):
                reset = self._inode != -1  # (the first open is a start, not a reset)
                self._inode, self._offset, self._tail, self.rows = st.st_ino, 0, b"", []
                self.epoch += 1
            if st.st_size == self._offset:
                return reset, []
            f.seek(self._offset)
            chunk = f.read(st.st_size - self._offset)
        end = chunk.rfind(b"\n") + 1  # only whole lines
        lines = chunk[:end].splitlines()
        new = [row for line in lines if (row := _row(line)) is not None]
        if lines:
            self._tail = lines[-1][-self.TAIL:] + b"\n"
        self._offset += end
        if self.keep_rows:
            self.rows.extend(new)
        elif new:
            self.rows = new[-1:]
        return reset, new

    def _same_tail(self, f) -> bool:
        """Whether the bytes before the offset are still the line parsed last (a resumed trainer rewrites
        the file in place: same inode, and maybe no shorter by the time we look)."""
        if not self._tail:
            return True
        f.seek(self._offset - len(self._tail))
        return f.read(len(self._tail)) == self._tail

    @property
    def last(self) -> dict:
        """The last parsed line ({} before the first)."""
        return self.rows[-1] if self.rows else {}
