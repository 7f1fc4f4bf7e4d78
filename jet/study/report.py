"""What a researcher reads: report.md, results.csv and PNG plots in the study folder.

What it is: `write(state, plots)` renders the state's state (rebuilt from
durable storage, so `jet study report` redraws it any time):
- results.csv: one row per run (arm, params, seed, stage, status, summary,
  steps, duration, attempts, the step it resumed from, worker, reason);
- report.md: the question, the hypotheses as stated and their verdicts
  (effect size, bootstrap interval, Wilcoxon and Holm p-values), the arms,
  the stages, what was pruned and why, the budget used and every refusal,
  the failures;
- curves.png (per arm: mean over seeds of the metric's moving average with a
  95% t-band; pruned arms dashed, their partial curves kept), forest.png (each
  hypothesis's mean paired difference and interval), pruning.png (each run
  over wall time, by status, with the prune decisions marked).
decisions.jsonl is written by the state as it decides.

What it is not: the statistics (jet.stats, jet.study.analysis).
"""

from __future__ import annotations

import csv
import time
from pathlib import Path

from jet import stats
from jet.study import analysis
from jet.study.analysis import fmt

COLORS = {"supported": "tab:green", "refuted": "tab:red", "inconclusive": "tab:gray"}


def rows(state) -> list[dict]:
    out = []
    params = state.study.params
    for run, req in sorted(state.launched.items(), key=lambda kv: (kv[1].stage, kv[1].trial, kv[1].seed)):
        res = state.results.get(run)
        status = analysis.effective_status(state.study, res) if res else (
            "running" if state.curves.get(run) else "queued")
        summary = analysis.summary_of(state.study, res) if res else None
        out.append({"run": run, "stage": req.stage, "arm": req.trial, **{p: req.params.get(p) for p in params},
                    "seed": req.seed, "status": status, "summary": summary,
                    "steps": res.steps if res else max(state.curves.get(run, {0: 0})), "steps_planned": req.steps,
                    "duration_s": res.duration_s if res else None, "attempts": res.attempts if res else None,
                    "resumed_from": res.resumed_from if res else None, "worker": res.worker if res else "",
                    "reason": res.reason if res else ""})
    return out


def write(state, plots: bool = True) -> Path:
    folder = state.folder
    table = rows(state)
    with open(folder / "results.csv", "w", newline="") as f:
        cols = ["run", "stage", "arm", *state.study.params, "seed", "status", "summary", "steps", "steps_planned",
                "duration_s", "attempts", "resumed_from", "worker", "reason"]
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(table)
    sums = state.summaries()
    verdicts = analysis.assess(state.study, sums, state.best())
    if plots:
        curves_png(state, sums, folder / "curves.png")
        forest_png(state, verdicts, folder / "forest.png")
        timeline_png(state, folder / "pruning.png")
    (folder / "report.md").write_text(markdown(state, sums, verdicts, table))
    return folder / "report.md"


def progress_line(state) -> str:
    t = rows(state)
    done = sum(1 for r in t if r["status"] not in ("running", "queued"))
    running = sum(1 for r in t if r["status"] == "running")
    return (f"study {state.study.name}: stage {state.stage()}, {len(state.arms)} arms, {done} runs done, "
            f"{running} running, {len(t)} of {state.study.budget.max_runs} launched")


