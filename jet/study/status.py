"""`jet study status`: a study's progress at a glance, from its durable state.

Arms (params, state, runs running / finished / failed, mean summary), the
runs in flight with their latest trainer step, the best arm so far, the stage
and the budget left (runs, wall time, planner tokens), and whether a runner
holds the study now.
"""

from __future__ import annotations

import time

from jet.study import analysis
from jet.study.analysis import fmt
from jet.study.messages import COUNTED


async def table(state):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    s, b = state.study, state.study.budget
    sums = state.summaries()
    alive = await runner_alive(state)
    t = Table(title=f"study {s.name}: stage {state.stage()}, "
                    f"{'runner live' if alive else 'no runner'}" + (f", ended: {state.ended}" if state.ended else ""))
    for c in ("arm", "params", "state", "running", "finished", "failed", "mean summary", "seeds"):
        t.add_column(c, justify="right" if c not in ("params", "state") else "left")
    running = {req.trial: 0 for req in state.launched.values()}
    for run in state.in_flight():
        running[state.launched[run].trial] = running.get(state.launched[run].trial, 0) + 1
    for n, a in sorted(sums.items()):
        kind = "pruned" if f"pruned:{n}" in state.marks else "failed" if f"failed:{n}" in state.marks else a.state
        done = sum(c for k, c in a.statuses.items() if k in COUNTED)
        bad = sum(c for k, c in a.statuses.items() if k not in COUNTED)
        t.add_row(str(n), a.label, kind, str(running.get(n, 0)), str(done), str(bad), fmt(a.mean()), str(len(a.values)))
    flight = Table(title="runs in flight")
    for c in ("run", "step", "of", "metric (last)"):
        flight.add_column(c)
    for run in state.in_flight():
        curve = state.curves.get(run, {})
        last = max(curve) if curve else 0
        flight.add_row(run, str(last), str(state.launched[run].steps), fmt(curve.get(last)) if curve else "-")
    best = analysis.leaders(s, sums, set(), 1)
    used = (state.ended_at or time.time()) - state.started
    tokens = int(await state.r.hget(state.keys.study_state, "planner_tokens") or 0)
    lines = [t, flight,
             Text("best so far: " + (f"arm {best[0]} ({sums[best[0]].label}), screening mean {fmt(sums[best[0]].mean(0))}"
                                     if best else "none yet")),
             Text(f"budget left: {b.max_runs - len(state.launched)} of {b.max_runs} runs, "
                  f"{max(0.0, b.max_wall_hours - used / 3600):.2f} of {b.max_wall_hours} h, "
                  f"{b.max_planner_tokens - tokens} of {b.max_planner_tokens} planner tokens")]
    return Group(*lines)


async def runner_alive(state) -> bool:
    return bool(await state.r.exists(state.keys.study_runner))
