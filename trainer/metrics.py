"""Trainer metrics: one JSONL line per step in the run folder, other loggers, PNG plots.

What it is: `Metrics(folder)` appends `{"step", "time", <name>: value, ...}`
lines to `metrics.jsonl` (names are namespaced: `train/loss`,
`rollout/reward_mean`, `policy/staleness`, `queue/lag`, `perf/...`) and
mirrors them to the other `trainer.loggers` (TensorBoard in `tensorboard/`
when installed, W&B, MLflow: `jet.trainer.loggers`). On resume it first drops
the lines of steps after the checkpoint it resumed from: those steps were lost
with the process and are trained again, so the file describes the surviving
lineage. `plot(folder)` (`jet plot`) writes reward, loss, staleness and
throughput curves as PNGs, and the evaluator's held-out results (`eval.jsonl`) when there are any.

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

from jet.runs import RunDir, TrainerFiles, read_metrics

log = logging.getLogger(__name__)


# PNG name -> (title, y label, metric names)
PLOTS = {
    "reward": ("Reward", "mean reward", ["rollout/reward_mean"]),
    "loss": ("Loss", "loss", ["train/loss", "train/kl"]),
    "staleness": ("Staleness", "versions behind", ["policy/staleness", "policy/staleness_max"]),
    "throughput": ("Throughput", "per second / busy fraction",
                   ["perf/tokens_per_s", "perf/steps_per_min", "perf/busy_fraction"]),
}


class Metrics:
    def __init__(self, folder: Path, resume_step: int | None = None, *,
                 loggers: Iterable[str] = ("jsonl", "tensorboard"), name: str | None = None,
                 config: dict | None = None):
        from jet.trainer.loggers import open_sinks

        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = TrainerFiles(self.folder).metrics
        loggers = list(loggers)
        self._file = None
        if "jsonl" in loggers:
            if resume_step is not None:
                self._truncate(resume_step)
            self._file = open(self.path, "a", encoding="utf-8")
        # (a resumed TensorBoard purges the lost steps' events, as _truncate drops their JSONL lines)
        self._sinks = open_sinks(loggers, self.folder, resume_step=resume_step, name=name or self.folder.name,
                                 config=config, lines=self.path if self._file is not None else self.folder / "-")

    @classmethod
    def for_trainer(cls, cfg, model: str, resume_step: int | None) -> "Metrics":
        """The metrics of `model`'s trainer: `<run_dir>/trainer/<model>`, its `trainer.loggers`."""
        from jet.config import dump

        return cls(RunDir.of(cfg).trainer(model), resume_step, loggers=cfg.trainer_of(model).loggers,
                   name=f"{cfg.run}/{model}", config=dump(cfg))

    def log(self, step: int, values: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in values.items() if v is not None and math.isfinite(float(v))}
        if self._file is not None:
            self._file.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
            self._file.flush()
        for sink in self._sinks:
            sink.log(step, clean)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        for sink in self._sinks:
            sink.close()

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


def plot(path: Path, out_dir: Path | None = None, names: Iterable[str] = PLOTS) -> list[Path]:
    """PNG curves of one metrics file; returns the files written (default: next to the metrics)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(path)
    out_dir = Path(out_dir) if out_dir else TrainerFiles(Path(path).parent).plots
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
    evals = read_metrics(TrainerFiles(Path(path).parent).evals)
    if evals:
        written.append(plot_evals(evals, rows, out_dir / "eval.png"))
    return written


def plot_evals(evals: list[dict], rows: list[dict], out: Path) -> Path:
    """The evaluator's held-out results (`eval/<task>/reward_mean`, with their 95% intervals) against the
    trainer step of each evaluated version and against the wall time it was published, from the trainer's
    first line (or the first evaluation)."""
    import matplotlib.pyplot as plt

    start = min([r["time"] for r in rows[:1] if "time" in r] + [e["time"] for e in evals[:1] if "time" in e])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
    for key in sorted({k for e in evals for k in e if k.startswith("eval/") and k.endswith("/reward_mean")}):
        pts = [e for e in evals if key in e]
        ci = key.removesuffix("/reward_mean") + "/ci95"
        for ax, xs in ((axes[0], [e["step"] for e in pts]), (axes[1], [(e["time"] - start) / 60 for e in pts])):
            ax.plot(xs, [e[key] for e in pts], "o-", label=key)
            if all(ci in e for e in pts):
                ax.fill_between(xs, [e[ci][0] for e in pts], [e[ci][1] for e in pts], alpha=0.2)
    axes[0].set(title="Held-out evaluation", xlabel="optimiser step of the version", ylabel="mean result (greedy)")
    axes[1].set(title="against wall time", xlabel="minutes since the run started (version published)")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
