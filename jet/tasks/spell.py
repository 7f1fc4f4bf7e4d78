"""The "spell" task: spell a word backwards, an agent that speaks plain HTTP (`httpx2`) to the gateway.

The agent (`solve`) knows no SDK: it POSTs JSON to
`<base_url>/chat/completions` with `Authorization: Bearer <key>` and reads
`choices[0].message` from the JSON answer, as a hand-written client in any
language would. A wrong first answer gets one more try ("No. Spell 'w'
backwards, letter by letter."), the reply passed back as it came, so the
second call extends the first one's kept token ids. `workflow` uses the
episode's gateway (`llm.openai_base_url`, `llm.openai_api_key`).

Reward: 1.0 when the first word of a reply is the reversed word (case and
punctuation ignored), 0.5 when only the retry got it; else the share of the
reversed word's leading letters the best reply had right, times 0.3.
`llm.info` gets {"replies", "solved_on"}.

Rows ("spell"): {"word": "otter", "answer": "retto"}, optionally "max_tokens"
(16), "temperature" (1.0).
"""

from __future__ import annotations

import random
import re
from typing import Any

from jet.wire import Task

SYSTEM = "Answer with the word only."
WORDS = ("cat", "otter", "lamp", "river", "stone", "apple", "cloud", "piano", "tiger", "bread", "mint", "sun")
_WORD = re.compile(r"[a-z]+")


def rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(f"spell-{seed}")
    return [{"word": w, "answer": w[::-1]} for w in (rng.choice(WORDS) for _ in range(n))]


def first_word(text: str | None) -> str:
    found = _WORD.search((text or "").lower())
    return found.group() if found else ""


def prefix_share(guess: str, answer: str) -> float:
    n = 0
    for a, b in zip(guess, answer):
        if a != b:
            break
        n += 1
    return n / len(answer)


def score(replies: list[str], answer: str) -> float:
    words = [first_word(r) for r in replies]
    if words and words[0] == answer:
        return 1.0
    if answer in words:
        return 0.5
    return 0.3 * max((prefix_share(w, answer) for w in words), default=0.0)


async def solve(http: Any, word: str, *, max_tokens: int = 16, temperature: float = 1.0,
                model: str = "any") -> list[str]:
    """Ask `http` (an `httpx2.AsyncClient` with the gateway's base URL and key) to reverse `word`."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Spell '{word}' backwards."}]
    replies: list[str] = []
    for retry in (f"No. Spell '{word}' backwards, letter by letter.", None):
        res = await http.post("chat/completions", json={"model": model, "messages": messages,
                                                          "max_tokens": max_tokens, "temperature": temperature})
        res.raise_for_status()
        message = res.json()["choices"][0]["message"]
        replies.append(message.get("content") or "")
        if first_word(replies[-1]) == word[::-1] or retry is None:
            break
        messages += [message, {"role": "user", "content": retry}]
    return replies


async def workflow(task: Task, llm: Any) -> float:
    """One episode: the HTTP agent against this episode's gateway; returns the reward."""
    import httpx2  # the HTTP client the OpenAI SDK is built on: in the base install, no second one

    row = task.row
    headers = {"Authorization": f"Bearer {llm.openai_api_key}"}
    async with httpx2.AsyncClient(base_url=llm.openai_base_url.rstrip("/") + "/", headers=headers,
                                 timeout=300) as http:
        replies = await solve(http, str(row["word"]), max_tokens=int(row.get("max_tokens", 16)),
                              temperature=float(row.get("temperature", 1.0)), model=llm.model)
    words = [first_word(r) for r in replies]
    llm.info.update(replies=len(replies), solved_on=words.index(row["answer"]) + 1 if row["answer"] in words else None)
    return score(replies, str(row["answer"]))
