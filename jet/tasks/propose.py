"""The "propose" task: a two-agent, two-model team. A proposer picks the secret, a solver guesses it.

The proposer (agent "proposer" on model "proposer") is asked for a number in
[low, high]; the first integer of its reply is the secret. The solver (agent
"solver" on model "solver") then plays the "guess" game (`jet.tasks.guess`)
against that secret. Each model's trainer gets the samples of its own agent
only, and the workflow returns a per-agent reward dict:

- solver: `jet.tasks.guess.score` (solved on turn k: 1 - 0.1 (k - 1); else a
  small shaped reward for in-range numbers);
- proposer: 0 for a reply without a number in range (the row's fallback
  "secret" is played instead, so the solver always gets its game), else
  0.5 + 0.5 * (1 - solver's reward): a valid secret is worth something, one
  the solver struggles with more.

Model names are the row's "proposer_model"/"solver_model" (default "proposer"
and "solver"), so a config may name its models otherwise.
Rows: {"low": int, "high": int, "secret": int (the fallback), "max_turns": int, "max_tokens": int}.
"""

from __future__ import annotations

import random
from typing import Any

from jet.tasks.guess import SYSTEM, first_int, play, score
from jet.wire import Task


def rows(n: int, seed: int = 0, low: int = 1, high: int = 10, max_turns: int = 3, max_tokens: int = 6) -> list[dict]:
    rng = random.Random(f"propose-{seed}")
    out = []
    for _ in range(n):
        lo = rng.randint(low, high - 5)
        hi = rng.randint(lo + 4, high)
        out.append({"low": lo, "high": hi, "secret": rng.randint(lo, hi), "max_turns": max_turns,
                    "max_tokens": max_tokens})
    return out


async def workflow(task: Task, llm: Any) -> dict[str, float]:
    """One round: the proposer's secret, then the solver's game; returns {"proposer": r, "solver": r}."""
    row = task.row
    low, high = int(row.get("low", 1)), int(row.get("high", 10))
    max_turns, max_tokens = int(row.get("max_turns", 3)), int(row.get("max_tokens", 6))
    proposer, solver = row.get("proposer_model", "proposer"), row.get("solver_model", "solver")
    ask = [{"role": "system", "content": SYSTEM},
           {"role": "user", "content": f"Pick a number between {low} and {high}."}]
    proposal = await llm.chat(ask, model=proposer, agent="proposer", max_tokens=max_tokens)
    proposed = first_int(proposal["content"])
    valid = proposed is not None and low <= proposed <= high
    secret = proposed if valid else int(row.get("secret", low))

    guesses = await play(llm, secret, low, high, max_turns, max_tokens, model=solver, agent="solver")
    solved = score(guesses, secret, low, high)
    llm.info.update(secret=secret, valid=valid, solved=secret in guesses, turns=len(guesses))
    return {"proposer": 0.5 + 0.5 * (1.0 - solved) if valid else 0.0, "solver": solved}
