"""Pruning on learning curves: successive halving over the paired-seed summary at rungs of trainer steps.

What it is: `decide(curves, candidates, protected, pruned, rule)` is a pure
function. At each rung r (a trainer step), an arm's value is its curves'
summary cut at step r (`jet.stats.summarise`, so 'final' is the mean of
the `window` steps up to r), per seed that has reached r. Among the arms with
at least `min_seeds` seeds at the rung, the best ceil(n / eta) by mean value
go on (successive halving); an arm below them is pruned only when it is also
behind the leader of the rung on EVERY seed they share (at least `min_seeds`
of them, paired: same seed, same initial model), by more than `min_gap`. That
second condition keeps a noisy rung from stopping an arm that merely drew a
worse seed.

Arms named by a hypothesis are protected (a verdict needs them whole), and
only `candidates` (arms with runs still to come) are pruned: a finished arm
is a result, not a saving.

Why not Optuna's pruners: they judge one trial's curve against others one
at a time (`trial.report(value, step)`); here an arm is several seeds' curves
and the comparison is paired across arms, which is the statistic the
verdicts use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jet.stats import summarise

Curves = dict[int, dict[int, list[tuple[int, float]]]]  # arm -> seed -> [(step, value)]


@dataclass(frozen=True)
class Rule:
    rungs: list[int]
    eta: float = 2.0
    min_seeds: int = 2
    min_gap: float = 0.0
    summary: str = "final"
    window: int = 5
    mode: str = "max"


@dataclass(frozen=True)
class Decision:
    arm: int
    rung: int
    reason: str
    value: float  # the arm's mean at the rung
    leader: int
    leader_value: float


def rung_values(curves: Curves, rung: int, rule: Rule) -> dict[int, dict[int, float]]:
    """arm -> seed -> summary cut at `rung`, signed so larger is better, for seeds that reached the rung."""
    sign = 1.0 if rule.mode == "max" else -1.0
    out: dict[int, dict[int, float]] = {}
    for arm, seeds in curves.items():
        for seed, curve in seeds.items():
            if curve and max(s for s, _ in curve) >= rung:
                v = summarise(curve, rule.summary, rule.window, upto=rung)
                if v is not None:
                    out.setdefault(arm, {})[seed] = sign * v
    return out


def decide(curves: Curves, candidates: set[int], protected: set[int], pruned: set[int],
           rule: Rule) -> list[Decision]:
    """The arms to prune now (each once), with why."""
    out: list[Decision] = []
    gone = set(pruned)
    for rung in rule.rungs:
        values = {a: v for a, v in rung_values(curves, rung, rule).items()
                  if len(v) >= rule.min_seeds and a not in gone}
        if len(values) < 2:
            continue
        means = {a: sum(v.values()) / len(v) for a, v in values.items()}
        ranked = sorted(means, key=lambda a: (-means[a], a))
        keep = max(1, math.ceil(len(ranked) / rule.eta))
        leader = ranked[0]
        for arm in ranked[keep:]:
            if arm not in candidates or arm in protected:
                continue
            shared = sorted(set(values[arm]) & set(values[leader]))
            if len(shared) < rule.min_seeds:
                continue
            gaps = [values[leader][s] - values[arm][s] for s in shared]
            if all(g > rule.min_gap for g in gaps):
                sign = 1.0 if rule.mode == "max" else -1.0
                reason = (f"rung {rung}: behind arm {leader} on all {len(shared)} shared seeds "
                          f"(mean {sign * means[arm]:.4g} vs {sign * means[leader]:.4g}; "
                          f"smallest gap {min(gaps):.4g}), outside the best {keep} of {len(ranked)}")
                out.append(Decision(arm, rung, reason, sign * means[arm], leader, sign * means[leader]))
                gone.add(arm)
    return out
