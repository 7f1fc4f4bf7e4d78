"""Checkpoints and the ledger of consumed trajectories: atomic folders in the run directory.

Layout (under `runs/<run>/trainer/<model>/`):

    checkpoints/step-00000040/     backend files (model, optimiser, RNG) + state.json
    checkpoints/step-00000040-1/   a second checkpoint at step 40 (entries decided without a new step)
    checkpoints/point-step-00000043/  a resume point: state.json alone (the weights: a published version)
    ledger/step-00000040.json      the entries consumed between the previous checkpoint and this one
    ledger/step-00000040-1.json
    ledger/step-00000043.json      ... and between that and the point

What it is: `Checkpoints.write(step, state, save)` has every rank's backend
save into `checkpoints/.tmp-<name>/`, then rank 0 writes `state.json`, fsyncs
every file, renames the folder to `<name>` and fsyncs the parent: a
checkpoint either exists whole or not at all. Then it copies the consumed
list to the ledger and deletes all but the newest `keep` checkpoints
(`trainer.keep_checkpoints`): renamed to `.old-<name>` (no longer whole),
then removed. A checkpoint being written (`.tmp-<name>`) never counts, and
pruning runs only after the new one is renamed and its ledger written, so
the checkpoint a resume would load is never among those deleted.
`state.json` holds the step, the weight version, counters, and `consumed`:
the stream entries (entry id, message id, outcome, step) whose fate this
checkpoint makes durable; the trainer acks them only after the rename.

The ledger is append-only per lineage: every write gets a name no earlier
write had (`step-N`, then `step-N-1`, `step-N-2`, ... when step N is
checkpointed again, e.g. at a stop that decided entries without a new step),
and nothing renames over or deletes a whole checkpoint's folder or ledger
file except pruning of checkpoint folders older than the newest `keep`
(their ledger files stay). So a rewrite of a step can only add decisions
(a rewrite once replaced `ledger/step-N.json` and `state.json`, losing
entries already acked).

Resume points (`write(..., point={...})`, `trainer.resume: published`): at a
publish, the trainer makes the version it just wrote a place to resume from
without writing the model again: a `point-<name>` folder whose state.json holds
what a checkpoint's does plus `point`: the published version's folder and
sha256, and `base`, the newest full checkpoint (its optimiser and RNG state,
or none yet). Points share the ledger and its names with checkpoints (one
append-only sequence); only the newest point is kept, and a full checkpoint
never prunes the base of a newer point (the base is the newest full one).

`Checkpoints.resume()` finds the newest whole checkpoint or point, deletes leftovers
(temporary and half-pruned folders, ledger files past it) and makes sure its
own ledger file exists (a crash can fall between the rename and the ledger
copy). The ledger's files, concatenated, list every entry the surviving
lineage of the model consumed, each exactly once, and every acked entry is
among them: tests SIGKILL the trainer at each point of this protocol
(`die_at`) and check that against the stream.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any, Callable

from jet.runs import TrainerFiles
from jet.trainer.weights import fsync_path

STATE_FILE = "state.json"
DIE_AT_ENV = "JET_TRAINER_DIE_AT"  # test-only: "<point>[@n]" SIGKILLs this process the n-th time it gets there
_NAME = re.compile(r"step-(\d{8})(?:-(\d+))?")
POINT = "point-"  # the prefix of a resume point's folder (its ledger file has the plain name)
_reached: dict[str, int] = {}


def die_at(point: str) -> None:
    """SIGKILL this process here when $JET_TRAINER_DIE_AT names `point` (and this is its n-th visit).

    The fault-injection hook of the checkpoint tests: a real kill at a named
    point of the protocol, in a real trainer process. Unset, it does nothing.
    """
    want = os.environ.get(DIE_AT_ENV)
    if not want:
        return
    name, _, nth = want.partition("@")
    if name != point:
        return
    _reached[point] = _reached.get(point, 0) + 1
    if _reached[point] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def _name(step: int, k: int = 0) -> str:
    return f"step-{step:08d}" + (f"-{k}" if k else "")


def _key(name: str) -> tuple[int, int] | None:
    """(step, rewrite number) of a checkpoint, point or ledger name; None for anything else."""
    m = _NAME.fullmatch(name.removeprefix(POINT))
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically and durably (temp file, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    fsync_path(tmp)
    os.replace(tmp, path)


class Checkpoints:
    def __init__(self, root: Path, keep: int = 2, barrier: Callable[[], None] = lambda: None, rank: int = 0):
        self.root = Path(root)
        self.dir = TrainerFiles(self.root).checkpoints
        self.ledger = TrainerFiles(self.root).ledger
        self.keep, self.barrier, self.rank = keep, barrier, rank

    def whole(self) -> list[tuple[int, int]]:
        """(step, rewrite number) of every whole checkpoint, oldest first (resume points left out)."""
        return self._whole("")

    def points(self) -> list[tuple[int, int]]:
        """(step, rewrite number) of every whole resume point, oldest first."""
        return self._whole(POINT)

    def _whole(self, prefix: str) -> list[tuple[int, int]]:
        if not self.dir.is_dir():
            return []
        keys = (_key(d.name) for d in self.dir.iterdir()
                if d.name.startswith(prefix or "step-") and (d / STATE_FILE).is_file())
        return sorted(k for k in keys if k is not None)

    def steps(self) -> list[int]:
        """The steps that have a whole checkpoint, oldest first."""
        return sorted({step for step, _ in self.whole()})

    def path(self, step: int, k: int | None = None) -> Path:
        """The folder of step `step`'s checkpoint `k` (default: its newest)."""
        if k is None:
            k = max((r for s, r in self.whole() if s == step), default=0)
        return self.dir / _name(step, k)

    def newest(self) -> tuple[tuple[int, int], str] | None:
        """((step, rewrite number), folder prefix) of what a resume loads: the newest checkpoint or point."""
        found = [(k, "") for k in self.whole()] + [(k, POINT) for k in self.points()]
        return max(found, default=None)

    def resume(self) -> tuple[Path, dict] | None:
        """The newest whole checkpoint or resume point and its state (None if there is none); rank 0
        tidies up. A point's state has `point` (the published version to load, the checkpoint it builds on)."""
        newest = self.newest()
        if self.rank == 0:
            self._tidy(newest[0] if newest else (-1, 0))
        self.barrier()
        if newest is None:
            return None
        folder = self.dir / (newest[1] + _name(*newest[0]))
        state = json.loads((folder / STATE_FILE).read_text())
        ledger = self.ledger / f"{_name(*newest[0])}.json"
        if self.rank == 0 and not ledger.is_file():
            self.ledger.mkdir(parents=True, exist_ok=True)  # the first checkpoint's crash can precede the folder
            write_json(ledger, state["consumed"])
            fsync_path(self.ledger)
        return folder, state

    def write(self, step: int, state: dict, save: Callable[[Path], None] | None, *, point: dict | None = None) -> Path:
        """Every rank calls this: `save(folder)` writes the backend's files; rank 0 finishes the folder.
        With `point` (rank 0 alone, one process), a resume point instead: no backend files, state.json
        also holds `point` and the newest full checkpoint as its `base`."""
        kind = "point" if point is not None else "checkpoint"
        name = _name(step, self._next_rewrite(step))
        tmp, final = self.dir / f".tmp-{name}", self.dir / ((POINT if point is not None else "") + name)
        if point is not None:
            base = self.whole()
            state = {**state, "point": {**point, "base": _name(*base[-1]) if base else None}}
        die_at(f"{kind}:begin")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.barrier()
        if save is not None:
            save(tmp)
        self.barrier()
        if self.rank == 0:
            die_at(f"{kind}:saved")
            write_json(tmp / STATE_FILE, {**state, "step": step})
            for f in sorted(tmp.rglob("*")):
                fsync_path(f)
            die_at(f"{kind}:state")
            os.replace(tmp, final)
            fsync_path(self.dir)
            die_at(f"{kind}:renamed")
            self.ledger.mkdir(parents=True, exist_ok=True)
            write_json(self.ledger / f"{name}.json", state["consumed"])
            fsync_path(self.ledger)
            die_at(f"{kind}:ledger")
            self._prune()
        self.barrier()
        return final

    def _prune(self) -> None:
        """Delete all but the newest `keep` whole checkpoints, and every point older than the newest
        checkpoint or point (only the newest is ever resumed from): each is renamed to `.old-<name>`
        first, so a crash mid-delete leaves no folder that still counts as whole (`resume` removes the
        leftovers). The base of the newest point is the newest checkpoint: never among those deleted."""
        newest = self.newest()
        old = [_name(*k) for k in self.whole()[:-self.keep]]
        old += [POINT + _name(*k) for k in self.points() if newest is not None and k < newest[0]]
        for name in old:
            os.replace(self.dir / name, self.dir / f".old-{name}")
        if old:
            fsync_path(self.dir)
            die_at("checkpoint:pruning")
        for name in old:
            shutil.rmtree(self.dir / f".old-{name}", ignore_errors=True)

    def consumed(self) -> list[dict]:
        """Every ledger record of the surviving lineage, oldest first."""
        files = [(k, f) for f in self.ledger.glob("step-*.json") if (k := _key(f.stem)) is not None]
        out: list[dict] = []
        for _, f in sorted(files):
            out += json.loads(f.read_text())
        return out

    def _next_rewrite(self, step: int) -> int:
        """The first rewrite number of `step` no checkpoint folder or ledger file has used."""
        names = [d.name.removeprefix(POINT) for d in self.dir.iterdir()] if self.dir.is_dir() else []
        names += [f.stem for f in self.ledger.glob("step-*.json")] if self.ledger.is_dir() else []
        used = [key[1] for n in names if (key := _key(n)) is not None and key[0] == step]
        return max(used) + 1 if used else 0

    def _tidy(self, newest: tuple[int, int]) -> None:
        for tmp in [*self.dir.glob(".tmp-*"), *self.dir.glob(".old-*")] if self.dir.is_dir() else ():
            shutil.rmtree(tmp, ignore_errors=True)
        for f in self.ledger.glob("step-*.json") if self.ledger.is_dir() else ():
            key = _key(f.stem)
            if key is not None and key > newest:
                f.unlink()
