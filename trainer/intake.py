"""Rank 0's intake: trajectories from the link, assembled into groups, and the consumed list.

What it is: `Intake.gather(n, version, step, stop)` polls the link and files
each trajectory with the `Assembler` until `n` trainable groups are ready
(or `stop()` says to stop: None). With several tasks the step's groups follow
the tasks' mixing weights (`jet.trainer.mix.allocate`, on the cumulative
groups trained per task); a task with no ready group is waited for at most
`mix_wait_s` per step, and not at all once it has sent nothing for that long
(tasks of this model in the config count as sending from the start; other
tasks join when their first trajectory comes).

Each trajectory is screened first (`jet.trainer.screen`, when `limits` is
given): one the trainer can never train is dead-lettered alone at once with
its real reason (`Link.dead`: the dead letter and the ack are one atomic
step) and its group's slot is closed without it, so its group and every
other one train on; an overlong one is truncated (counted in
`truncated_tokens`). `poison(group, {index: reason}, step)` does the same
for members of a taken group that a failed step was traced to
(`jet.trainer.guard`).

Every other entry whose fate is decided (trained with its group, or dropped:
stale, failed, small group, late, ...) is recorded in `consumed` with the
step it was decided at; `take_consumed()` hands that list to the checkpoint,
after which the loop acks it. Until then the entries stay pending in Redis
under the trainer's lease. So every entry read ends either in the ledger or
in `dead`, never both.

Outcome counts reach the feeder's admission (`Link.report`) after every step
and also while `gather` waits, whenever its decisions changed them (at most
once a second): entries decided without a step (a resumed trainer's stale
backlog, a group timed out below min_size) must leave the admission window
at once, or the feeder holds new episodes back while the trainer waits for
them, and neither moves again.

What it is not: a trainer. No torch; the loop decides what to do with groups.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Mapping, Sequence

from jet.queues.messages import TRAINER_REASON
from jet.wire import Trajectory

from jet.trainer.link import Link
from jet.trainer.groups import Assembler, Entry, Group, staleness
from jet.trainer.mix import allocate
from jet.trainer.screen import Limits, Poison, screen

log = logging.getLogger(__name__)


class Intake:
    def __init__(self, link: Link, assembler: Assembler, clock: Callable[[], float] = time.monotonic, *,
                 weights: Mapping[str, float] | None = None, expected: Iterable[str] = (), mix_wait_s: float = 0.0,
                 limits: Limits | None = None):
        self.link, self.asm, self.clock, self.limits = link, assembler, clock, limits
        self.consumed: list[dict] = []  # decided since the last checkpoint
        self.weights = dict(weights or {})  # task -> mixing weight (jet.trainer.mix); a missing task weighs 1
        self.mix_wait_s = mix_wait_s
        self.last_seen: dict[str, float] = {t: clock() for t in expected}  # task -> when its last trajectory came
        self.reported: tuple[dict[str, int], float] = ({}, float("-inf"))  # the counts last reported, and when

    def gather(self, n: int, version: int, step: int, stop: Callable[[], bool]) -> list[Group] | None:
        """`n` trainable groups in the configured task mix; None when `stop()` turned true first."""
        groups: list[Group] = []
        start = self.clock()
        quiet, warn_at = self.asm.counts["groups_no_signal"], 10 * n  # groups dropped with no signal (skip_no_signal)
        while len(groups) < n:
            if stop():
                return None
            for entry_id, traj in self.link.poll():
                self.last_seen[traj.task] = self.clock()
                self.take(entry_id, traj, version)
            now = self.clock()
            ready = self.asm.ready(now)
            plan = allocate(n - len(groups), ready, self.weights, self.trained_per_task(), self._hold(now, start))
            for task, k in plan.items():
                groups += self.asm.take(k, version, now, task=task)
            self._record(self.asm.pop_decided(), step)
            if self.asm.counts["groups_no_signal"] - quiet >= warn_at:
                log.warning("step %d: %d groups dropped so far for all-equal rewards (trainer.skip_no_signal), "
                            "%d of the %d groups it needs found: the model's rewards barely vary",
                            step + 1, self.asm.counts["groups_no_signal"] - quiet, len(groups), n)
                warn_at *= 2
            if len(groups) < n and now - self.reported[1] >= 1.0:
                self.report()
        return groups

    def report(self) -> None:
        """Hand the assembler's outcome counts to the feeder's admission (`Link.report`) if they changed."""
        counts = dict(self.asm.counts)
        if counts != self.reported[0] and not self.link.report(counts):
            counts = self.reported[0]  # not written: the next call tries again
        self.reported = counts, self.clock()

    def take(self, entry_id: str, traj: Trajectory, version: int) -> None:
        """Screen one trajectory read from the link and file it with the assembler (or dead-letter it)."""
        if self.limits is not None:
            try:
                traj, dropped = screen(traj, self.limits)
            except Poison as e:
                self.link.dead(entry_id, f"{TRAINER_REASON}{e}")
                self.asm.reject(traj, self.clock())
                return
            if dropped:
                self.asm.counts["truncated_tokens"] += dropped
                self.asm.counts["truncated"] += 1
        self.asm.add(Entry(entry_id, traj), version, self.clock())

    def poison(self, group: Group, bad: Mapping[int, str], step: int) -> bool:
        """Dead-letter members `bad` ({index: reason}) of a taken group; False when that leaves the
        group untrainable (its other entries are then decided as `small_group`)."""
        for index, reason in bad.items():
            self.link.dead(group.members[index].entry_id, f"{TRAINER_REASON}{reason}")
        dropped = self.asm.evict(group, list(bad))
        self._record(dropped, step)
        return not dropped

    def trained_per_task(self) -> dict[str, int]:
        """Groups trained so far per task (this run's lineage, checkpointed with the counts)."""
        prefix = "groups_trained/"
        return {k[len(prefix):]: v for k, v in self.asm.counts.items() if k.startswith(prefix)}

    def _hold(self, now: float, start: float) -> set[str]:
        """Tasks worth waiting for when they run out of ready groups: weight > 0, produced within mix_wait_s,
        and this step has not waited mix_wait_s yet. A task that stopped producing holds nobody up longer."""
        if now - start >= self.mix_wait_s:
            return set()
        return {t for t, seen in self.last_seen.items()
                if self.weights.get(t, 1.0) > 0 and now - seen < self.mix_wait_s}

    def trained(self, groups: Sequence[Group], step: int, version: int) -> list[int]:
        """Record the groups of step `step` as consumed; returns each trained member's staleness."""
        stale = [staleness(e.traj, version, self.asm.position) for g in groups for e in g.members.values()]
        for g in groups:
            self._record(self.asm.trained(g), step)
        return stale

    def take_consumed(self) -> list[dict]:
        out, self.consumed = self.consumed, []
        return out

    def _record(self, entries: Sequence[Entry], step: int) -> None:
        self.consumed += [{"entry": e.entry_id, "msg": e.msg_id, "outcome": e.outcome, "step": step}
                          for e in entries]
