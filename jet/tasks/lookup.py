"""The "lookup" task: find an animal's code number with a `lookup` tool, an OpenAI Agents SDK agent.

The agent (`solve`) is plain `openai-agents` code that knows nothing of Jet:
an `Agent` with a `@function_tool`, run by `Runner`. `workflow` runs it on
the SDK's default model class, `OpenAIResponsesModel` (the Responses API,
`/v1/responses`), streamed (`Runner.run_streamed`, the events the SDK
consumes); `chat_workflow` on `OpenAIChatCompletionsModel`
(`/v1/chat/completions`), not streamed. Both point the SDK's `AsyncOpenAI`
client at the episode's gateway, so every call is recorded in the episode,
token-in-token-out. Tracing is off (it would upload to OpenAI).

The tool answers `{"result": code}` (or `{"error": why}`); the final output's
last number is the answer. A run the SDK gives up on (a reply cut by
max_tokens is an incomplete response, an unknown tool, too many turns) ends
the attempt with no answer: the agent code handles it, the reward scores it.

Reward: as "arith" (`jet.tasks.arith.score`): 1.0 for the right code; else
0.1 for a lookup that found a code plus 0.1 for a final output holding a
number. `llm.info` gets {"answer", "correct", "tool_calls", "tool_ok",
"turns", "api", "gave_up"}.

Rows ("lookup"): {"name": "otter", "answer": 417}, optionally "max_turns"
(3), "max_tokens" (48), "temperature" (1.0), "stream" (see the workflows). Needs the `agents` extra
(openai-agents); the rows and the reward do not.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from jet.tasks.arith import Attempt, last_number, score
from jet.wire import Task

SYSTEM = "Look the animal up with the lookup tool, then answer with its code number."
ANIMALS = ("otter", "heron", "badger", "lynx", "marten", "stoat", "beaver", "ibex", "puffin", "gecko",
           "tapir", "okapi", "quokka", "walrus", "bison", "koala")


def code(name: str) -> int:
    """The code number of an animal (100..999, fixed by its name)."""
    return 100 + int.from_bytes(hashlib.sha256(f"lookup-{name}".encode()).digest()[:4], "big") % 900


def lookup_json(name: Any) -> tuple[str, bool]:
    if not isinstance(name, str) or name.strip().lower() not in ANIMALS:
        return json.dumps({"error": f"no animal {name!r}; known: {', '.join(ANIMALS)}"}), False
    return json.dumps({"result": code(name.strip().lower())}), True


def rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(f"lookup-{seed}")
    return [{"name": name, "answer": code(name)} for name in (rng.choice(ANIMALS) for _ in range(n))]


def question(row: dict) -> str:
    return f"What is the code number of the {row['name']}?"


def _agent(model: Any, out: Attempt, max_tokens: int, temperature: float):
    from agents import Agent, ModelSettings, function_tool

    @function_tool
    def lookup(name: str) -> str:
        """The code number of an animal."""
        result, ok = lookup_json(name)
        out.tool_calls, out.tool_ok = out.tool_calls + 1, out.tool_ok + ok
        return result

    return Agent(name="lookup", instructions=SYSTEM, tools=[lookup], model=model,
                 model_settings=ModelSettings(max_tokens=max_tokens, temperature=temperature))


async def solve(model: Any, text: str, *, stream: bool, max_turns: int = 3, max_tokens: int = 48,
                temperature: float = 1.0) -> tuple[Attempt, str | None]:
    """Run the agent on `model` (an Agents SDK model); the attempt, and why the SDK gave up (or None)."""
    from agents import AgentsException, RunConfig, Runner

    out = Attempt()
    agent = _agent(model, out, max_tokens, temperature)
    config = RunConfig(tracing_disabled=True)
    try:
        if stream:
            result = Runner.run_streamed(agent, text, max_turns=max_turns, run_config=config)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, text, max_turns=max_turns, run_config=config)
    except AgentsException as e:
        out.turns = max_turns
        return out, f"{type(e).__name__}: {e}"[:300]
    out.turns = len(result.raw_responses)
    out.final = str(result.final_output)
    out.answer = last_number(out.final)
    return out, None


async def _play(task: Task, llm: Any, api: str, stream: bool) -> float:
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel
    row = task.row
    async with llm.openai_client() as client:  # AsyncOpenAI on the episode's gateway, shared transport
        model = (OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel)(
            model=llm.model, openai_client=client)
        attempt, gave_up = await solve(model, question(row), stream=stream, max_turns=int(row.get("max_turns", 3)),
                                       max_tokens=int(row.get("max_tokens", 48)),
                                       temperature=float(row.get("temperature", 1.0)))
    llm.info.update(answer=attempt.answer, correct=attempt.answer == row["answer"], tool_calls=attempt.tool_calls,
                    tool_ok=attempt.tool_ok, turns=attempt.turns, api=api, stream=stream, gave_up=gave_up)
    return score(attempt, float(row["answer"]))


async def workflow(task: Task, llm: Any) -> float:
    """One episode on the SDK's default, the Responses API, streamed unless the row says "stream": false."""
    return await _play(task, llm, "responses", stream=bool(task.row.get("stream", True)))


async def chat_workflow(task: Task, llm: Any) -> float:
    """One episode on the SDK's chat-completions model, not streamed unless the row says "stream": true."""
    return await _play(task, llm, "chat", stream=bool(task.row.get("stream", False)))
