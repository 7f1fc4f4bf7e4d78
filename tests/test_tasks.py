"""Built-in tasks: datasets, the guessing game's rules and reward, the safe evaluator, the two-model team,
the held-out task protocol (every task with a held-out split keeps it; a module missing a piece is named)."""

from types import SimpleNamespace

import anyio
import pytest

from jet.errors import ConfigError
from jet.tasks import DATASETS, HELD_OUT, dataset, held_out, held_out_task, names
from jet.tasks.arith import evaluate
from jet.tasks.guess import feedback, first_int, score
from jet.tasks.propose import workflow as propose
from jet.tasks.protocol import spec_of
from jet.wire import Task


def test_datasets_are_deterministic_and_well_formed():
    assert names() == ["add", "arith", "guess", "lookup", "propose", "spell", "tally", "units"]
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


class ScriptedLLM:
    """Replies from a script per (model, agent); records who was called with what."""

    def __init__(self, script: dict[tuple[str, str], list[str]]):
        self.script, self.calls, self.info = script, [], {}

    async def chat(self, messages, *, model, agent, **sampling):
        self.calls.append((model, agent, messages[-1]["content"]))
        return {"role": "assistant", "content": self.script[(model, agent)].pop(0)}


def test_propose_has_each_agent_on_its_own_model_with_its_own_reward():
    row = {"low": 1, "high": 10, "secret": 4, "max_turns": 3, "max_tokens": 6}
    task = Task("propose", row, group_id="g", index=0, group_size=1)
    llm = ScriptedLLM({("proposer", "proposer"): ["7"], ("solver", "solver"): ["3", "9", "7"]})
    reward = anyio.run(propose, task, llm)
    assert [(m, a) for m, a, _ in llm.calls] == [("proposer", "proposer")] + [("solver", "solver")] * 3
    assert llm.calls[0][2] == "Pick a number between 1 and 10." and llm.calls[2][2] == "3 is too low. Go higher."
    assert reward == {"proposer": pytest.approx(0.5 + 0.5 * (1 - 0.8)), "solver": pytest.approx(0.8)}
    # an invalid proposal scores 0 for the proposer; the solver plays the row's fallback secret
    llm = ScriptedLLM({("proposer", "proposer"): ["many"], ("solver", "solver"): ["4"]})
    assert anyio.run(propose, task, llm) == {"proposer": 0.0, "solver": 1.0}
    assert llm.info["valid"] is False and llm.info["secret"] == 4
    assert all(1 <= r["low"] <= r["secret"] <= r["high"] <= 10 for r in dataset("propose", 50))


def test_framework_tasks_rules_and_rewards():
    import json

    from jet.tasks import lookup, spell, units

    assert units.convert_value(3, "km", "m") == 3000 and units.convert_value(2, "h", "min") == 120
    for bad in (("m", "kg"), ("m", "parsec")):
        with pytest.raises(ValueError):
            units.convert_value(1, *bad)
    assert units.convert_json({"value": 7, "unit_from": "t", "unit_to": "kg"}) == ('{"result": 7000}', True)
    assert not units.convert_json({"value": "x", "unit_from": "t"})[1]
    assert all(r["answer"] == units.convert_value(r["value"], r["unit_from"], r["unit_to"]) and
               isinstance(r["answer"], int) for r in dataset("units", 30))
    assert lookup.code("otter") == lookup.code("otter") != lookup.code("heron") and 100 <= lookup.code("lynx") <= 999
    assert json.loads(lookup.lookup_json(" Otter ")[0]) == {"result": lookup.code("otter")}
    assert not lookup.lookup_json("dragon")[1] and not lookup.lookup_json(3)[1]
    assert all(r["answer"] == lookup.code(r["name"]) for r in dataset("lookup", 20))
    assert spell.score(["Retto!"], "retto") == 1.0 and spell.score(["no", "retto"], "retto") == 0.5
    assert spell.score(["rexxx"], "retto") == pytest.approx(0.3 * 0.4) and spell.score([], "retto") == 0.0
    assert all(r["answer"] == r["word"][::-1] for r in dataset("spell", 20))


def test_every_task_with_a_held_out_split_keeps_the_protocol():
    kinds = {}
    for name in HELD_OUT:
        spec = held_out_task(name)
        kinds[name] = (spec.kind, spec.max_tokens, spec.turns)
        assert name in DATASETS and spec.name == f"jet.tasks.{name}"
        rows = spec.eval_rows(3, 0)
        assert rows == held_out(name, 3, 0) and len(rows) == 3
        if spec.kind == "single":
            assert spec.environment is None and isinstance(spec.messages(rows[0]), list)
            assert isinstance(spec.score(rows[0], "no number"), float)
        else:
            env = spec.environment(rows[0])
            assert spec.messages is None and env.opening()[-1]["role"] == "user"
            assert isinstance(env.answer("1"), str) and 0.0 <= env.reward <= 1.0
    assert kinds == {"add": ("single", 24, 1), "tally": ("multi", 8, 4)}


def _fake(**parts):
    return SimpleNamespace(__name__="jet.tasks.x", **parts)


def rows_of(n, seed):
    return [{"n": i} for i in range(n)]


@pytest.mark.parametrize("parts, message", [
    ({"messages": print}, "jet.tasks.x lacks eval_rows and score (a single-turn task defines"),
    ({}, "jet.tasks.x lacks eval_rows, messages and score"),
    ({"eval_rows": rows_of, "score": print}, "jet.tasks.x lacks messages ("),
    ({"eval_rows": rows_of, "environment": dict}, "jet.tasks.x lacks TURNS (a multi-turn task (it has an environment"),
    ({"environment": dict, "TURNS": 2}, "jet.tasks.x lacks eval_rows (a multi-turn"),
    ({"eval_rows": rows_of, "messages": "hi", "score": print}, "jet.tasks.x: messages must be callable"),
    ({"eval_rows": rows_of, "messages": print, "score": print, "MAX_TOKENS": 0},
     "jet.tasks.x.MAX_TOKENS: expected an int >= 1, got 0"),
    ({"eval_rows": rows_of, "environment": dict, "TURNS": "4"}, "jet.tasks.x.TURNS: expected an int >= 1, got '4'"),
])
def test_the_protocol_check_names_what_a_module_lacks(parts, message):
    with pytest.raises(ConfigError) as e:
        spec_of(_fake(**parts))
    assert str(e.value).startswith(message), str(e.value)


def test_a_module_that_keeps_the_protocol_is_loaded_whole():
    single = spec_of(_fake(eval_rows=rows_of, messages=print, score=print, MAX_TOKENS=5))
    assert (single.kind, single.max_tokens, single.turns) == ("single", 5, 1)
    assert single.eval_rows(2, 0) == [{"n": 0}, {"n": 1}] and single.environment is None
    multi = spec_of(_fake(eval_rows=rows_of, environment=dict, TURNS=3, messages=print))
    assert (multi.kind, multi.turns, multi.max_tokens) == ("multi", 3, 24)
    assert multi.messages is None and multi.environment is dict  # an environment wins over stray messages


def test_only_tasks_with_a_held_out_split_load():
    with pytest.raises(ConfigError, match="task 'guess' has no held-out split; built-in tasks with a held-out "
                                          "split: add, tally"):
        held_out_task("guess")
    with pytest.raises(ConfigError, match="task 'nope' is no built-in task"):
        held_out_task("nope")
    with pytest.raises(ConfigError, match="dataset 'arith' has no built-in held-out split"):
        held_out("arith")
