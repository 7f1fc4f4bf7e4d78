"""A study's state as the runner, `jet study status` and `jet study report` see it, rebuilt from durable storage.

What it is: `StudyState(study, url, folder)`; `await load()` (read-only) or
the runner's own `open()` fills it from the places that survive any crash:
the arms from Optuna's journal (jet.study.plan), launched runs, results,
progress, stop requests and the runner's marks (pruned:<arm>, failed:<arm>,
stage:<k>, refused:<kind>) from Redis (jet.study.ledger), and the decisions
log (decisions.jsonl, `Decisions`). Reading it never changes the study.

What it is not: the decisions themselves (jet.study.runner makes them).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import orjson

from jet.keys import Keys
from jet.study import analysis, ledger
from jet.study.messages import RunRequest, RunResult
from jet.study.plan import Arm, Plan
from jet.study.spec import Study

log = logging.getLogger(__name__)


class Decisions:
    """decisions.jsonl: one JSON line per decision, each key written once (a resumed runner repeats nothing)."""

    def __init__(self, path: Path):
        self.path, self.keys = path, set()
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    self.keys.add(json.loads(line)["key"])
                except (ValueError, KeyError, TypeError):
                    continue

    def log(self, key: str, kind: str, **fields) -> bool:
        if key in self.keys:
            return False
        self.keys.add(key)
        with open(self.path, "ab") as f:
            f.write(orjson.dumps({"time": time.time(), "key": key, "kind": kind, **fields},
                                 option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        log.info("%s: %s", kind, fields.get("why") or fields)
        return True

    def read(self) -> list[dict]:
        out = []
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out


def run_name(study: str, arm: int, seed: int) -> str:
    return f"{study}-t{arm}-s{seed}"


class StudyState:
    def __init__(self, study: Study, url: str, folder: Path):
        self.study, self.url, self.folder = study, url, folder
        self.keys = Keys.for_study(study.name)
        folder.mkdir(parents=True, exist_ok=True)
        self.plan = Plan(study, folder)
        self.decisions = Decisions(folder / "decisions.jsonl")
        self.llm = None  # jet.study.llm_planner.LLMPlanner when planner.kind == 'llm'
        self.results: dict[str, RunResult] = {}
        self.duplicates: list[str] = []  # results seen twice for one run (must stay empty)
        self.curves: dict[str, dict[int, float]] = {}
        self.launched: dict[str, RunRequest] = {}
        self.stops: dict[str, str] = {}
        self.arms: dict[int, Arm] = {}
        self.marks: dict[str, str] = {}  # pruned:<arm> / failed:<arm> / stage:<k> / refused:<kind>
        self._cursors = {"results": "0", "progress": "0"}
        self.started = time.time()
        self.ended: str | None = None
        self.ended_at: float | None = None  # unix time the study ended (its wall time stops there)
        self.r = None

    def forced(self) -> list[dict]:
        """Arms the hypotheses name: asked before any other."""
        out = []
        for h in self.study.hypotheses:
            for side in (h.treatment, h.control):
                if side != "best" and side not in out:
                    out.append(dict(side))
        return out

    async def refresh(self) -> None:
        r, url, k = self.r, self.url, self.keys
        for entry, res in await ledger.results(r, url, k, self._cursors["results"]):
            self._cursors["results"] = entry
            if res.run in self.results:
                self.duplicates.append(res.run)
                continue
            self.results[res.run] = res
        for entry, p in await ledger.progress(r, url, k, self._cursors["progress"]):
            self._cursors["progress"] = entry
            self.curves.setdefault(p.run, {})[p.step] = p.value
        self.launched = await ledger.launched(r, url, k)
        self.stops = await ledger.stops(r, url, k)
        with_prefix = await self.r.hgetall(k.study_state)
        self.marks = {a.decode(): b.decode() for a, b in with_prefix.items()
                      if a.split(b":", 1)[0] in (b"pruned", b"failed", b"stage", b"refused")}

    def in_flight(self) -> list[str]:
        return [run for run in self.launched if run not in self.results]

    def stage(self) -> int:
        return max([int(m.split(":")[1]) for m in self.marks if m.startswith("stage:")], default=0)

    def stage_plan(self, k: int) -> dict:
        if k == 0:
            return {"arms": sorted(self.arms), "seeds": list(self.study.seeds), "best": {}}
        return orjson.loads(self.marks[f"stage:{k}"])

    def best(self) -> dict[str, int]:
        return self.stage_plan(self.stage()).get("best", {}) if self.stage() else {}

    def gone(self, arm: int) -> bool:
        return f"pruned:{arm}" in self.marks or f"failed:{arm}" in self.marks

    def curve(self, run: str) -> list[tuple[int, float]]:
        if run in self.results:
            return list(self.results[run].curve)
        return sorted(self.curves.get(run, {}).items())

    def settled(self, arm: int) -> bool:
        """All of the arm's screening runs have results."""
        return all(run_name(self.study.name, arm, s) in self.results for s in self.study.seeds)

    def runs_left(self) -> int:
        return self.study.budget.max_runs - len(self.launched)

    def summaries(self) -> dict[int, analysis.ArmSummary]:
        return analysis.summaries(self.study, list(self.arms.values()), list(self.results.values()))

    def used_seeds(self) -> list[int]:
        seeds = list(self.study.seeds)
        for k in range(1, self.stage() + 1):
            seeds += self.stage_plan(k)["seeds"]
        return seeds

    async def load(self) -> None:
        """Read-only: the study's state, for `jet study status` and `jet study report` (no lease taken)."""
        from jet.queues.connect import connect

        self.r = await connect(self.url)
        started = await ledger.get_field(self.r, self.url, self.keys, "started:study")
        self.started = float(started) if started else time.time()
        await self.refresh()
        self.arms = {a.number: a for a in self.plan.arms()}
        ended = [d for d in self.decisions.read() if d.get("kind") == "end"]
        self.ended = ended[-1]["why"] if ended else None
        self.ended_at = ended[-1]["time"] if ended else None

