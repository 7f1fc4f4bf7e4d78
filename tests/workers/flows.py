"""Workflows and rewards used by the worker tests (imported by worker processes as `tests.workers.flows`)."""

from __future__ import annotations

import anyio

SYSTEM = {"role": "system", "content": "You play a guessing game."}


async def chat(task, llm):
    """A linear multi-turn chat; records the final messages in llm.info; reward = turns."""
    row = task.row
    if row.get("sleep"):
        await anyio.sleep(row["sleep"])
    messages = [SYSTEM, {"role": "user", "content": f"Guess a number between 1 and {row.get('high', 10)}."}]
    turns = row.get("turns", 3)
    for k in range(turns):
        reply = await llm.chat(messages, max_tokens=row.get("max_tokens", 6), temperature=row.get("temperature", 1.0))
        messages.append(reply)
        if row.get("boom") and k == 0:
            raise RuntimeError(f"boom in {task.group_id}")
        if k < turns - 1:
            messages.append({"role": "user", "content": f"Turn {k + 1} is over. Go higher."})
    llm.info["messages"] = messages
    return float(turns)


def sync_chat(task, llm):
    """The same game from a plain (sync) function: `llm.chat` blocks."""
    messages = [SYSTEM, {"role": "user", "content": "Guess a number between 1 and 10."}]
    reply = llm.chat(messages, max_tokens=4)
    messages += [reply, {"role": "user", "content": "Go higher."}]
    llm.chat(messages, max_tokens=4)
    return {"turns": 2}


def turns_reward(task, result):
    return result["turns"] / 2
