"""The "guess" task: find a hidden number with higher/lower feedback, a multi-turn game.

Each turn the model replies; the first integer in its reply is its guess, and
the environment answers "N is too low. Go higher." / "N is too high. Go
lower." (phrasings of the tiny models' corpus, `jet.models`), or ends the game
when it is right. A reply without a number is told to give one.

Reward (returned by `workflow`, so the task config needs no reward function):
- solved on turn k: 1.0 - 0.1 * (k - 1): faster is better;
- unsolved: 0.1 * the share of replies holding a number in range, a shaped
  signal a random tiny model gets from its first steps (answer with a digit)
  before it can win.
The workflow also reports `llm.info` = {"solved", "turns", "guesses"}.

Rows: {"secret": int, "low": int, "high": int, "max_turns": int, "max_tokens": int}.
"""

from __future__ import annotations

import random
import re
from typing import Any

from jet.wire import Task

SYSTEM = "You play a guessing game. Reply with one number."
_INT = re.compile(r"-?\d+")


def rows(n: int, seed: int = 0, low: int = 1, high: int = 10, max_turns: int = 4, max_tokens: int = 8) -> list[dict]:
    rng = random.Random(f"guess-{seed}")
    return [{"secret": rng.randint(low, high), "low": low, "high": high, "max_turns": max_turns,
             "max_tokens": max_tokens} for _ in range(n)]


def first_int(text: str) -> int | None:
    match = _INT.search(text or "")
    return int(match.group()) if match else None


def feedback(guess: int | None, secret: int, low: int, high: int) -> str | None:
    """What the environment says to a guess; None when it is right."""
    if guess is None:
        return f"Guess a number between {low} and {high}."
    if guess < secret:
        return f"{guess} is too low. Go higher."
    if guess > secret:
        return f"{guess} is too high. Go lower."
    return None


def score(guesses: list[int | None], secret: int, low: int, high: int) -> float:
    if secret in guesses:
        return 1.0 - 0.1 * guesses.index(secret)
    valid = sum(1 for g in guesses if g is not None and low <= g <= high)
    return 0.1 * valid / max(1, len(guesses))


async def play(llm: Any, secret: int, low: int, high: int, max_turns: int, max_tokens: int,
               **chat: Any) -> list[int | None]:
    """The game loop: the model guesses, the environment answers; returns the guesses."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Guess a number between {low} and {high}."}]
    guesses: list[int | None] = []
    for _ in range(max_turns):
        reply = await llm.chat(messages, max_tokens=max_tokens, **chat)
        messages.append(reply)
        guesses.append(first_int(reply["content"]))
        said = feedback(guesses[-1], secret, low, high)
        if said is None:
            break
        messages.append({"role": "user", "content": said})
    return guesses


async def workflow(task: Task, llm: Any) -> float:
    """Play one game against `llm` (a `jet.llm.Session`); return the reward."""
    row = task.row
    secret, low, high = int(row["secret"]), int(row.get("low", 1)), int(row.get("high", 10))
    max_turns, max_tokens = int(row.get("max_turns", 4)), int(row.get("max_tokens", 8))
    guesses = await play(llm, secret, low, high, max_turns, max_tokens)
    llm.info.update(solved=secret in guesses, turns=len(guesses), guesses=guesses)
    return score(guesses, secret, low, high)
