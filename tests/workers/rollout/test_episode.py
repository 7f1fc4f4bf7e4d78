"""jet.workers.rollout.episode without Redis: rewards, per-agent merging, failures, what gets published."""

import anyio
import pytest

from jet.timeline import Call
from jet.wire import Task
from jet.workers.rollout.episode import Outcome, check_reward, code_version, merge, play, trajectories


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


@pytest.mark.anyio
async def test_each_models_trajectory_records_the_versions_of_the_other_models_it_played_against():
    class FakeSession:
        episode_id, info = "ep", {}
        calls = [Call([1, 2], [3], [-0.5], 4, "m", "a"), Call([5], [6], [-0.5], 3, "planner", "p"),
                 Call([5, 6, 7], [8], [-0.5], 4, "planner", "p"), Call([1], [2], [-0.5], 0, "judge", "j")]

    out = await play(Task("t", {}, "g"), FakeSession(), lambda t, llm: 1.0, None, timeout_s=5,
                     merge_mode="exact", trained={"m", "planner"})
    assert out.versions == {"m": [4], "planner": [3, 4], "judge": [0]}
    by_model = {t.model: t for t in trajectories(Task("t", {}, "g"), out, episode_id="ep", task_model="m",
                                                 trained={"m", "planner"}, retry=False, meta={})}
    assert by_model["m"].meta["opponent_versions"] == {"judge": [0], "planner": [3, 4]}
    assert by_model["planner"].meta["opponent_versions"] == {"judge": [0], "m": [4]}
    alone = Outcome(reward=1.0, versions={"m": [1]})
    [t] = trajectories(Task("t", {}, "g"), alone, episode_id="ep", task_model="m", trained={"m"}, retry=False,
                       meta={})
    assert "opponent_versions" not in t.meta


def test_code_version_hashes_the_workflow_sources_and_the_runtime_cwd(tmp_path):
    import importlib
    import sys

    (tmp_path / "cvflow.py").write_text("def wf(task, llm):\n    return 1.0\n")
    (tmp_path / "helper.py").write_text("X = 1\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "ignored.py").write_text("Y = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        wf = importlib.import_module("cvflow").wf
        a = code_version([wf, None])
        assert a == code_version([wf, None]) and len(a) == 12
        assert code_version([wf, None], str(tmp_path)) != a  # the helper counts under cwd
        with_cwd = code_version([wf, None], str(tmp_path))
        (tmp_path / ".venv" / "ignored.py").write_text("Y = 2\n")
        assert code_version([wf, None], str(tmp_path)) == with_cwd
        (tmp_path / "helper.py").write_text("X = 2\n")
        assert code_version([wf, None], str(tmp_path)) != with_cwd
        (tmp_path / "cvflow.py").write_text("def wf(task, llm):\n    return 2.0\n")
        assert code_version([wf, None]) != a  # the module's file as it is now on disk
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("cvflow", None)


def test_a_failed_team_episode_reaches_every_trained_model_it_called():
    bad = Outcome(versions={"proposer": [2], "solver": [5], "frozen": [0]})
    bad.fail("ValueError: boom")
    trajs = trajectories(Task("team", {}, "g"), bad, episode_id="ep", task_model="proposer",
                         trained={"proposer", "solver"}, retry=False, meta={})
    assert [(t.model, t.failed, t.samples) for t in trajs] == [("proposer", True, ()), ("solver", True, ())]


@pytest.mark.anyio
async def test_an_episode_without_llm_calls_is_flagged_counted_and_warned_about_once(redis_url, keys, caplog,
                                                                                  monkeypatch):
    import os

    from rich.console import Console

    from jet.cli.status import render
    from jet.queues import admin
    from jet.queues.connect import connect
    from jet.workers.rollout.episode import warn_no_llm_calls

    class Silent:  # a session the workflow never uses: it "talked to some other endpoint"
        episode_id, calls, info = "ep", [], {}

    task = Task("t", {}, "g")
    out = await play(task, Silent(), lambda t, llm: 1.0, None, timeout_s=5, merge_mode="exact", trained={"m"})
    [t] = trajectories(task, out, episode_id="ep", task_model="m", trained={"m"}, retry=False, meta={})
    assert not t.failed and t.samples == () and t.meta["no_llm_calls"] is True and t.meta["calls"] == 0
    talked = Outcome(reward=1.0, samples=merge(CALLS, 1.0, "exact", "ep", {"m"}), calls=4)
    failed = Outcome(calls=0)
    failed.fail("RuntimeError: x")
    for other in (talked, failed):  # a failure already says why; only a finished, silent episode is flagged
        assert all("no_llm_calls" not in x.meta for x in trajectories(task, other, episode_id="ep", task_model="m",
                                                                       trained={"m"}, retry=False, meta={}))
    from jet.workers.rollout import episode

    monkeypatch.setattr(episode, "_warned_no_calls", set())  # a fresh worker process: nothing warned yet
    monkeypatch.setenv("OPENAI_BASE_URL", "https://api.example.com/v1")
    with caplog.at_level("WARNING", logger="jet.workers.rollout.episode"):
        for worker, tsk in (("w0", "t"), ("w0", "t"), ("w0", "t2"), ("w1", "t")):
            assert warn_no_llm_calls(out, task=tsk, worker=worker)
        assert not warn_no_llm_calls(talked, task="t", worker="w0")
        assert not warn_no_llm_calls(failed, task="t", worker="w0")
    warnings = [rec.getMessage() for rec in caplog.records if "no LLM call" in rec.getMessage()]
    assert len(warnings) == 3  # once per (worker, task)
    assert "llm.openai_client()" in warnings[0] and "OPENAI_BASE_URL=https://api.example.com/v1" in warnings[0]
    r = await connect(redis_url)
    try:
        # The env worker's commit of each such episode bumps the counter in the same Lua step
        # (tests/workers/rollout/test_no_llm_calls.py runs that path); here: what four of them leave.
        await r.hincrby(keys.stats, "no_llm_calls", 4)
        report = await admin.report(r, keys, redis_url)
        assert report["stats"]["no_llm_calls"] == 4
    finally:
        await r.aclose()
    console = Console(record=True, width=200, file=open(os.devnull, "w"))
    console.print(render([report]))
    text = console.export_text()
    assert "episodes with no LLM call │ 4 " in text and "they train nothing" in text
