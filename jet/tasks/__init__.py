"""Built-in tasks and their datasets: what tests, the CPU demo and the docs run.

`dataset(name, n=..., seed=...)` returns `n` rows (plain dicts, as a JSONL
dataset would give) of a built-in dataset; `jet enqueue` calls it for dataset
names that are not files. Rows are deterministic in (n, seed).

Built-in datasets and the workflows that play them:
- "guess": a hidden number, guessed with higher/lower feedback
  (`jet.tasks.guess:workflow`, written against `jet.llm`);
- "arith": an arithmetic question and its integer answer, e.g.
  {"question": "12 + 7 * 3", "answer": 33}, answered with a calculator tool by
  `jet.tasks.arith:workflow`, an agent written against the `openai` SDK that
  reaches the model through the gateway;
- "add": two-digit addition ("What is 47 + 38? Answer with just the number."),
  a real pretrained model's task, with a held-out evaluation split that shares
  no problem with training (`jet.tasks.add`: `workflow` on the `openai` SDK,
  `eval_rows` and `score` for `jet eval`);
- "tally": a running total kept over a four-turn dialogue, each environment
  message answering the model's last total ("Correct." / "Wrong: the total is
  27.") with the next change, under a ~250-token system prompt of rules and
  worked examples; reward: the fraction of right totals; a held-out split
  (`jet.tasks.tally`: `workflow` on the `openai` SDK, `environment` and
  `eval_rows` for `jet eval`);
- "propose": a range; a proposer model picks the secret and a solver model
  guesses it (`jet.tasks.propose:workflow`, two agents on two models, a
  per-agent reward).

Agent frameworks, trained unchanged through the gateway (the `agents` extra):
- "units": convert a quantity with a tool, a LangChain agent
  (`jet.tasks.units:workflow`, `ChatOpenAI` with bound tools);
- "lookup": an animal's code number with a function tool, an OpenAI Agents
  SDK agent on the Responses API (`jet.tasks.lookup:workflow`, streamed) or on
  chat completions (`jet.tasks.lookup:chat_workflow`);
- "spell": a word backwards, an agent speaking plain HTTP with `httpx2`
  (`jet.tasks.spell:workflow`).

Tasks with a held-out split (`HELD_OUT`: "add", "tally") keep the held-out task
protocol (`jet.tasks.protocol`): `held_out_task(name)` loads one, checked, for
`jet eval` and `jet bench trl`; `held_out(name, n, seed)` gives its rows.
"""

from __future__ import annotations

import importlib

from jet.errors import ConfigError
from jet.tasks.protocol import TaskSpec, spec_of

DATASETS = {
    "guess": "jet.tasks.guess:rows",
    "arith": "jet.tasks.arith:rows",
    "add": "jet.tasks.add:rows",
    "tally": "jet.tasks.tally:rows",
    "propose": "jet.tasks.propose:rows",
    "units": "jet.tasks.units:rows",
    "lookup": "jet.tasks.lookup:rows",
    "spell": "jet.tasks.spell:rows",
}

# Built-in tasks with a held-out split no training row shares (`tasks[].eval`, `jet eval`, `jet bench
# trl`): each module jet.tasks.<name> keeps the held-out task protocol (`jet.tasks.protocol`), and its
# name is also its built-in dataset's.
HELD_OUT = ("add", "tally")


def names() -> list[str]:
    return sorted(DATASETS)


def dataset(name: str, n: int = 100, seed: int = 0) -> list[dict]:
    """`n` rows of the built-in dataset `name`, deterministic in `seed`."""
    if name not in DATASETS:
        raise ConfigError(f"dataset: unknown built-in dataset {name!r}; built-in: {', '.join(names())} "
                          "(or give a .jsonl file)")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    module, _, fn = DATASETS[name].partition(":")
    return getattr(importlib.import_module(module), fn)(n, seed)


def held_out_task(name: str) -> TaskSpec:
    """Built-in task `name`'s module, checked against the held-out task protocol (`jet.tasks.protocol`)."""
    if name not in HELD_OUT:
        what = "has no held-out split" if name in DATASETS else "is no built-in task"
        raise ConfigError(f"task {name!r} {what}; built-in tasks with a held-out split: {', '.join(HELD_OUT)}")
    return spec_of(importlib.import_module(f"jet.tasks.{name}"))


def held_out(name: str, n: int = 100, seed: int = 0) -> list[dict]:
    """`n` rows of the held-out split of built-in dataset `name` (no training row is among them)."""
    if name not in HELD_OUT:
        raise ConfigError(f"dataset {name!r} has no built-in held-out split; built-in ones: "
                          f"{', '.join(HELD_OUT)} (or give a file of held-out rows)")
    return held_out_task(name).eval_rows(n, seed)