def _mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (0 for one value)."""
    m = stats.mean_interval(values)
    return m["mean"], (m["ci95"][1] - m["mean"]) if m["ci95"] else 0.0


def smoothed(curve: list[tuple[int, float]], window: int) -> dict[int, float]:
    pts = sorted(curve)
    return {s: sum(v for _, v in pts[max(0, i - window + 1):i + 1]) / len(pts[max(0, i - window + 1):i + 1])
            for i, (s, _) in enumerate(pts)}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def curves_png(state, sums, path: Path) -> None:
    plt = _plt()
    m = state.study.metric
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for n, arm in sorted(sums.items()):
        per_seed = [smoothed(state.curve(run), m.window) for run, req in state.launched.items()
                    if req.trial == n and state.curve(run)]
        if not per_seed:
            continue
        steps = sorted({s for c in per_seed for s in c})
        pts = [(s, *_mean_ci([c[s] for c in per_seed if s in c])) for s in steps]
        xs, ys, hw = zip(*pts)
        pruned = arm.state == "pruned" or f"pruned:{n}" in state.marks
        line, = ax.plot(xs, ys, ls="--" if pruned else "-", label=f"{n}: {arm.label}" + (" (pruned)" if pruned else ""))
        ax.fill_between(xs, [y - h for y, h in zip(ys, hw)], [y + h for y, h in zip(ys, hw)],
                        color=line.get_color(), alpha=0.15)
    ax.set_xlabel("trainer step")
    ax.set_ylabel(f"{m.name} (moving average of {m.window})")
    ax.set_title(f"{state.study.name}: mean over seeds, 95% band")
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def forest_png(state, verdicts, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 1.3 + 0.6 * max(1, len(verdicts))))
    for i, v in enumerate(verdicts):
        e = v.evidence
        if not e.diffs:
            continue
        lo, hi = e.ci
        ax.errorbar([e.mean], [i], xerr=[[e.mean - lo], [hi - e.mean]], fmt="o", capsize=4,
                    color=COLORS[v.verdict])
        ax.axvline(stats.point(v.claim, v.margin), color=COLORS[v.verdict], ls=":", lw=0.8)
    ax.axvline(0.0, color="black", lw=0.8)
    ax.set_yticks(range(len(verdicts)), [f"{v.name}\n{v.verdict} (n={len(v.evidence.diffs)})" for v in verdicts],
                  fontsize=8)
    ax.set_xlabel(f"paired difference, treatment - control ({state.study.metric.name})")
    ax.set_title(f"effect sizes (> 0: treatment better), {state.study.confidence:.0%} bootstrap intervals")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def timeline_png(state, path: Path) -> None:
    plt = _plt()
    colors = {"completed": "tab:green", "diverged": "tab:orange", "collapsed": "tab:orange", "pruned": "tab:purple",
              "running": "tab:blue", "cancelled": "tab:gray", "stopped": "tab:gray"}
    t0 = state.started
    fig, ax = plt.subplots(figsize=(7.5, 0.8 + 0.25 * max(1, len(state.launched))))
    labels = []
    for i, (run, req) in enumerate(sorted(state.launched.items(), key=lambda kv: (kv[1].trial, kv[1].seed))):
        res = state.results.get(run)
        if res:
            end, begin, status = res.finished_at, res.finished_at - res.duration_s, analysis.effective_status(
                state.study, res)
        elif state.curves.get(run):
            begin, end, status = t0, time.time(), "running"
        else:
            continue
        ax.plot([(begin - t0) / 60, (end - t0) / 60], [i, i], lw=5, color=colors.get(status, "tab:red"),
                solid_capstyle="butt")
        labels.append((i, f"t{req.trial} s{req.seed}"))
    for d in state.decisions.read():
        if d.get("kind") == "prune":
            ax.axvline((d["time"] - t0) / 60, color="tab:purple", ls=":", lw=1)
            ax.text((d["time"] - t0) / 60, 0, f" prune t{d['arm']}", color="tab:purple", fontsize=7, rotation=90)
    if labels:
        ax.set_yticks([i for i, _ in labels], [x for _, x in labels], fontsize=7)
    ax.set_xlabel("minutes since the study started")
    ax.set_title("runs over time: green completed, purple pruned,\norange diverged or collapsed, gray stopped", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(state, sums, verdicts, table) -> str:
    s, b = state.study, state.study.budget
    elapsed = (state.ended_at or time.time()) - state.started
    lines = [f"# Study `{s.name}`", "", f"**Question.** {s.question}", "",
             f"- base config: `{s.base}`; overrides of every run: {', '.join(f'`{x}`' for x in s.set) or 'none'}",
             f"- metric: `{s.metric.name}` ({s.metric.mode}; a run's summary: {s.metric.summary}, window "
             f"{s.metric.window}); seeds {s.seeds} (paired across arms)",
             f"- planner: {s.planner.kind}; pruner: {s.pruner.kind}"
             + (f" (rungs {s.pruner.rungs}, eta {s.pruner.eta})" if s.pruner.kind != "none" else ""),
             f"- state: {'ended: ' + state.ended if state.ended else 'running'}; wall time {elapsed / 60:.1f} min "
             "from the first start", "", "## Hypotheses and verdicts", "",
             f"Stated before any run. Paired differences per seed (treatment - control, > 0 = treatment better), "
             f"{s.confidence:.0%} bootstrap interval of the mean, two-sided Wilcoxon signed-rank p against the "
             f"claim's point, Holm-corrected over {len(verdicts)} hypotheses at alpha {s.alpha}.", "",
             "| hypothesis | claim | treatment | control | seeds | mean diff | interval | dz | p | p (Holm) | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in verdicts:
        e = v.evidence
        arm = lambda a: f"{a}: {sums[a].label}" if a is not None else "-"  # noqa: E731
        claim = v.claim + (f" (margin {v.margin:g})" if v.margin else "")
        lines.append(f"| {v.name} | {claim} | {arm(v.treatment)} | {arm(v.control)} | {len(e.diffs)} | {fmt(e.mean)} "
                     f"| [{fmt(e.ci[0])}, {fmt(e.ci[1])}] | {fmt(e.dz, 3)} | {fmt(e.p, 3)} | {fmt(v.p_holm, 3)} "
                     f"| **{v.verdict}** |")
    lines += [""] + [f"- **{v.name}**: {v.statement}" + (f" ({v.note})" if v.note else "") for v in verdicts]
    lines += ["", "## Arms", "", "| arm | params | state | seeds counted | mean summary | runs |", "|---|---|---|---|---|---|"]
    for n, a in sorted(sums.items()):
        kind = "pruned" if f"pruned:{n}" in state.marks else "failed" if f"failed:{n}" in state.marks else a.state
        runs = ", ".join(f"{k} {c}" for k, c in sorted(a.statuses.items()))
        lines.append(f"| {n} | {a.label} | {kind} | {len(a.values)} | {fmt(a.mean())} | {runs} |")
    lines += ["", "## Stages", ""]
    for k in range(state.stage() + 1):
        p = state.stage_plan(k)
        why = p.get("why", "").split("): ", 1)[-1]
        lines.append(f"- stage {k} ({'screening' if k == 0 else 'confirmation'}): arms {p['arms']}, seeds {p['seeds']}"
                     + (f"; why: {why}" if why else ""))
    lines += ["", "## Pruned", ""]
    pruned = [(m.split(":")[1], why) for m, why in state.marks.items() if m.startswith("pruned:")]
    lines += [f"- arm {a}: {why} (its partial curves are in curves.png, dashed)" for a, why in sorted(pruned)] or ["- none"]
    used_tokens = getattr(state.llm, "tokens_used", 0) if state.llm else 0
    lines += ["", "## Budget", "",
              f"- runs launched: {len(state.launched)} of {b.max_runs}; at most {b.max_concurrent_runs} at once",
              f"- wall time: {elapsed / 3600:.2f} h of {b.max_wall_hours} h; per-run timeout {b.run_timeout_s:.0f} s",
              f"- planner tokens: {used_tokens} of {b.max_planner_tokens}"]
    refusals = [why for m, why in state.marks.items() if m.startswith("refused:")]
    lines += [f"- refused: {why}" for why in refusals] or ["- no launch was refused"]
    lines += ["", "## Failures", ""]
    fails = [f"- arm {m.split(':')[1]} failed: {why}" for m, why in state.marks.items() if m.startswith("failed:")]
    fails += [f"- run `{r['run']}`: {r['status']}: {r['reason']}" for r in table
              if r["status"] in ("crashed", "timeout", "bad_config", "diverged", "collapsed", "cancelled")]
    if state.duplicates:
        fails.append(f"- DUPLICATE results (a bug): {state.duplicates}")
    lines += fails or ["- none"]
    lines += ["", "## Plots", "", "![curves](curves.png)", "", "![effect sizes](forest.png)", "",
              "![runs and pruning over time](pruning.png)", "",
              "Files: `results.csv` (one row per run), `decisions.jsonl` (every decision with its time), "
              "`optuna.jsonl` (the arms), `runs/<run>/` (each run's Jet folder: metrics, evaluations, logs, and "
              f"once it finished its outcome and what `worker.keep_files: {s.worker.keep_files}` keeps).", ""]
    return "\n".join(lines)
