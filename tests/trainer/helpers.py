"""Builders shared by the trainer tests: synthetic calls, samples and trajectories."""

from __future__ import annotations

from jet.timeline import Call, merge_calls
from jet.wire import Trajectory

MODEL = "tiny"


def call(prompt, completion, version=0, agent="a", lp=-0.5):
    return Call(tuple(prompt), tuple(completion), [lp] * len(completion), version, MODEL, agent)


def traj(group="g0", index=0, *, size=4, reward=1.0, version=0, failed=False, retry=False, task="t",
         calls=None, mode="exact", samples=None, msg_id=None) -> Trajectory:
    """A member of GRPO group `group`: by default one call generated at `version`, tokens 1..5."""
    if samples is None:
        samples = () if failed else tuple(merge_calls(calls or [call([1, 2, 3], [4, 5], version)], mode,
                                                      episode_id=f"{group}-{index}", reward=_scalar(reward)))
    extra = {"msg_id": msg_id} if msg_id else {}
    return Trajectory(task=task, group_id=group, index=index, episode_id=f"{group}-{index}", model=MODEL,
                      reward=reward, samples=samples, group_size=size, failed=failed, retry=retry,
                      error="boom" if failed else None, **extra)


def _scalar(reward):
    return reward if not isinstance(reward, dict) else 0.0
