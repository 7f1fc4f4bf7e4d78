"""The multi-task cocktail: which task's groups fill the next optimiser step. Pure logic.

What it is: `allocate(n, ready, weights, trained, hold)` hands the `n` group
slots of a step out one at a time, each to the task furthest behind its share
of all groups trained so far (deficit-based selection, as in weighted fair
queueing): task t's deficit is `w_t / W * (T + 1) - trained_t`, with T the
groups trained so far by all tasks (this step's picks included). So over a
run the cumulative groups trained per task track the configured weights to
within about one group per task, whatever order the groups come in, as long
as every task keeps producing.

A task still expected to produce groups is in `hold`: when the next slot
would go to it and it has no ready group left, allocation stops there and the caller waits
(at most `trainer.mix_wait_s`, `jet.trainer.intake`) instead of letting the
others run ahead. A task out of `hold` (it stopped producing) simply gets no
slot, and the others fill the step.

What it is not: I/O or clocks; the intake decides who is held and for how long.
"""

from __future__ import annotations

from typing import Collection, Mapping


def allocate(n: int, ready: Mapping[str, int], weights: Mapping[str, float], trained: Mapping[str, int],
             hold: Collection[str] = ()) -> dict[str, int]:
    """Groups to take per task (sums to at most `n`; less when a held task is next or ready runs out).

    `ready`: trainable groups ready per task; `weights`: the mixing ratio (a task
    missing from it weighs 1, one of weight 0 only fills slots nobody else can);
    `trained`: groups trained so far per task; `hold`: tasks worth waiting for when they run out.
    """
    left = {t: c for t, c in ready.items() if c > 0}
    done = {t: trained.get(t, 0) for t in set(left) | set(hold) | set(trained)}
    total_w = sum(max(0.0, weights.get(t, 1.0)) for t in set(left) | set(hold) | set(trained)) or 1.0
    out: dict[str, int] = {}
    for _ in range(n):
        candidates = set(left) | set(hold)
        if not candidates:
            break
        total = sum(done.values())

        def behind(t: str) -> tuple[bool, float, bool, str]:  # a tie goes to a task with a group ready
            w = max(0.0, weights.get(t, 1.0))
            return w > 0, w / total_w * (total + 1) - done.get(t, 0), t in left, t

        best = max(candidates, key=behind)
        if best not in left:  # the task furthest behind has nothing ready yet: wait for it
            break
        out[best] = out.get(best, 0) + 1
        done[best] = done.get(best, 0) + 1
        left[best] -= 1
        if not left[best]:
            del left[best]
    return out
