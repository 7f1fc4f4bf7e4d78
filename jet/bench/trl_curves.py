"""Time to accuracy for `jet bench trl`: held-out accuracy against wall time, both sides, paired by seed.

What it is: every run keeps its weights at fixed wall-clock marks while it is timed (Jet: the version
it had published by each mark, `trl_arms.Marks`; TRL: a callback, `trl_side`); after all runs, nothing
being timed any more, `evaluate_marks` evaluates every kept mark and the base model greedily on the same
held-out rows (`jet.eval.evaluate`; weights kept at two marks are evaluated once). A run's curve is its
accuracy at time 0 (the base) and at each mark. From the curves, per seed (repeat r of every arm uses
seed r: the comparison is paired):
- `time_to(curve, target)`: the first mark at which the accuracy reached `target` (None: not within the
  budget), for two targets taken from TRL's run of that seed: its final accuracy, and the base plus half
  of its gain. A seed whose TRL run ended at or below the base has no target above the base (both sides
  "reach" it at t 0): it is set apart (`no_gain`), counted, and left out of the time statistics;
- `area(curve, budget)`: the accuracy averaged over the run's wall time, the curve held from each mark
  to the next (what a user had at each moment);
- the accuracy at TRL's budget (the last mark).
`compare` turns them into paired statistics over seeds (never over rows: rows are the second line):
mean differences with t and bootstrap intervals, Wilcoxon p and dz (`jet.stats.paired_summary`), the
median time ratio with an order-statistic interval (`jet.stats.median_interval`), and per arm, each
mark's mean accuracy with a 95% band over repeats (`plot`).

What it is not: the runs themselves (`jet.bench.trl_arms`) or the throughput report (`jet.bench.trl`).
"""

from __future__ import annotations

import math
from pathlib import Path

from jet import stats
from jet.bench import write_json


def mark_times(budget_s: float, every_s: float) -> list[float]:
    """Marks every `every_s` seconds, and the budget itself (the end of the timed run)."""
    marks = [every_s * i for i in range(1, int(budget_s / every_s + 1e-9) + 1)]
    return marks if marks and abs(marks[-1] - budget_s) < 1e-6 else [*marks, budget_s]


def evaluate_marks(model: str, runs: list[dict], task: str, eval_n: int, device: str, max_tokens: int,
                   say, cache: Path | None = None) -> dict:
    """The base model's held-out result, and each run's `curve` ([{t, accuracy, version, step,
    weights_time_s}], the base at t 0) and `eval` (its result at the last mark: its accuracy at the
    budget, with each row's result). With `cache` (a folder), each evaluation is written there as it
    ends and reused by a later call: greedy evaluation of the same weights folder (same path, not
    modified since: a rerun arm's new marks never match) on the same rows gives the same result."""
    import hashlib
    import json

    from jet.eval import evaluate

    done: dict[str, dict] = {}

    def cached(spec: str) -> Path | None:
        if cache is None:
            return None
        path = Path(spec)
        stamp = path.stat().st_mtime_ns if path.exists() else None
        key = json.dumps([spec, stamp, task, eval_n, device, max_tokens])
        return cache / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"

    def one(spec: str, name: str) -> dict:
        if spec in done:
            return done[spec]
        file = cached(spec)
        if file is not None and file.is_file():
            done[spec] = json.loads(file.read_text())
            say(f"eval: {name}: kept from {file}")
            return done[spec]
        say(f"eval: {name} on {eval_n} held-out rows")
        r = evaluate(spec, task, eval_n, device=device, max_tokens=max_tokens)
        done[spec] = {k: r[k] for k in ("n", "correct", "accuracy", "ci95", "results", "seconds")}
        if file is not None:
            write_json(file, done[spec])
        return done[spec]

    base = one(model, "base")
    for run in runs:
        run["curve"] = [{"t": 0.0, "accuracy": base["accuracy"], "version": 0, "step": 0, "weights_time_s": 0.0}]
        for m in run.get("marks", []):
            r = one(m["path"], f"{run['arm']} (repeat {run['repeat'] + 1}) at {m['mark_s']:g} s")
            run["curve"].append({"t": m["mark_s"], "accuracy": r["accuracy"], "version": m.get("version"),
                                 "step": m.get("step"), "weights_time_s": m.get("weights_time_s")})
        last = run["marks"][-1]["path"] if run.get("marks") else run["weights"]
        run["eval"] = one(last, f"{run['arm']} (repeat {run['repeat'] + 1}) at the end")
    return base


def time_to(curve: list[dict], target: float) -> float | None:
    """The first time on the curve with accuracy >= target (None: never within it)."""
    return stats.first_reach([(p["t"], p["accuracy"]) for p in curve], target)


def area(curve: list[dict], budget_s: float) -> float:
    """The accuracy averaged over [0, budget_s], each point held until the next."""
    return stats.area([(p["t"], p["accuracy"]) for p in curve], budget_s, "step") / budget_s


def final(curve: list[dict]) -> float:
    return max(curve, key=lambda p: p["t"])["accuracy"]


