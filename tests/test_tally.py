"""The tally task: its splits, its environment's replies and reward, and `jet eval`'s multi-turn loop."""

import pytest

from jet.eval import evaluate, play
from jet.stats import interval
from jet.tasks import dataset, tally


def test_the_splits_are_disjoint_deterministic_and_well_formed():
    train, held = tally.rows(3000), tally.eval_rows(300)
    key = lambda r: (r["start"], tuple(r["changes"]))  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in held}
    assert all(tally.is_eval(r) for r in held) and not any(tally.is_eval(r) for r in train)
    assert dataset("tally", 5, seed=2) == tally.rows(5, seed=2) != tally.rows(5, seed=3)
    for r in train + held:
        assert tally.LOW <= r["start"] <= tally.HIGH and len(r["changes"]) == tally.TURNS
        totals = [r["start"] + sum(r["changes"][:k + 1]) for k in range(tally.TURNS)]
        assert all(1 <= abs(d) <= 9 for d in r["changes"]) and min(totals) >= 0


def test_the_environment_answers_each_reply_and_pays_each_right_total():
    env = tally.Tally({"start": 23, "changes": [4, -6, 9, -5]})
    opening = env.opening()
    assert opening[0] == {"role": "system", "content": tally.SYSTEM} and opening[-1]["role"] == "user"
    assert opening[-1]["content"].endswith("the total starts at 23. Add 4.")
    assert len(opening) == 2 + 2 * len(tally.EXAMPLE)
    assert env.answer("27") == "Correct. Subtract 6."
    assert env.answer("The total is 20.") == "Wrong: the total is 21. Add 9."  # the last integer counts
    assert env.answer("30") == "Correct. Subtract 5."
    assert env.answer(None) is None and env.turn == 4  # the last change: the dialogue ends
    assert env.reward == pytest.approx(0.5)


class Scripted:
    """A tokenizer and backend stand-in: each rendered dialogue is one id; the reply is the right total
    when the exercise started at an even number, else 0."""

    def __init__(self):
        self.dialogues: list[list[dict]] = []

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=True):
        self.dialogues.append([dict(m) for m in messages])
        return [len(self.dialogues) - 1]

    def reply(self, prompts):
        out = []
        for [i] in prompts:
            messages = self.dialogues[i]
            first = next(m["content"] for m in messages[1 + 2 * len(tally.EXAMPLE):] if m["role"] == "user")
            start = int(first.split("starts at ")[1].split(".")[0])
            env = tally.Tally({"start": start, "changes": CHANGES})
            for m in messages[2 + 2 * len(tally.EXAMPLE):]:
                if m["role"] == "assistant":
                    env.answer(m["content"])
            out.append(str(env.total + CHANGES[env.turn]) if start % 2 == 0 else "0")
        return out


CHANGES = [4, -6, 9, -5]


def test_eval_plays_every_turn_and_continues_after_wrong_answers():
    s = Scripted()
    rows = [{"start": 20, "changes": CHANGES}, {"start": 21, "changes": CHANGES}, {"start": 30, "changes": CHANGES}]
    rewards = play(rows, tally.environment, s.reply, lambda m: s.apply_chat_template(m))
    assert rewards == [1.0, 0.0, 1.0]
    assert len(s.dialogues) == 3 * tally.TURNS  # every row rendered once per turn
    last = s.dialogues[-1]  # row 2 at its fourth turn: three right totals behind it
    assert [m["content"] for m in last[-3:]] == ["Correct. Add 9.", "37", "Correct. Subtract 5."]
    wrong = next(d for d in s.dialogues if "Wrong" in d[-1]["content"])
    assert wrong[-1]["content"] == "Wrong: the total is 25. Subtract 6."


def test_the_interval_is_wilsons_for_0_1_results_and_normal_for_fractions():
    from jet.stats import wilson

    assert interval([1, 0, 0, 1]) == wilson(2, 4)
    lo, hi = interval([0.25, 0.5, 0.25, 0.0])
    assert lo == pytest.approx(0.25 - 1.959964 * 0.2041241 / 2, abs=1e-6) and hi == pytest.approx(0.25 + 0.2000505,
                                                                                                 abs=1e-4)


@pytest.mark.slow
def test_jet_eval_runs_the_dialogue_on_a_real_tiny_model(tiny_model):
    """The whole path on a real (random) model: chat template, greedy generation, four turns per row."""
    report = evaluate(str(tiny_model), "tally", 3, max_tokens=3, batch=2)
    assert report["n"] == 3 and len(report["results"]) == 3
    assert all(r in (0, 0.25, 0.5, 0.75, 1.0) for r in report["results"]) and report["max_tokens"] == 3
