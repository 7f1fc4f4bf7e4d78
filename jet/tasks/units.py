"""The "units" task: convert a quantity with a `convert` tool, an agent written with LangChain.

The agent (`solve`) is plain LangChain code that knows nothing of Jet: a
`langchain_openai.ChatOpenAI` with the tool bound (`bind_tools`), and a
tool-calling loop: each tool call is run (`convert`, answering
`{"result": value}` or `{"error": why}`) and sent back as a ToolMessage; the
first reply without tool calls is the final answer, its last number the
answer. `workflow` points ChatOpenAI at the episode's gateway
(`llm.openai_base_url`, `llm.openai_api_key`), so every call is recorded in
the episode, token-in-token-out.

Reward (returned by `workflow`): as "arith" (`jet.tasks.arith.score`): 1.0
for the right number; else 0.1 for a conversion that ran plus 0.1 for a final
reply holding a number. `llm.info` gets {"answer", "correct", "tool_calls",
"tool_ok", "turns"}.

Rows ("units"): {"value": 3, "unit_from": "km", "unit_to": "m", "answer": 3000}
(to a smaller unit of the same kind: length, mass or time), optionally "max_turns" (3),
"max_tokens" (48), "temperature" (1.0). Needs the `agents` extra
(langchain-openai); the rows and the reward do not.
"""

from __future__ import annotations

import json
import random
from typing import Any

from jet.tasks.arith import Attempt, last_number, score
from jet.wire import Task

SYSTEM = "Use the convert tool, then answer with the number."
UNITS = {"mm": ("length", 0.001), "cm": ("length", 0.01), "m": ("length", 1.0), "km": ("length", 1000.0),
         "g": ("mass", 0.001), "kg": ("mass", 1.0), "t": ("mass", 1000.0),
         "s": ("time", 1.0), "min": ("time", 60.0), "h": ("time", 3600.0)}


def convert_value(value: float, unit_from: str, unit_to: str) -> float:
    """`value` in `unit_from` expressed in `unit_to`; ValueError for unknown or mismatched units."""
    if unit_from not in UNITS or unit_to not in UNITS:
        raise ValueError(f"unknown unit; known: {', '.join(UNITS)}")
    (kind_from, f_from), (kind_to, f_to) = UNITS[unit_from], UNITS[unit_to]
    if kind_from != kind_to:
        raise ValueError(f"cannot convert {kind_from} ({unit_from}) to {kind_to} ({unit_to})")
    out = round(float(value) * f_from / f_to, 6)
    return int(out) if out == int(out) else out


def convert_json(arguments: dict) -> tuple[str, bool]:
    """The tool's answer to one call (JSON text), and whether it converted."""
    try:
        value = convert_value(float(arguments["value"]), str(arguments["unit_from"]), str(arguments["unit_to"]))
    except (ValueError, KeyError, TypeError) as e:
        return json.dumps({"error": f"{type(e).__name__}: {e}"[:200]}), False
    return json.dumps({"result": value}), True


def rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(f"units-{seed}")
    out = []
    for _ in range(n):
        kind = rng.choice(["length", "mass", "time"])
        unit_to, unit_from = sorted(rng.sample([u for u, (k, _) in UNITS.items() if k == kind], 2),
                                    key=lambda u: UNITS[u][1])  # to the smaller unit: whole answers
        value = rng.randint(1, 20)
        out.append({"value": value, "unit_from": unit_from, "unit_to": unit_to,
                    "answer": convert_value(value, unit_from, unit_to)})
    return out


def question(row: dict) -> str:
    return f"Convert {row['value']} {row['unit_from']} to {row['unit_to']}."


def _tool():
    from langchain_core.tools import tool

    @tool
    def convert(value: float, unit_from: str, unit_to: str) -> str:
        """Convert a quantity between units of one kind (mm, cm, m, km; g, kg, t; s, min, h)."""
        return convert_json({"value": value, "unit_from": unit_from, "unit_to": unit_to})[0]

    return convert


async def solve(chat_model: Any, text: str, *, max_turns: int = 3) -> Attempt:
    """Answer `text` with `chat_model` (a LangChain chat model), running the convert tool as it asks."""
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage

    tool = _tool()
    model = chat_model.bind_tools([tool])
    out = Attempt()
    messages: list[Any] = [SystemMessage(SYSTEM), HumanMessage(text)]
    while out.turns < max_turns:
        reply = await model.ainvoke(messages)
        out.turns += 1
        messages.append(reply)
        if not reply.tool_calls:
            out.final = reply.text if isinstance(reply.content, list) else str(reply.content)
            out.answer = last_number(out.final)
            break
        for call in reply.tool_calls:
            result, ok = (convert_json(call["args"]) if call["name"] == tool.name else
                          (json.dumps({"error": f"unknown tool {call['name']!r}"}), False))
            out.tool_calls, out.tool_ok = out.tool_calls + 1, out.tool_ok + ok
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
    out.messages = [m.model_dump() for m in messages]
    return out


async def workflow(task: Task, llm: Any) -> float:
    """One episode: the LangChain agent against this episode's gateway; returns the reward."""
    from langchain_openai import ChatOpenAI

    row = task.row
    chat_model = ChatOpenAI(model=llm.model, base_url=llm.openai_base_url, api_key=llm.openai_api_key,
                            max_tokens=int(row.get("max_tokens", 48)), temperature=float(row.get("temperature", 1.0)))
    attempt = await solve(chat_model, question(row), max_turns=int(row.get("max_turns", 3)))
    llm.info.update(answer=attempt.answer, correct=attempt.answer == row["answer"], tool_calls=attempt.tool_calls,
                    tool_ok=attempt.tool_ok, turns=attempt.turns)
    return score(attempt, float(row["answer"]))
