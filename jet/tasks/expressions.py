"""The "arith" dataset: small integer expressions, and a safe evaluator for them.

`rows(n, seed)` gives {"question": "12 + 7 * 3", "answer": 33}: two or three
operands in 1..20 joined by + - * (usual precedence, integer results).
`evaluate(text)` computes such an expression (numbers, + - * / // %, unary
minus, parentheses) without `eval`; anything else raises ValueError. It is the
calculator a tool-using workflow can call.
"""

from __future__ import annotations

import ast
import operator
import random

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
    rng = random.Random(f"arith-{seed}")
    out = []
    for _ in range(n):
        numbers = [rng.randint(1, 20) for _ in range(rng.choice((2, 3)))]
        ops = [rng.choice("+-*") for _ in numbers[1:]]
        question = str(numbers[0]) + "".join(f" {op} {x}" for op, x in zip(ops, numbers[1:]))
        out.append({"question": question, "answer": int(evaluate(question))})
    return out
