"""Built-in tasks: datasets, the guessing game's rules and reward, the safe evaluator."""

import pytest

from jet.errors import ConfigError
from jet.tasks import dataset, names
from jet.tasks.expressions import evaluate
from jet.tasks.guess import feedback, first_int, score


def test_datasets_are_deterministic_and_well_formed():
    assert names() == ["arith", "guess"]
    assert dataset("guess", 20, seed=3) == dataset("guess", 20, seed=3) != dataset("guess", 20, seed=4)
    assert all(r["low"] <= r["secret"] <= r["high"] for r in dataset("guess", 50))
    rows = dataset("arith", 50, seed=1)
    assert all(evaluate(r["question"]) == r["answer"] and isinstance(r["answer"], int) for r in rows)
    assert any("*" in r["question"] for r in rows)
    with pytest.raises(ConfigError, match="unknown built-in dataset 'nope'"):
        dataset("nope", 1)


def test_guess_rules_and_reward():
    assert first_int("I guess 7, or 8") == 7 and first_int("no idea") is None
    assert feedback(3, 7, 1, 10) == "3 is too low. Go higher."
    assert feedback(9, 7, 1, 10) == "9 is too high. Go lower."
    assert feedback(None, 7, 1, 10) == "Guess a number between 1 and 10." and feedback(7, 7, 1, 10) is None
    assert score([7], 7, 1, 10) == 1.0 and score([3, 9, 7], 7, 1, 10) == pytest.approx(0.8)
    assert score([3, None, 42, 9], 7, 1, 10) == pytest.approx(0.05) and score([None], 7, 1, 10) == 0.0


def test_evaluate_computes_arithmetic_and_nothing_else():
    assert evaluate("12 + 7 * 3") == 33 and evaluate("-(2 - 5) // 2") == 1 and evaluate("7 / 2") == 3.5
    for bad in ("__import__('os')", "2 ** 100000", "x + 1", "1 / 0", "[1]", "1" * 300):
        with pytest.raises(ValueError):
            evaluate(bad)
