"""What a built-in task module with a held-out split must define: the one declaration, checked at load.

What it is: the contract between a task module (`jet.tasks.add`, `jet.tasks.tally`) and the two programs
that play its held-out rows without the swarm: `jet eval` (`jet.eval.evaluate`) and `jet bench trl`'s
TRL side (`jet.bench.trl_side`). A module defines

- `eval_rows(n, seed) -> list[dict]`: the first `n` held-out rows, deterministic in `seed`, none of
  them a training row;
- and either, single-turn, `messages(row) -> list[dict]` (the chat prompt) and
  `score(row, reply) -> float` (the reward of the reply, 1.0 when right),
- or, multi-turn, `environment(row)`: an `Environment` (below) that plays one episode, and `TURNS`, the
  most model turns an episode takes (TRL's completion budget is sized by it, so it has no default);
- optionally `MAX_TOKENS`, completion tokens per model turn (default 24), and, single-turn, `TURNS`
  (default 1).

`spec_of(module)` checks a module against it and returns a `TaskSpec`, or raises one ConfigError that
names everything missing ("jet.tasks.x lacks eval_rows and score"). The tasks that have a held-out
split are listed once, in `jet.tasks.HELD_OUT`; `jet.tasks.held_out_task(name)` imports and checks one.

What it is not: the contract of a training workflow (`workflow(task, llm)`, played by env workers
through the swarm), nor of a dataset (`rows(n, seed)`, `jet.tasks.DATASETS`).

Invariants: a `TaskSpec` is checked whole when it is made; callers never probe a module with `hasattr`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from jet.errors import ConfigError

MAX_TOKENS = 24  # completion tokens per model turn when a task does not say
SINGLE = ("eval_rows", "messages", "score")
MULTI = ("eval_rows", "environment", "TURNS")


class Environment(Protocol):
    """One multi-turn episode, no model and no I/O: the same object the task's agent plays against."""

    def opening(self) -> list[dict]:
        """The chat messages before the model's first turn."""

    def answer(self, reply: str) -> str | None:
        """The environment's next user message after the model's `reply`; None: the episode is over."""

    @property
    def reward(self) -> float:
        """The episode's reward so far (its result once `answer` returned None)."""


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """A checked task module: what `jet eval` and `jet bench trl` call, and the constants they read."""

    name: str  # the module, e.g. "jet.tasks.add"
    eval_rows: Callable[[int, int], list[dict]]
    messages: Callable[[dict], list[dict]] | None  # single-turn only
    score: Callable[[dict, str | None], float] | None  # single-turn only
    environment: Callable[[dict], Environment] | None  # multi-turn only
    max_tokens: int  # completion tokens per model turn
    turns: int  # the most model turns an episode takes

    @property
    def kind(self) -> Literal["single", "multi"]:
        return "multi" if self.environment is not None else "single"


def spec_of(module: Any, name: str | None = None) -> TaskSpec:
    """`module` (a task module, or any object with its attributes) checked against the protocol."""
    name = name or getattr(module, "__name__", repr(module))
    multi = getattr(module, "environment", None) is not None
    needs = MULTI if multi else SINGLE
    missing = [f for f in needs if getattr(module, f, None) is None]
    if missing:
        shape = ("a multi-turn task (it has an environment) defines eval_rows, environment and TURNS" if multi else
                 "a single-turn task defines eval_rows, messages and score; a multi-turn one eval_rows, "
                 "environment and TURNS")
        raise ConfigError(f"{name} lacks {_and(missing)} ({shape})")
    uncallable = [f for f in needs if f != "TURNS" and not callable(getattr(module, f))]
    if uncallable:
        raise ConfigError(f"{name}: {_and(uncallable)} must be callable")
    max_tokens, turns = _count(module, name, "MAX_TOKENS", MAX_TOKENS), _count(module, name, "TURNS", 1)
    return TaskSpec(name=name, eval_rows=module.eval_rows, messages=None if multi else module.messages,
                    score=None if multi else module.score, environment=module.environment if multi else None,
                    max_tokens=max_tokens, turns=turns)


def _count(module: Any, name: str, field: str, default: int) -> int:
    value = getattr(module, field, default)
    if type(value) is not int or value < 1:
        raise ConfigError(f"{name}.{field}: expected an int >= 1, got {value!r}")
    return value


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
