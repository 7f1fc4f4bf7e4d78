"""Rank 0's intake: trajectories from the feed, assembled into groups, and the consumed list.

What it is: `Intake.gather(n, version, step, stop)` polls the feed and files
each trajectory with the `Assembler` until `n` trainable groups are ready
(or `stop()` says to stop: None). Every entry whose fate is decided (trained
with its group, or dropped: stale, failed, small group, late, ...) is
recorded in `consumed` with the step it was decided at; `take_consumed()`
hands that list to the checkpoint, after which the loop acks it. Until then
the entries stay pending in Redis under the trainer's lease.

What it is not: a trainer. No torch; the loop decides what to do with groups.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from jet.trainer.feed import Feed
from jet.trainer.groups import Assembler, Entry, Group, staleness


class Intake:
    def __init__(self, feed: Feed, assembler: Assembler, clock: Callable[[], float] = time.monotonic):
        self.feed, self.asm, self.clock = feed, assembler, clock
        self.consumed: list[dict] = []  # decided since the last checkpoint

    def gather(self, n: int, version: int, step: int, stop: Callable[[], bool]) -> list[Group] | None:
        """`n` trainable groups, oldest first; None when `stop()` turned true first."""
        groups: list[Group] = []
        while len(groups) < n:
            if stop():
                return None
            for entry_id, traj in self.feed.poll():
                self.asm.add(Entry(entry_id, traj), version, self.clock())
            groups += self.asm.take(n - len(groups), version, self.clock())
            self._record(self.asm.pop_decided(), step)
        return groups

    def trained(self, groups: Sequence[Group], step: int, version: int) -> list[int]:
        """Record the groups of step `step` as consumed; returns each trained member's staleness."""
        stale = [staleness(e.traj, version) for g in groups for e in g.members.values()]
        for g in groups:
            self._record(self.asm.trained(g), step)
        return stale

    def take_consumed(self) -> list[dict]:
        out, self.consumed = self.consumed, []
        return out

    def _record(self, entries: Sequence[Entry], step: int) -> None:
        self.consumed += [{"entry": e.entry_id, "msg": e.msg_id, "outcome": e.outcome, "step": step}
                          for e in entries]
