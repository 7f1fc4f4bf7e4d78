"""jet.workers.episode without Redis: rewards, per-agent merging, failures, what gets published."""

import anyio
import pytest

from jet.timeline import Call
from jet.wire import Task
from jet.workers.episode import Outcome, check_reward, merge, play, trajectories


def call(prompt, completion, model="m", agent="a"):
    return Call(prompt, completion, [-0.5] * len(completion), 0, model, agent)


CALLS = [call([1, 2], [3]), call([1, 2, 3, 4], [5]), call([7, 8], [9], agent="b"), call([1], [2], model="judge")]


def test_rewards_are_finite_numbers_or_dicts_of_them():
    assert check_reward(1) == 1.0 and check_reward({"a": 1, "b": 0.5}) == {"a": 1.0, "b": 0.5}
    for bad in (float("nan"), "1", True, None, {"a": "x"}, [1.0]):
        with pytest.raises(ValueError):
            check_reward(bad)


def test_one_reward_merges_all_calls_of_trained_models():
    out = merge(CALLS, 0.5, "exact", "ep", trained={"m"})
    assert list(out) == ["m"]  # the frozen judge's call is context, not training data
    assert sorted(s.tokens for s in out["m"]) == [(1, 2, 3, 4, 5), (7, 8, 9)]
    assert all(s.rewards == (0.5,) and s.episode_ids == ("ep",) for s in out["m"])


def test_per_agent_rewards_merge_each_agent_separately():
    out = merge(CALLS, {"a": 1.0, "b": -1.0}, "exact", "ep", trained={"m", "judge"})
    by_agent = {s.agents: s for s in out["m"]}
    assert by_agent[("a",)].rewards == (1.0,) and by_agent[("b",)].rewards == (-1.0,)
    with pytest.raises(ValueError, match=r"no entry for agent\(s\) \['b'\]"):
        merge(CALLS, {"a": 1.0}, "exact", "ep", trained={"m"})


def test_trajectories_go_to_every_trained_model_and_failures_to_the_task_model():
    task = Task("t", {}, "g", 1, 4, attempt=1)
    ok = Outcome(reward=1.0, samples=merge(CALLS, 1.0, "exact", "ep", {"m", "judge"}), calls=4)
    trajs = trajectories(task, ok, episode_id="ep", task_model="m", trained={"m", "judge"}, retry=True, meta={})
    assert [(t.model, len(t.samples), t.failed, t.retry) for t in trajs] == [("judge", 1, False, False),
                                                                           ("m", 2, False, False)]
    bad = Outcome(calls=1)
    bad.fail("RuntimeError: x", "Traceback ...")
    [t] = trajectories(task, bad, episode_id="ep", task_model="m", trained={"m"}, retry=True, meta={"w": 1})
    assert t.failed and t.retry and t.samples == () and t.reward == 0.0 and t.attempt == 1 and t.meta["w"] == 1


@pytest.mark.anyio
async def test_play_turns_exceptions_and_timeouts_into_failed_outcomes():
    class FakeSession:
        episode_id, calls, info = "ep", [], {"k": {1, 2}}

    async def raises(task, llm):
        raise KeyError("secret")

    async def hangs(task, llm):
        await anyio.sleep(30)

    def bad_reward(task, result):
        return "high"

    task = Task("t", {}, "g")
    out = await play(task, FakeSession(), raises, None, timeout_s=5, merge_mode="exact", trained={"m"})
    assert out.failed and out.error == "KeyError: 'secret'" and "raise KeyError" in out.traceback
    assert out.info == {"k": "{1, 2}"}  # made JSON-safe
    out = await play(task, FakeSession(), hangs, None, timeout_s=0.2, merge_mode="exact", trained={"m"})
    assert out.error == "episode timed out after 0.2s" and out.duration_s < 5
    out = await play(task, FakeSession(), lambda t, llm: 1, bad_reward, timeout_s=5, merge_mode="exact",
                     trained={"m"})
    assert out.failed and "finite number" in out.error