def paired_seeds(runs: list[dict], arm: str, other: str) -> list[tuple[dict, dict]]:
    """(run of `arm`, run of `other`) per repeat both have: the same seed on both sides."""
    by = {(r["arm"], r["repeat"]): r for r in runs}
    return [(by[(arm, k)], by[(other, k)]) for k in sorted({r["repeat"] for r in runs})
            if (arm, k) in by and (other, k) in by]


def compare(runs: list[dict], base: dict, arm: str, budget_s: float, against: str = "trl") -> dict:
    """Time to accuracy, accuracy at equal wall time and the area under the curve of `arm` against
    `against`, per seed and over seeds (see the module docstring)."""
    pairs = paired_seeds(runs, arm, against)
    per_seed = []
    for a, b in pairs:
        gain = final(b["curve"]) - base["accuracy"]
        row = {"repeat": a["repeat"], "seed": a.get("seed"), f"{arm}_final": final(a["curve"]),
               f"{against}_final": final(b["curve"]), f"{arm}_area": area(a["curve"], budget_s),
               f"{against}_area": area(b["curve"], budget_s), "no_gain": gain <= 0}
        for name, target in (("final", final(b["curve"])), ("half_gain", base["accuracy"] + gain / 2)):
            row[f"target_{name}"] = target
            if row["no_gain"]:  # a target at or below the base: no time to it means anything
                row[f"{arm}_time_to_{name}"] = row[f"{against}_time_to_{name}"] = None
                row[f"time_ratio_{name}"] = row[f"time_share_of_budget_{name}"] = None
                continue
            mine, theirs = time_to(a["curve"], target), time_to(b["curve"], target)
            row[f"{arm}_time_to_{name}"], row[f"{against}_time_to_{name}"] = mine, theirs
            # censored: not reached within the budget counts as later than it (inf), for the median;
            # theirs > 0: the target lies above the base, the curve's value at t 0
            row[f"time_ratio_{name}"] = (math.inf if mine is None else mine) / theirs
            row[f"time_share_of_budget_{name}"] = math.inf if mine is None else mine / budget_s
        per_seed.append(row)
    out: dict = {"pairs": len(pairs), "per_seed": per_seed}
    if not pairs:
        return out
    diffs = [r[f"{arm}_final"] - r[f"{against}_final"] for r in per_seed]
    out["final_diff"] = stats.paired_summary(diffs)
    areas = [r[f"{arm}_area"] - r[f"{against}_area"] for r in per_seed]
    out["area_diff"] = stats.paired_summary(areas)
    gained = [r for r in per_seed if not r["no_gain"]]
    out["no_gain"] = len(per_seed) - len(gained)
    for name in ("final", "half_gain"):
        out[f"time_ratio_{name}"] = stats.median_interval([r[f"time_ratio_{name}"] for r in gained])
        out[f"time_share_of_budget_{name}"] = stats.median_interval([r[f"time_share_of_budget_{name}"]
                                                                     for r in gained])
        out[f"not_reached_{name}"] = sum(1 for r in gained if r[f"{arm}_time_to_{name}"] is None)
    return out


def bands(runs: list[dict], arms: list[str]) -> dict[str, list[dict]]:
    """Per arm, at each time on its runs' curves: the mean accuracy over repeats and its 95% t interval."""
    out = {}
    for arm in arms:
        curves = [r["curve"] for r in runs if r["arm"] == arm and r.get("curve")]
        times = sorted({p["t"] for c in curves for p in c})
        out[arm] = []
        for t in times:
            values = [held(c, t) for c in curves]
            out[arm].append({"t": t, **stats.mean_interval(values)})
    return out


def held(curve: list[dict], t: float) -> float:
    """The curve's accuracy at time t: that of its last point at or before t."""
    return max((p for p in curve if p["t"] <= t + 1e-9), key=lambda p: p["t"])["accuracy"]


def plot(report: dict, path: Path) -> None:
    """Held-out accuracy against wall time per arm: each repeat thin, the mean thick with its 95% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"jet": "C0", "jet-flat": "C2", "trl": "C1", "jet-lora": "C3"}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in report["runs"]:
        c = run.get("curve") or []
        ax.step([p["t"] for p in c], [p["accuracy"] for p in c], where="post", color=colours.get(run["arm"]),
                alpha=0.25, lw=0.8)
    jet_set = ", ".join(report.get("jet_set") or [])  # the Jet arms' own overrides, said in their label
    for arm, pts in report["time_to_accuracy"]["bands"].items():
        ts = [p["t"] for p in pts]
        own = f" ({jet_set})" if jet_set and arm != "trl" else ""
        ax.step(ts, [p["mean"] for p in pts], where="post", color=colours.get(arm), lw=2.2,
                label=f"{arm}{own} (mean of {pts[0]['n'] if pts else 0})")
        if all(p["ci95"] for p in pts):
            ax.fill_between(ts, [p["ci95"][0] for p in pts], [p["ci95"][1] for p in pts], step="post",
                            color=colours.get(arm), alpha=0.15)
    ax.axhline(report["base"]["accuracy"], color="grey", ls="--", lw=1, label="base model")
    ax.set(xlabel="wall time since launch (s)", ylabel="held-out accuracy (greedy)",
           title=f"jet bench trl --task {report['task']}: accuracy against wall time, 95% bands over seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
