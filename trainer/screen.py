"""The trainer's poison policy: screen each trajectory on intake, and isolate the one a failing step trips on.

What it is:
- `Limits` (the model's vocabulary, the longest context a micro-batch holds,
  the overlong policy) and `screen(traj, limits)`, run on every trajectory the
  trainer reads before it joins a group: a trajectory the trainer could never
  train raises `Poison` with the real reason (a token id outside the
  vocabulary, a non-finite reward, a path longer than the budget under
  `overlong: dead_letter`), and the intake dead-letters that entry alone; an
  overlong one under `overlong: truncate` comes back without its tokens past
  the budget (`jet.timeline.truncate_sample`) and the count of trained tokens
  dropped. A path that fits the budget never needs this: `pack` splits trees
  and long samples into pieces (`jet.timeline.split_sample`).
- `isolate(trajectories, probe)`: after a step failed on a batch, run `probe`
  (a forward pass, say) on each trajectory alone and return the ones that fail
  alone with their real errors, so the loop dead-letters those and steps on
  the rest. None failing alone means the failure is not the data's: the
  caller re-raises it.

What it is not: a decoder (malformed entries never get here: the link
dead-letters them) or a judge of content. No torch, no I/O.

Invariants: a screened trajectory has every token id in [0, vocab) and every
root-to-token path at most `max_tokens` long; its reward is finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import msgspec

from jet.timeline import truncate_sample
from jet.wire import Trajectory

POLICIES = ("truncate", "dead_letter")


class Poison(Exception):
    """This trajectory can never be trained by this trainer; the message says why."""


@dataclass(frozen=True, slots=True)
class Limits:
    vocab_size: int  # token ids must lie in [0, vocab_size)
    max_tokens: int  # longest root-to-token path a micro-batch (and the model's positions) holds
    overlong: str = "truncate"  # one of POLICIES

    def __post_init__(self) -> None:
        if self.overlong not in POLICIES:
            raise ValueError(f"overlong must be one of {POLICIES}, got {self.overlong!r}")


def screen(traj: Trajectory, limits: Limits) -> tuple[Trajectory, int]:
    """(the trajectory as it will be trained, trained tokens dropped by truncation); raises Poison."""
    if traj.failed:
        return traj, 0
    _check_reward(traj.reward)
    for k, s in enumerate(traj.samples):
        bad = next((i for i, t in enumerate(s.tokens) if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise Poison(f"sample {k}, token {bad}: id {s.tokens[bad]} is outside the model's vocabulary "
                         f"[0, {limits.vocab_size})")
    deepest = max((max(s.positions) + 1 for s in traj.samples if len(s)), default=0)
    if deepest <= limits.max_tokens:
        return traj, 0
    if limits.overlong == "dead_letter":
        raise Poison(f"a path of {deepest} tokens is longer than the {limits.max_tokens} a micro-batch holds "
                     f"(trainer.micro_batch_tokens, the model's positions); trainer.overlong is dead_letter")
    cut = [truncate_sample(s, limits.max_tokens) for s in traj.samples]
    kept = tuple(s for s in cut if s is not None)
    dropped = sum(s.n_trained for s in traj.samples) - sum(s.n_trained for s in kept)
    return msgspec.structs.replace(traj, samples=kept), dropped


def _check_reward(reward) -> None:
    values = reward.values() if isinstance(reward, dict) else (reward,)
    if not all(math.isfinite(float(r)) for r in values):
        raise Poison(f"reward {reward!r} is not finite")


def isolate(trajectories: Sequence[Trajectory], probe: Callable[[Trajectory], None]) -> list[tuple[Trajectory, str]]:
    """The trajectories on which `probe` fails alone, each with its error ("Type: message")."""
    failed = []
    for t in trajectories:
        try:
            probe(t)
        except Exception as e:  # noqa: BLE001 - any error the data causes is this trajectory's reason
            failed.append((t, f"{type(e).__name__}: {e}"))
    return failed
