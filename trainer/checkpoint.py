"""Checkpoints and the ledger of consumed trajectories: atomic folders in the run directory.

Layout (under `runs/<run>/trainer/<model>/`):

    checkpoints/step-00000040/   backend files (model, optimiser, RNG) + state.json
    ledger/step-00000040.json    the entries consumed between the previous checkpoint and this one

What it is: `Checkpoints.write(step, state, save)` has every rank's backend
save into `checkpoints/.tmp-step-N/`, then rank 0 writes `state.json`, fsyncs
every file, renames the folder to `step-N` and fsyncs the parent: a
checkpoint either exists whole or not at all. Then it copies the consumed
list to the ledger and deletes all but the newest `keep` checkpoints.
`state.json` holds the step, the weight version, counters, and `consumed`:
the stream entries (entry id, message id, outcome, step) whose fate this
checkpoint makes durable; the trainer acks them only after the rename.

`Checkpoints.resume()` finds the newest whole checkpoint, deletes leftovers
(temporary folders, ledger files past it) and makes sure its own ledger file
exists (a crash can fall between the rename and the ledger copy). The
ledger's files, concatenated, list every entry the surviving lineage of the
model consumed, each exactly once: tests check that against the stream.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from jet.trainer.weights import fsync_path

STATE_FILE = "state.json"


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically and durably (temp file, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    fsync_path(tmp)
    os.replace(tmp, path)


class Checkpoints:
    def __init__(self, root: Path, keep: int = 2, barrier: Callable[[], None] = lambda: None, rank: int = 0):
        self.root = Path(root)
        self.dir = self.root / "checkpoints"
        self.ledger = self.root / "ledger"
        self.keep, self.barrier, self.rank = keep, barrier, rank

    def steps(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        return sorted(int(d.name[5:]) for d in self.dir.glob("step-*")
                      if d.name[5:].isdigit() and (d / STATE_FILE).is_file())

    def path(self, step: int) -> Path:
        return self.dir / _step_name(step)

    def resume(self) -> tuple[Path, dict] | None:
        """The newest whole checkpoint and its state (None if there is none); rank 0 tidies up."""
        steps = self.steps()
        if self.rank == 0:
            self._tidy(steps[-1] if steps else -1)
        self.barrier()
        if not steps:
            return None
        folder = self.path(steps[-1])
        state = json.loads((folder / STATE_FILE).read_text())
        if self.rank == 0 and not (self.ledger / f"{_step_name(steps[-1])}.json").is_file():
            write_json(self.ledger / f"{_step_name(steps[-1])}.json", state["consumed"])
        return folder, state

    def write(self, step: int, state: dict, save: Callable[[Path], None]) -> Path:
        """Every rank calls this: `save(folder)` writes the backend's files; rank 0 finishes the folder."""
        tmp, final = self.dir / f".tmp-{_step_name(step)}", self.path(step)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.barrier()
        save(tmp)
        self.barrier()
        if self.rank == 0:
            write_json(tmp / STATE_FILE, {**state, "step": step})
            for f in sorted(tmp.rglob("*")):
                fsync_path(f)
            shutil.rmtree(final, ignore_errors=True)  # a leftover of a lost lineage at the same step
            os.replace(tmp, final)
            fsync_path(self.dir)
            self.ledger.mkdir(parents=True, exist_ok=True)
            write_json(self.ledger / f"{_step_name(step)}.json", state["consumed"])
            for old in self.steps()[:-self.keep]:
                shutil.rmtree(self.path(old), ignore_errors=True)
        self.barrier()
        return final

    def consumed(self) -> list[dict]:
        """Every ledger record of the surviving lineage, oldest first."""
        out: list[dict] = []
        for f in sorted(self.ledger.glob("step-*.json")):
            out += json.loads(f.read_text())
        return out

    def _tidy(self, newest: int) -> None:
        for tmp in self.dir.glob(".tmp-*") if self.dir.is_dir() else ():
            shutil.rmtree(tmp, ignore_errors=True)
        for f in self.ledger.glob("step-*.json") if self.ledger.is_dir() else ():
            if int(f.stem[5:]) > newest:
                f.unlink()
