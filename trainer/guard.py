"""A step that fails on some trajectory drops that trajectory, not the batch (docs/design.md, "Poison").

What it is: `guarded(intake, groups, step, attempt, probe)` runs `attempt(groups)`;
when it raises, `jet.trainer.screen.isolate` runs `probe` on each member alone,
the members that fail alone are dead-lettered with their real error
(`Intake.poison`, which also drops a group left below min_group_size) and the
attempt is retried on the rest. When no member fails alone the error is not
the data's and is raised (the process crashes and restarts, as it should on a
systemic fault). `prepare` builds a step's inputs and packed rows;
`guarded_step` is the one-process optimiser step under this guard, probing
each member with a forward pass (no grad) of its own rows.

The screen on intake (`jet.trainer.screen.screen`) catches what can be known
before a step (token ids, lengths, rewards); this guard catches the rest (an
error inside the model on one trajectory's tokens, an out-of-memory of one
huge trajectory). It covers rank 0's preparation of every step and the
optimiser step of backends that can retry one (`retryable`: the torch
backend, which zeroes gradients at the start of each step). With DeepSpeed
the ranks' collectives cannot be replayed after a failure on one rank, so
there the screen is the defence.

What it is not: a retry of infrastructure errors (Redis, disk): those crash.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence, TypeVar

import torch

from jet.config import TrainerConfig
from jet.trainer.batch import StepInputs, build_step
from jet.trainer.groups import Group
from jet.trainer.intake import Intake
from jet.trainer.packing import Row, pack
from jet.trainer.screen import isolate
from jet.trainer.step import StepAbandoned, StepStats, micro_batch, sequence_level
from jet.wire import Trajectory

log = logging.getLogger(__name__)

T = TypeVar("T")


def prepare(trajectories: Sequence[Sequence[Trajectory]], tc: TrainerConfig, *,
            every_sample: bool = False) -> tuple[StepInputs, list[Row]]:
    """A step's inputs (advantages, weights) and packed rows from groups of trajectories. The rows hold
    only the samples whose loss has a gradient (`jet.trainer.batch.with_gradient`) unless KL is on (its
    term has a gradient at any advantage) or `every_sample` (a probe, which must run each sample's tokens)."""
    inputs = build_step(trajectories, advantage=tc.advantage, loss_agg=tc.loss_agg, prefix_trees=tc.prefix_trees,
                        gradient_only=not every_sample and tc.kl_coef == 0, whole_episodes=sequence_level(tc))
    return inputs, pack(inputs.samples, tc.micro_batch_tokens, batch_linear=True)


def guarded(intake: Intake, groups: list[Group], step: int, attempt: Callable[[list[Group]], T],
            probe: Callable[[Trajectory], None]) -> tuple[list[Group], T]:
    """(the groups left, `attempt`'s result on them), dead-lettering the members it fails on."""
    while True:
        try:
            return groups, attempt(groups)
        except StepAbandoned:  # a stop, not a fault: nothing to isolate
            raise
        except Exception as error:  # noqa: BLE001 - re-raised below unless a trajectory is to blame
            where = {e.msg_id: (g, i) for g in groups for i, e in g.members.items()}
            culprits = isolate([e.traj for g in groups for e in g.members.values()], probe)
            if not culprits:
                raise
            log.error("step %d failed (%s: %s) on %d trajectories alone; dead-lettering them, training the rest",
                      step + 1, type(error).__name__, error, len(culprits))
            per_group: dict[int, tuple[Group, dict[int, str]]] = {}
            for traj, why in culprits:
                g, i = where[traj.msg_id]
                per_group.setdefault(id(g), (g, {}))[1][i] = why
            dropped = {key for key, (g, bad) in per_group.items() if not intake.poison(g, bad, step)}
            groups = [g for g in groups if id(g) not in dropped]


def guarded_step(engine, intake: Intake, tc: TrainerConfig, groups: list[Group], inputs: StepInputs,
                 rows: list[Row], lr: float, step: int, stop: Callable[[], bool] | None = None
                 ) -> tuple[list[Group], StepInputs, list[Row], StepStats | None]:
    """One optimiser step of a one-process backend under the guard; stats None when nothing was left to train.
    A `stop()` during the step abandons it (`StepAbandoned` propagates)."""
    first = [(inputs, rows)]

    def attempt(gs: list[Group]):
        step_inputs, step_rows = first.pop() if first else prepare([g.trajectories() for g in gs], tc)
        stats = engine.train_step(step_rows, step_inputs, lr, stop=stop) if step_rows else None
        return step_inputs, step_rows, stats

    def probe(traj: Trajectory) -> None:
        one_inputs, one_rows = prepare([[traj]], tc, every_sample=True)
        with torch.no_grad():
            for row in one_rows:
                micro_batch(engine.model, row, one_inputs, tc, engine.ref)

    groups, (inputs, rows, stats) = guarded(intake, groups, step, attempt, probe)
    return groups, inputs, rows, stats
