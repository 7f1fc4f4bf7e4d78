"""Trainer metrics: one JSONL line per step in the run folder, TensorBoard when installed, PNG plots.

What it is: `Metrics(folder)` appends `{"step", "time", <name>: value, ...}`
lines to `metrics.jsonl` (names are namespaced: `train/loss`,
`rollout/reward_mean`, `policy/staleness`, `queue/lag`, `perf/...`) and
mirrors them to TensorBoard (`tensorboard/`) when `torch.utils.tensorboard`
imports. On resume it first drops the lines of steps after the checkpoint it
resumed from: those steps were lost with the process and are trained again,
so the file describes the surviving lineage. `plot(folder)` (`jet plot`)
writes reward, loss, staleness and throughput curves as PNGs.

What it is not: logging (logs go through `logging`), and rank 0 only: other
ranks never construct it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Iterable

log = logging.getLogger(__name__)

FILE = "metrics.jsonl"

# PNG name -> (title, y label, metric names)
PLOTS = {
    "reward": ("Reward", "mean reward", ["rollout/reward_mean"]),
    "loss": ("Loss", "loss", ["train/loss", "train/kl"]),
    "staleness": ("Staleness", "versions behind", ["policy/staleness", "policy/staleness_max"]),
    "throughput": ("Throughput", "per second / busy fraction",
                   ["perf/tokens_per_s", "perf/steps_per_min", "perf/busy_fraction"]),
}


class Metrics:
    def __init__(self, folder: Path, resume_step: int | None = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / FILE
        if resume_step is not None:
            self._truncate(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")
        # purge_step hides TensorBoard events of the lost steps, as _truncate drops their JSONL lines
        self._tb = _tensorboard(self.folder / "tensorboard", None if resume_step is None else resume_step + 1)

    def log(self, step: int, values: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in values.items() if v is not None and math.isfinite(float(v))}
        self._file.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    def _truncate(self, step: int) -> None:
        if not self.path.is_file():
            return
        kept = [line for line in self.path.read_text().splitlines() if _step_of(line) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))


def _step_of(line: str) -> float:
    try:
        return json.loads(line).get("step", math.inf)
    except ValueError:
        return math.inf  # a torn last line of a killed process


def _tensorboard(folder: Path, purge_step: int | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch.utils.tensorboard needs the tensorboard package
        return None
    return SummaryWriter(str(folder), purge_step=purge_step)


def read(path: Path) -> list[dict]:
    """The parseable lines of a metrics file."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def find(run: Path) -> list[Path]:
    """Metrics files under a run folder (one per trained model), or `run` itself if it is one."""
    run = Path(run)
    if run.is_file():
        return [run]
    return sorted(run.glob(f"trainer/*/{FILE}")) + sorted(run.glob(FILE))


def plot(path: Path, out_dir: Path | None = None, names: Iterable[str] = PLOTS) -> list[Path]:
    """PNG curves of one metrics file; returns the files written (default: next to the metrics)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read(path)
    out_dir = Path(out_dir) if out_dir else Path(path).parent / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names:
        title, ylabel, keys = PLOTS[name]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), label=key)
        ax.set_title(title)
        ax.set_xlabel("optimiser step")
        ax.set_ylabel(ylabel)
        if ax.lines:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}.png", dpi=100)
        plt.close(fig)
        written.append(out_dir / f"{name}.png")
    return written
