"""Weight versions along the trainer's surviving lineage: staleness counted in policies trained, not numbers announced.

Why: weight versions must only grow (inference workers follow the newest), so
a trainer that resumes from a checkpoint at version c after a crash that had
published up to a > c announces the restored weights as a + 1. Counted in
version numbers, the backlog generated before the crash, by the very policy
it restored (version c) or its ancestors, would be a + 1 - c versions staler
than it is, and a whole checkpoint interval of it was dropped as stale (22-69% of
the backlog in chaos runs).

What it is: `Lineage` maps every version number to an ordinal, its position
along the surviving lineage of policies, and staleness is the difference of
ordinals (`jet.trainer.groups.staleness`). So staleness still counts versions
published (`trainer.max_staleness` keeps its unit, and `0` is still the
synchronous barrier), but along the policies the current one descends from:

- live versions: the run's own publications. The restored weights announced
  at a resume get the ordinal of the checkpoint's version (they are that
  policy), and the versions after them follow on;
- dead versions (c, a] (a crashed run's publications after the checkpoint it
  forked from): a version j publications past the fork gets the fork's
  ordinal minus j, its distance from the fork counted backwards, so its
  staleness is the path between the two policies through the fork:
  j + (publications since the resume). Several crashes from one checkpoint
  make one dead range, counted from its start (an over-estimate: safe).

Since a trainer resumes from its newest published version (`trainer.resume:
published`, docs/design.md "Restarts"), a resume loses no version and adds no
dead range; dead ranges come from resumes from a checkpoint (the deepspeed
backend, `trainer.resume: checkpoint`).

It is checkpointed with the trainer's state (`to_json` / `from_json`), so a
later resume knows the dead ranges of earlier ones. A trajectory from the
last run's dead range (its inference workers were on a version newer than the
checkpoint's) is as stale as the steps lost plus the steps since.

What it is not: I/O. The loop reads the newest announcement and calls `resumed`.
"""

from __future__ import annotations

from bisect import bisect_right


class Lineage:
    def __init__(self, live: list[tuple[int, int]] | None = None, dead: list[tuple[int, int, int]] | None = None):
        self.live = sorted(live or [(0, 0)])  # (first version, its ordinal) of each run of consecutive versions
        self.dead = list(dead or [])  # (first, last, ordinal of the fork) of each lost run of versions

    def ordinal(self, version: int) -> int:
        """The position of `version`'s policy along the surviving lineage (version 0 is 0)."""
        for first, last, fork in self.dead:
            if first <= version <= last:
                return fork - (version - first + 1)
        k = bisect_right(self.live, (version, float("inf"))) - 1
        first, ordinal = self.live[max(k, 0)]
        return ordinal + (version - first)

    def resumed(self, checkpoint_version: int, announced: int, republished: int) -> None:
        """A resume from `checkpoint_version` found `announced` on the stream and republished as `republished`."""
        fork = self.ordinal(checkpoint_version)
        if announced > checkpoint_version:
            self.dead.append((checkpoint_version + 1, announced, fork))
        self.live.append((republished, fork))
        self.live.sort()

    def to_json(self) -> dict:
        return {"live": [list(x) for x in self.live], "dead": [list(x) for x in self.dead]}

    @classmethod
    def from_json(cls, data: dict | None) -> "Lineage":
        if not data:
            return cls()
        return cls([tuple(x) for x in data["live"]], [tuple(x) for x in data["dead"]])
