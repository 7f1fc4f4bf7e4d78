"""The "tally" task: a multi-turn bookkeeping dialogue, a real agent workload a 135M model can learn on CPU.

What it is: the agent keeps a running total. The shared prompt (`SYSTEM`, the rules, and `EXAMPLE`, two
worked exercises as turns of the dialogue: about 330 tokens in SmolLM2's chat template) is the same for
every episode; the user then gives the starting total and a first change ("New exercise: the total
starts at 58. Subtract 8."), the model answers with the new total, and the environment (`Tally`)
replies to each answer: "Correct." or "Wrong: the total is 27." followed by the next change, four changes
in all, so every episode has four model turns and each environment message depends on the model's
previous answer. After a wrong answer the dialogue goes on from the true total (the environment says
it), so every turn can earn its credit.

Reward: the fraction of the four answers that are right (0, 0.25, 0.5, 0.75 or 1). An answer is right
when the last integer of the reply equals the running total; nothing else counts (no credit for format).

Splits: every episode (starting total and changes) belongs to exactly one split, fixed by a hash of it:
`eval` (about 1 in 10) or `train`. `rows(n, seed)` (the built-in dataset "tally") draws training episodes
only, `eval_rows(n, seed)` held-out ones only (`jet eval --task tally`, `jet bench trl --task tally`),
both deterministic in (n, seed). Starting totals 10..60, changes +-1..9, the total never below 0.

SmolLM2-135M-Instruct, before training, gets 6.9% of the answers on 40 held-out episodes right greedily
and 5% sampled at temperature 1 (a rules-only system prompt without the worked turns gave 0%).

The agent (`workflow`) is plain OpenAI-SDK code on the episode's gateway; `Tally` is the environment
alone (no model, no I/O), so `jet eval` and `jet bench trl`'s TRL side play exactly the same episodes.

Rows: {"start": 23, "changes": [4, -6, 9, -5]}, optionally "max_tokens" (per turn, 8), "temperature" (1.0)
and "top_p" (1.0).
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any

from jet.wire import Task

TURNS = 4
MAX_TOKENS = 8  # per model turn: a number and the end of the message
SYSTEM = """You are Tally, a careful bookkeeping assistant. You keep a running total for the user.

Rules:
1. The user first tells you the starting total and the first change.
2. A change is "Add N" or "Subtract N", where N is a whole number from 1 to 9.
3. Apply the change to the current total and reply with the new total.
4. Reply with the number only: digits, no words, no sign, no explanation.
5. The user then says whether your total was correct. If it was wrong, the user tells you the true
total: continue from the user's total, not from yours.
6. Then the user gives the next change. There are four changes in all."""
# A worked exercise, as turns of the dialogue itself (a small model follows turns better than text).
EXAMPLE = [("The total starts at 23. Add 4.", "27"), ("Correct. Subtract 6.", "21"), ("Correct. Add 9.", "30"),
           ("Correct. Subtract 5.", "25"), ("Correct. That was the last change. New exercise: the total starts at "
                                            "50. Subtract 8.", "42"), ("Correct. Add 3.", "45")]
LOW, HIGH = 10, 60
EVAL_ONE_IN = 10
_INTEGER = re.compile(r"-?\d+")


def change_text(d: int) -> str:
    return f"Add {d}." if d > 0 else f"Subtract {-d}."


def last_integer(text: str | None) -> int | None:
    found = _INTEGER.findall(text or "")
    return int(found[-1]) if found else None


class Tally:
    """One episode's environment: `opening()` the first messages, `answer(reply)` the next user message
    (None once the four changes are done), `reward` the fraction of right answers so far."""

    def __init__(self, row: dict):
        self.start, self.changes = int(row["start"]), [int(d) for d in row["changes"]]
        self.total, self.turn, self.right = self.start, 0, 0

    def opening(self) -> list[dict]:
        first = f"Correct. New exercise: the total starts at {self.start}. {change_text(self.changes[0])}"
        shown = [m for user, reply in EXAMPLE for m in ({"role": "user", "content": user},
                                                        {"role": "assistant", "content": reply})]
        return [{"role": "system", "content": SYSTEM}, *shown, {"role": "user", "content": first}]

    def answer(self, reply: str | None) -> str | None:
        self.total += self.changes[self.turn]
        ok = last_integer(reply) == self.total
        self.right += ok
        self.turn += 1
        if self.turn >= len(self.changes):
            return None
        verdict = "Correct." if ok else f"Wrong: the total is {self.total}."
        return f"{verdict} {change_text(self.changes[self.turn])}"

    @property
    def reward(self) -> float:
        return self.right / len(self.changes)


environment = Tally  # what `jet eval` and `jet bench trl` play: a task's environment, by this name


def is_eval(row: dict) -> bool:
    key = f"tally:{row['start']}:{','.join(map(str, row['changes']))}"
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % EVAL_ONE_IN == 0


def _episode(rnd: random.Random) -> dict:
    start = rnd.randint(LOW, HIGH)
    total, changes = start, []
    for _ in range(TURNS):
        d = rnd.randint(1, 9)
        if total - d >= 0 and rnd.random() < 0.5:
            d = -d
        changes.append(d)
        total += d
    return {"start": start, "changes": changes}


def _rows(n: int, seed: int, held_out: bool) -> list[dict]:
    rnd = random.Random(f"tally:{seed}:{held_out}")
    out = []
    while len(out) < n:
        row = _episode(rnd)
        if is_eval(row) == held_out:
            out.append(row)
    return out


def rows(n: int, seed: int = 0) -> list[dict]:
    """`n` training episodes (train split only), deterministic in `seed`."""
    return _rows(n, seed, held_out=False)


def eval_rows(n: int = 100, seed: int = 0) -> list[dict]:
    """`n` held-out episodes (evaluation split only), deterministic in `seed`."""
    return _rows(n, seed, held_out=True)


async def workflow(task: Task, llm: Any) -> float:
    """One episode: the dialogue through the episode's gateway with the OpenAI SDK; returns the reward."""
    row = task.row
    env = Tally(row)
    messages = env.opening()
    max_tokens, temperature = int(row.get("max_tokens", MAX_TOKENS)), float(row.get("temperature", 1.0))
    top_p = float(row.get("top_p", 1.0))
    async with llm.openai_client() as client:  # openai.AsyncOpenAI on this episode's gateway
        while True:
            response = await client.chat.completions.create(model=llm.model, messages=messages,
                                                            max_tokens=max_tokens, temperature=temperature,
                                                            top_p=top_p)
            reply = response.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": reply})
            follow = env.answer(reply)
            if follow is None:
                break
            messages.append({"role": "user", "content": follow})
    llm.info.update(right=env.right, turns=env.turn)
    return env.reward
