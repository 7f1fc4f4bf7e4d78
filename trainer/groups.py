"""GRPO group assembly: trajectories in, trainable groups out. Pure logic; time is passed in.

What it is: `Assembler` collects the Trajectories of `traj:<model>` by group
(task, group_id) and hands out groups that are done:

- complete: every member index 0..group_size-1 has a final outcome: a
  successful trajectory, a failure with no retry queued, or one left out for
  staleness. A failed trajectory with `retry` set keeps its slot open (the
  next attempt will come);
- timed out: `timeout_s` after its first trajectory arrived, a group is done
  with what it has, so a lost episode never stalls training.

A done group with at least `min_size` successful fresh members is trainable;
one with fewer is dropped (counted `small_group`). With `skip_no_signal`
(`trainer.skip_no_signal`: dynamic sampling, as DAPO's), a done group whose
rewards give every member an advantage of 0 (`no_signal`: all equal, in each
baseline) is dropped too (counted `no_signal`), so every group of a step
carries gradient and the step waits for more rollouts instead. A member is left out as
stale when `version - oldest token version > max_staleness`, checked when it
arrives and again when its group is handed out (the version moves on), so
`max_staleness = 0` admits only trajectories generated entirely by the
current version: the synchronous barrier. Versions are compared through
`position` (default: the version itself); the trainer passes its lineage's
ordinals (`jet.trainer.lineage`) and its current version's ordinal, so a
resume after a crash does not age the backlog.

A member the trainer will never train (`jet.trainer.screen`: poison,
dead-lettered by the intake, or evicted from a taken group after a failed
step) leaves its slot done without an entry (`reject`, `evict`): the group
completes without waiting for it, and it is counted `poison`.

Every entry gets exactly one outcome (`jet.keys.OUTCOMES`) and is handed back exactly
once, either in a taken group (`Group.entries`) or by `pop_decided`; the
trainer acks it once that decision is checkpointed.

What it is not: I/O. No Redis, no torch (`no_signal` and `baselines` are here so, and
`jet.trainer.advantages` builds on them); the trainer's link (`jet.trainer.link`)
reads the stream, the loop (`jet.trainer.loop`) decides what a step trains.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from jet.wire import Trajectory

Reward = float | dict[str, float]  # a member's reward: one number, or one per agent


def baselines(rewards: Sequence[Reward]) -> dict[str | None, list[int]]:
    """Each baseline's members (indices into `rewards`): agent `a`'s baseline is the members whose
    reward has an entry for `a`; scalar rewards form one baseline together (key None)."""
    out: dict[str | None, list[int]] = {}
    for i, r in enumerate(rewards):
        for key in (r.keys() if isinstance(r, dict) else (None,)):
            out.setdefault(key, []).append(i)
    return out


def reward_value(reward: Reward, key: str | None) -> float:
    """A member's reward in baseline `key` (`baselines`)."""
    return float(reward[key]) if isinstance(reward, dict) else float(reward)


def no_signal(rewards: Sequence[Reward]) -> bool:
    """True when every member's advantage is 0 in every estimator (`jet.trainer.advantages`): one member,
    or each baseline's rewards all equal. Such a group adds nothing to the policy gradient."""
    return len(rewards) < 2 or all(len({reward_value(rewards[i], key) for i in members}) == 1
                                   for key, members in baselines(rewards).items())


@dataclass(slots=True)
class Entry:
    """One consumed stream entry and what became of it."""

    entry_id: str
    traj: Trajectory
    outcome: str = ""  # one of jet.keys.OUTCOMES once decided

    @property
    def msg_id(self) -> str:
        return self.traj.msg_id


@dataclass(slots=True)
class Group:
    task: str
    group_id: str
    size: int
    first_seen: float
    members: dict[int, Entry] = field(default_factory=dict)  # successful and fresh, by index
    left_out: set[int] = field(default_factory=set)  # indices done without a usable trajectory
    entries: list[Entry] = field(default_factory=list)  # every entry of the group, members included

    @property
    def complete(self) -> bool:
        return len(self.members) + len(self.left_out) >= self.size

    def trajectories(self) -> list[Trajectory]:
        return [self.members[i].traj for i in sorted(self.members)]


def staleness(traj: Trajectory, version: int, position: Callable[[int], int] | None = None) -> int:
    """`version` minus the oldest position of any trained token's weight version (0 without trained tokens)."""
    versions = {v for s in traj.samples for v in s.versions if v >= 0}
    if position is not None:
        versions = {position(v) for v in versions}
    return version - min(versions, default=version)


def malformed(traj: Trajectory) -> str | None:
    """Why a successful trajectory cannot be trained, or None."""
    if not 0 <= traj.index < traj.group_size:
        return f"member index {traj.index} outside group_size {traj.group_size}"
    if isinstance(traj.reward, dict):
        for s in traj.samples:
            if len(s.agents) != 1 or s.agents[0] not in traj.reward:
                return f"per-agent reward {sorted(traj.reward)} but a sample of agents {list(s.agents)}"
    return None


