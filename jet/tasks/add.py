"""The "add" task: two-digit addition, for a real pretrained model's difficulty curve.

What it is: every problem `What is A + B? Answer with just the number.` with A and B in 10..99
(8,100 problems) belongs to exactly one split, fixed by a hash of the pair: `eval` (about 1 in 10,
`is_eval`) or `train`. Training rows (`rows`, the built-in dataset "add") are drawn from the train
split only and evaluation rows (`eval_rows`, what `jet eval` and `jet bench trl` score) from the eval
split only, so no evaluated problem was ever trained on. Both are deterministic in (n, seed).

The agent (`workflow`) is plain OpenAI-SDK code on the episode's gateway: one user message, one
completion, no tools. `score` is the reward: 1.0 when the last integer of the reply equals the sum,
else 0.0. No shaping: a wrong answer earns nothing, however it is formatted. A small instruct model
(SmolLM2-135M-Instruct) is right on a minority of problems, greedy or sampled, so some groups carry
signal for GRPO and there is room to improve (docs/benchmarks.md, `jet bench trl`: 9 of 100 held-out
problems right, greedy, before training).

Rows: {"a": 47, "b": 38, "answer": 85}, optionally "max_tokens" (24), "temperature" (1.0) and "top_p" (1.0).
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any

from jet.wire import Task

PROMPT = "What is {a} + {b}? Answer with just the number."
LOW, HIGH = 10, 99
EVAL_ONE_IN = 10  # about this fraction of the problems is held out for evaluation
_INTEGER = re.compile(r"-?\d+")


def is_eval(a: int, b: int) -> bool:
    """Whether problem (a, b) is in the held-out evaluation split (a fixed hash of the pair)."""
    return int(hashlib.sha256(f"add:{a}+{b}".encode()).hexdigest(), 16) % EVAL_ONE_IN == 0


def _split(held_out: bool) -> list[tuple[int, int]]:
    return [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1) if is_eval(a, b) == held_out]


def _rows(pairs: list[tuple[int, int]], n: int, seed: int) -> list[dict]:
    rnd = random.Random(seed)
    if n <= len(pairs):
        chosen = rnd.sample(pairs, n)
    else:  # more rows than problems: every problem, then again in a new order
        chosen = [p for _ in range(n // len(pairs) + 1) for p in rnd.sample(pairs, len(pairs))][:n]
    return [{"a": a, "b": b, "answer": a + b} for a, b in chosen]


def rows(n: int, seed: int = 0) -> list[dict]:
    """`n` training rows (train split only), deterministic in `seed`."""
    return _rows(_split(held_out=False), n, seed)


def eval_rows(n: int = 100, seed: int = 0) -> list[dict]:
    """`n` evaluation rows (held-out split only; at most its size without repeats)."""
    return _rows(_split(held_out=True), n, seed)


def messages(row: dict) -> list[dict]:
    return [{"role": "user", "content": PROMPT.format(a=row["a"], b=row["b"])}]


def last_integer(text: str | None) -> int | None:
    found = _INTEGER.findall(text or "")
    return int(found[-1]) if found else None


def score(row: dict, reply: str | None) -> float:
    """1.0 when the reply's last integer is the sum, else 0.0."""
    return 1.0 if last_integer(reply) == int(row["answer"]) else 0.0


async def workflow(task: Task, llm: Any) -> float:
    """One episode: one chat completion through the episode's gateway; returns the reward."""
    row = task.row
    async with llm.openai_client() as client:  # openai.AsyncOpenAI on this episode's gateway
        response = await client.chat.completions.create(
            model=llm.model, messages=messages(row), max_tokens=int(row.get("max_tokens", 24)),
            temperature=float(row.get("temperature", 1.0)), top_p=float(row.get("top_p", 1.0)))
    reply = response.choices[0].message.content
    llm.info.update(answer=last_integer(reply), correct=score(row, reply) == 1.0)
    return score(row, reply)
