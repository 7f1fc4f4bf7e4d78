"""The "arith" task: answer an arithmetic question, with a calculator tool, through the OpenAI SDK.

Rows (the built-in dataset "arith", `rows(n, seed)`): {"question": "12 + 7 * 3", "answer": 33}: two
or three operands in 1..20 joined by + - * (usual precedence, integer results), optionally
"max_turns" (3), "max_tokens" (48), "temperature" (1.0). `evaluate(text)` computes such an expression
(numbers, + - * / // %, unary minus, parentheses) without `eval`; anything else raises ValueError.

The agent (`solve`) is plain `openai` code: it knows nothing of Jet. It sends
the question with a `calculator` tool (OpenAI function calling); each tool call
is answered with `{"result": value}` (or `{"error": why}`), computed by
`evaluate`; the first reply without tool calls is the final answer, and its
last number is taken as the answer.
`workflow` points the agent at the episode's gateway (`llm.openai_base_url`,
`llm.openai_api_key`, see `jet.workers.gateway.app`), so every call is recorded
in the episode like a `jet.llm` call.

Reward (returned by `workflow`):
- 1.0 when the final answer equals the row's answer;
- else 0.1 for a calculator call that evaluated, plus 0.1 for a final reply
  holding a number: shaping a random tiny model can pick up first.
`llm.info` gets {"answer", "correct", "tool_calls", "tool_ok", "turns"}.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from dataclasses import dataclass, field
from typing import Any

from jet.wire import Task

SYSTEM = "Use the calculator, then answer with the number."
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_LENGTH = 200  # characters of an expression evaluate() accepts


def evaluate(text: str) -> int | float:
    """The value of an arithmetic expression; ValueError for anything that is not one."""
    if len(text) > MAX_LENGTH:
        raise ValueError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {text!r}") from e
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported syntax in an arithmetic expression: {ast.dump(node)[:60]}")


def rows(n: int, seed: int = 0) -> list[dict]:
    """`n` rows of the "arith" dataset, deterministic in `seed`."""
    rng = random.Random(f"arith-{seed}")
    out = []
    for _ in range(n):
        numbers = [rng.randint(1, 20) for _ in range(rng.choice((2, 3)))]
        ops = [rng.choice("+-*") for _ in numbers[1:]]
        question = str(numbers[0]) + "".join(f" {op} {x}" for op, x in zip(ops, numbers[1:]))
        out.append({"question": question, "answer": int(evaluate(question))})
    return out


@dataclass
class Attempt:
    answer: float | None = None  # the last number of the final reply; None without one
    final: str | None = None  # the final reply's text; None when the turns ran out
    tool_calls: int = 0
    tool_ok: int = 0  # calls that evaluated
    turns: int = 0
    messages: list[dict] = field(default_factory=list)


def calculator(arguments: str) -> tuple[str, bool]:
    """The tool's answer to one call (JSON text), and whether it evaluated."""
    try:
        args = json.loads(arguments)
        value = evaluate(str(args["expression"]))
    except (ValueError, KeyError, TypeError) as e:
        return json.dumps({"error": f"{type(e).__name__}: {e}"[:200]}), False
    return json.dumps({"result": value}), True


def last_number(text: str | None) -> float | None:
    found = _NUMBER.findall(text or "")
    return float(found[-1]) if found else None


async def solve(client: Any, model: str, question: str, *, max_turns: int = 3, max_tokens: int = 48,
                temperature: float = 1.0) -> Attempt:
    """Answer `question` with `client` (an `openai.AsyncOpenAI`), calling the calculator as the model asks."""
    out = Attempt(messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {question}?"}])
    while out.turns < max_turns:
        response = await client.chat.completions.create(model=model, messages=out.messages, tools=TOOLS,
                                                        max_tokens=max_tokens, temperature=temperature)
        message = response.choices[0].message
        out.turns += 1
        out.messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            out.final, out.answer = message.content or "", last_number(message.content)
            break
        for call in message.tool_calls:
            result, ok = calculator(call.function.arguments) if call.function.name == "calculator" else (
                json.dumps({"error": f"unknown tool {call.function.name!r}"}), False)
            out.tool_calls, out.tool_ok = out.tool_calls + 1, out.tool_ok + ok
            out.messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return out


def score(attempt: Attempt, answer: float) -> float:
    if attempt.answer is not None and attempt.answer == answer:
        return 1.0
    return 0.1 * (attempt.tool_ok > 0) + 0.1 * (attempt.answer is not None)


async def workflow(task: Task, llm: Any) -> float:
    """One episode: the OpenAI agent against this episode's gateway; returns the reward."""
    row = task.row
    # An openai.AsyncOpenAI on this episode's gateway (llm.openai_base_url, llm.openai_api_key) that
    # shares the worker's HTTP transport with the other episodes (see jet.llm.Session.openai_client).
    async with llm.openai_client() as client:
        attempt = await solve(client, llm.model, str(row["question"]), max_turns=int(row.get("max_turns", 3)),
                              max_tokens=int(row.get("max_tokens", 48)),
                              temperature=float(row.get("temperature", 1.0)))
    llm.info.update(answer=attempt.answer, correct=attempt.answer == row["answer"], tool_calls=attempt.tool_calls,
                    tool_ok=attempt.tool_ok, turns=attempt.turns)
    return score(attempt, float(row["answer"]))
