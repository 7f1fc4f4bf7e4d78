"""From run results to arm summaries and hypothesis verdicts: what the runner decides on and the report shows.

What it is: pure functions over the study, its arms and its results (no
I/O): `effective_status` (a finished run whose summary is below
`metric.collapse_below` is 'collapsed'), `summaries` (per arm: each counted
seed's summary, mean, run counts by status), `resolve` (which arm each side of
a hypothesis is), and `assess` (the verdicts, Holm-corrected across all
hypotheses of the study).

Seeds a hypothesis is judged on: every seed both arms have, all stages
together, except for a `best` treatment: that arm was chosen because it led
on the screening seeds, so judging it on them would be biased; it is judged
on confirmation seeds only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from jet import stats
from jet.study.messages import COUNTED, RunResult
from jet.study.plan import Arm
from jet.study.spec import Study, arm_label


def summary_of(study: Study, r: RunResult) -> float | None:
    m = study.metric
    return stats.summarise(r.curve, m.summary, m.window) if r.curve else None


def effective_status(study: Study, r: RunResult) -> str:
    floor = study.metric.collapse_below
    if r.status == "completed" and floor is not None:
        v = summary_of(study, r)
        if v is not None and (v < floor if study.metric.mode == "max" else v > floor):
            return "collapsed"
    return r.status


@dataclass
class ArmSummary:
    number: int
    params: dict[str, Any]
    state: str  # running | complete | pruned | failed
    values: dict[int, float] = field(default_factory=dict)  # seed -> summary (counted runs)
    stages: dict[int, int] = field(default_factory=dict)  # seed -> stage it ran in
    statuses: dict[str, int] = field(default_factory=dict)  # status -> runs
    reasons: list[str] = field(default_factory=list)  # why runs of it failed or stopped

    @property
    def label(self) -> str:
        return arm_label(self.params)

    def mean(self, stage: int | None = None) -> float | None:
        vals = [v for s, v in self.values.items() if stage is None or self.stages.get(s) == stage]
        return sum(vals) / len(vals) if vals else None


def summaries(study: Study, arms: list[Arm], results: list[RunResult]) -> dict[int, ArmSummary]:
    out = {a.number: ArmSummary(a.number, a.params, a.state) for a in arms}
    for r in results:
        arm = out.get(r.trial)
        if arm is None:
            continue
        status = effective_status(study, r)
        arm.statuses[status] = arm.statuses.get(status, 0) + 1
        if status in COUNTED:
            v = summary_of(study, r)
            if v is not None:
                arm.values[r.seed], arm.stages[r.seed] = v, r.stage
        elif r.reason and r.reason not in arm.reasons:
            arm.reasons.append(f"{status}: {r.reason}")
    return out


def find_arm(sums: dict[int, ArmSummary], params: dict[str, Any]) -> int | None:
    return next((n for n, a in sums.items() if a.params == params), None)


def leaders(study: Study, sums: dict[int, ArmSummary], exclude: set[int], top: int) -> list[int]:
    """The `top` arms with the best screening mean (stage 0), best first."""
    sign = 1.0 if study.metric.mode == "max" else -1.0
    scored = [(sign * m, n) for n, a in sums.items() if n not in exclude and (m := a.mean(0)) is not None]
    return [n for _, n in sorted(scored, key=lambda x: (-x[0], x[1]))[:top]]


@dataclass
class Verdict:
    name: str
    statement: str
    claim: str
    margin: float
    treatment: int | None
    control: int | None
    evidence: stats.Evidence
    p_holm: float
    verdict: str  # supported | refuted | inconclusive
    note: str = ""


def resolve(study: Study, sums: dict[int, ArmSummary], best: dict[str, int]) -> dict[str, tuple[int | None, int | None]]:
    """hypothesis -> (treatment arm, control arm); a `best` treatment is the recorded choice in `best`."""
    out = {}
    for h in study.hypotheses:
        control = find_arm(sums, h.control)
        treatment = best.get(h.name) if h.treatment == "best" else find_arm(sums, h.treatment)
        out[h.name] = (treatment, control)
    return out


def assess(study: Study, sums: dict[int, ArmSummary], best: dict[str, int] | None = None) -> list[Verdict]:
    """Every hypothesis's verdict, Holm-corrected across the study's hypotheses."""
    sides = resolve(study, sums, best or {})
    found = []
    for h in study.hypotheses:
        t, c = sides[h.name]
        note = ""
        if t is None or c is None:
            note = "its arms have not run" if h.treatment != "best" or c is None else "no leading arm chosen yet"
            tv, cv = {}, {}
        else:
            tv, cv = sums[t].values, sums[c].values
            if h.treatment == "best":  # chosen on screening seeds: judged on the others only
                tv = {s: v for s, v in tv.items() if sums[t].stages.get(s, 0) > 0}
                note = "the leading arm of screening, judged on confirmation seeds only"
        seeds, diffs = stats.paired(tv, cv, study.metric.mode)
        found.append((h, t, c, stats.evidence(seeds, diffs, h.claim, h.margin, study.confidence), note))
    adjusted = stats.holm([e.p for _, _, _, e, _ in found]) if found else []
    out = []
    for (h, t, c, e, note), p in zip(found, adjusted):
        v = stats.judge(e, p, h.claim, h.margin, study.alpha)
        out.append(Verdict(h.name, h.statement, h.claim, h.margin, t, c, e, p, v, note))
    return out


def confirmation_arms(study: Study, sums: dict[int, ArmSummary], verdicts: list[Verdict],
                      best: dict[str, int]) -> tuple[list[int], dict[str, int]]:
    """The arms to rerun on new seeds (those of inconclusive hypotheses) and the `best` choices made."""
    arms: list[int] = []
    chosen = dict(best)
    for h, v in zip(study.hypotheses, verdicts):
        if v.verdict != "inconclusive":
            continue
        if h.treatment == "best" and h.name not in chosen:
            exclude = {v.control} if v.control is not None else set()
            top = leaders(study, sums, exclude, study.confirm.top)
            if top:
                chosen[h.name] = top[0]
            picks = top
        else:
            picks = [chosen[h.name]] if h.treatment == "best" and h.name in chosen else [v.treatment]
        for a in picks + [v.control]:
            if a is not None and a not in arms and sums[a].state != "failed":
                arms.append(a)
    return arms, chosen


def fmt(x: float | None, digits: int = 4) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}g}"
