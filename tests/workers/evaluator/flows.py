"""Workflows of the evaluator tests: a two-turn agent (jet's own client, then the OpenAI SDK through the
episode's gateway) whose reward is a hash of what the model said, so two evaluations agree only if they
decoded the same tokens; a row with "fail" raises, as broken agent code does, and one with "sleep" waits
that long (a slow environment)."""

from __future__ import annotations

import hashlib

import anyio


async def workflow(task, llm) -> float:
    row = task.row
    if row.get("fail"):
        raise RuntimeError("this row's agent code is broken")
    await anyio.sleep(row.get("sleep", 0))  # a slow environment
    first = await llm.chat([{"role": "user", "content": row["q"]}], temperature=1.0, max_tokens=6)
    async with llm.openai_client() as client:
        second = await client.chat.completions.create(
            model=llm.model, max_tokens=6, temperature=1.0,
            messages=[{"role": "user", "content": row["q"]}, {"role": "assistant", "content": first["content"]},
                      {"role": "user", "content": "and again"}])
    said = f"{first['content']}|{second.choices[0].message.content}"
    return int(hashlib.sha256(said.encode()).hexdigest()[:8], 16) / 2 ** 32