class Assembler:
    def __init__(self, *, min_size: int, timeout_s: float, max_staleness: int, remember: int = 100_000,
                 position: Callable[[int], int] | None = None, skip_no_signal: bool = False):
        self.min_size, self.timeout_s, self.max_staleness = min_size, timeout_s, max_staleness
        self.skip_no_signal = skip_no_signal  # drop a done group whose advantages would all be 0
        self.position = position  # version -> position along the lineage (None: the version itself)
        self.groups: dict[tuple[str, str], Group] = {}
        self.finished: OrderedDict[tuple[str, str], None] = OrderedDict()  # recently done groups
        self.remember = remember
        self.decided: list[Entry] = []  # decided outside a taken group, not yet popped
        # outcomes, plus groups_trained (also per task: groups_trained/<task>) / groups_dropped /
        # groups_no_signal / timeouts
        self.counts: Counter[str] = Counter()

    def add(self, entry: Entry, version: int, now: float) -> None:
        """File one trajectory under its group (or decide it at once: late, duplicate)."""
        t = entry.traj
        key = (t.task, t.group_id)
        if key in self.finished:
            return self._decide(entry, "late")
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = Group(t.task, t.group_id, t.group_size, now)
        if not t.failed and (t.index in group.members or t.index in group.left_out):
            return self._decide(entry, "duplicate")
        group.entries.append(entry)
        if t.failed:
            self._set(entry, "retried" if t.retry else "failed")
        elif malformed(t):
            self._set(entry, "malformed")
        elif staleness(t, version, self.position) > self.max_staleness:
            self._set(entry, "stale")
        else:
            group.members[t.index] = entry
            return
        if entry.outcome != "retried":
            group.left_out.add(t.index)

    def take(self, n: int, version: int, now: float, task: str | None = None) -> list[Group]:
        """Up to `n` trainable groups (of `task` only, if given), oldest first; drops done groups below `min_size`."""
        out: list[Group] = []
        for key, group in list(self.groups.items()):
            if len(out) >= n:
                break
            if task is not None and group.task != task:
                continue
            self._recheck_staleness(group, version)
            if not self._done(group, now):
                continue
            del self.groups[key]
            self._finish(key)
            if not group.complete:
                self.counts["timeouts"] += 1
            if len(group.members) < self.min_size:
                self.decided += self._drop(group, "small_group", "groups_dropped")
            elif self.skip_no_signal and no_signal([e.traj.reward for e in group.members.values()]):
                self.decided += self._drop(group, "no_signal", "groups_no_signal")
            else:
                self.counts["groups_trained"] += 1
                self.counts[f"groups_trained/{group.task}"] += 1
                out.append(group)
        return out

    def _drop(self, group: Group, outcome: str, counter: str) -> list[Entry]:
        """A group the trainer will not train: its undecided entries get `outcome`; returns all its entries."""
        self.counts[counter] += 1
        for e in group.entries:
            if not e.outcome:
                self._set(e, outcome)
        return list(group.entries)

    def ready(self, now: float) -> dict[str, int]:
        """Done groups per task (complete or timed out): what `take` would hand out, small ones aside."""
        out: dict[str, int] = {}
        for g in self.groups.values():
            if self._done(g, now):
                out[g.task] = out.get(g.task, 0) + 1
        return out

    def _done(self, group: Group, now: float) -> bool:
        return group.complete or now - group.first_seen >= self.timeout_s

    def trained(self, group: Group) -> list[Entry]:
        """Mark a taken group's members trained; returns all its entries (members and left-out ones)."""
        for e in group.members.values():
            self._set(e, "trained")
        return group.entries

    def reject(self, traj: Trajectory, now: float) -> None:
        """A member that arrived poisoned (dead-lettered, no entry): its slot is done without it."""
        self.counts["poison"] += 1
        key = (traj.task, traj.group_id)
        if key in self.finished:
            return
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = Group(traj.task, traj.group_id, traj.group_size, now)
        if traj.index not in group.members:
            group.left_out.add(traj.index)

    def evict(self, group: Group, indices: list[int]) -> list[Entry]:
        """Take members out of a taken group (their entries were dead-lettered); returns its other
        entries, decided `small_group`, if that leaves the group below `min_size` (else [])."""
        for index in indices:
            entry = group.members.pop(index)
            group.entries.remove(entry)
            group.left_out.add(index)
            self.counts["poison"] += 1
        if len(group.members) >= self.min_size:
            return []
        self.counts["groups_trained"] -= 1
        self.counts[f"groups_trained/{group.task}"] -= 1
        return self._drop(group, "small_group", "groups_dropped")

    def pop_decided(self) -> list[Entry]:
        """Entries decided outside a taken group since the last call."""
        out, self.decided = self.decided, []
        return out

    @property
    def waiting(self) -> int:
        """Entries held in groups that are not done yet."""
        return sum(len(g.entries) for g in self.groups.values())

    def next_timeout(self, now: float) -> float | None:
        """Seconds until the oldest waiting group times out (None when none waits)."""
        first = min((g.first_seen for g in self.groups.values()), default=None)
        return None if first is None else max(0.0, first + self.timeout_s - now)

    def _recheck_staleness(self, group: Group, version: int) -> None:
        for index, entry in list(group.members.items()):
            if staleness(entry.traj, version, self.position) > self.max_staleness:
                del group.members[index]
                group.left_out.add(index)
                self._set(entry, "stale")

    def _finish(self, key: tuple[str, str]) -> None:
        self.finished[key] = None
        while len(self.finished) > self.remember:
            self.finished.popitem(last=False)

    def _set(self, entry: Entry, outcome: str) -> None:
        entry.outcome = outcome
        self.counts[outcome] += 1

    def _decide(self, entry: Entry, outcome: str) -> None:
        self._set(entry, outcome)
        self.decided.append(entry)
