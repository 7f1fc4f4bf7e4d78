"""The "tally" and "add" agents (`openai`-SDK code) end to end through the embedded gateway: tasks -> env
worker -> gateway -> inference worker -> trajectories. A scripted backend answers like a perfect
bookkeeper (it replays each dialogue with the task's environment), so the four-turn dialogue, the
environment's replies, the token-exact merge into one timeline and the reward are checked exactly."""

from __future__ import annotations

import re

import pytest

from jet.tasks import add, tally
from tests.workers.conftest import enqueue, wait_for, write_config
from tests.workers.gateway.test_gateway import ScriptedBackend
from tests.workers.test_arith import long_model, n_trajectories, running  # noqa: F401 - a fixture
from tests.workers.test_e2e import runs


class Bookkeeper(ScriptedBackend):
    """The right total for a tally dialogue (the exercise after the worked one, replayed), the right sum
    for an add question."""

    def reply(self, prompt_text: str) -> str:
        users = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt_text, flags=re.S)
        question = re.search(r"What is (\d+) \+ (\d+)\?", users[-1])
        if question:
            return f"{int(question.group(1)) + int(question.group(2))}"
        mine = users[len(tally.EXAMPLE):]  # the worked exercise's user turns come first
        start = int(re.search(r"starts at (\d+)\.", mine[0]).group(1))
        changes = [int(n) * (1 if verb == "Add" else -1) for m in mine
                   for verb, n in re.findall(r"(Add|Subtract) (\d+)\.", m)]
        return str(start + sum(changes))


@pytest.mark.anyio
async def test_the_tally_dialogue_is_one_timeline_of_four_trained_turns(redis_url, keys, long_model, tmp_path):  # noqa: F811
    cfg = write_config(tmp_path / "c.yaml", keys.run, long_model, [
        {"name": "tally", "workflow": "jet.tasks.tally:workflow", "dataset": "tally", "episode_timeout_s": 60}])
    backend = Bookkeeper(long_model)
    rows = tally.rows(2, seed=5)
    await enqueue(redis_url, keys, "tally", rows)
    async with running(cfg, redis_url, backend):
        trajs = await wait_for(lambda: n_trajectories(redis_url, keys, 4), timeout=60)
    assert len(trajs) == 4 and not [t.error for t in trajs if t.failed]
    for t in trajs:
        row = rows[int(t.group_id[1:])]
        assert t.reward == 1.0 and t.meta["info"] == {"right": 4, "turns": 4} and t.meta["calls"] == 4
        [sample] = t.samples  # four turns, each extending the last: one timeline
        assert len(runs(sample.mask)) == 4
        text = backend.tok.decode(sample.tokens, skip_special_tokens=False)
        total = row["start"]
        for k, d in enumerate(row["changes"][:-1]):
            total += d
            assert f"<|im_start|>assistant\n{total}<|im_end|>" in text
            assert f"Correct. {tally.change_text(row['changes'][k + 1])}" in text


@pytest.mark.anyio
async def test_the_add_agent_is_paid_for_the_right_sum(redis_url, keys, long_model, tmp_path):  # noqa: F811
    cfg = write_config(tmp_path / "c.yaml", keys.run, long_model, [
        {"name": "add", "workflow": "jet.tasks.add:workflow", "dataset": "add", "episode_timeout_s": 60}])
    rows = add.rows(2, seed=1)
    await enqueue(redis_url, keys, "add", rows)
    async with running(cfg, redis_url, Bookkeeper(long_model)):
        trajs = await wait_for(lambda: n_trajectories(redis_url, keys, 4), timeout=60)
    assert sorted(t.reward for t in trajs) == [1.0] * 4
    assert all(t.meta["info"]["answer"] == rows[int(t.group_id[1:])]["answer"] for t in trajs)
