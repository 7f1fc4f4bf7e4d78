"""An env worker flags, counts and warns about episodes that recorded no LLM call."""

from __future__ import annotations

import functools

import anyio
import pytest

from jet.queues import admin
from jet.queues.connect import connect
from jet.workers.rollout import worker as env
from tests.workers.conftest import enqueue, trajectories, wait_for, write_config


def silent(task, llm):
    """An agent that "talked to some other endpoint": it never calls the model it was given."""
    return 1.0


@pytest.mark.anyio
async def test_the_env_worker_counts_and_warns_about_episodes_without_llm_calls(redis_url, keys, tiny_model,
                                                                               tmp_path, caplog, monkeypatch):
    from jet.workers.rollout import episode

    monkeypatch.setattr(episode, "_warned_no_calls", set())  # a fresh worker process: nothing warned yet
    cfg = write_config(tmp_path / "c.yaml", keys.run, tiny_model, [
        {"name": "quiet", "workflow": "tests.workers.rollout.test_no_llm_calls:silent", "group_size": 2}])
    await enqueue(redis_url, keys, "quiet", [{}, {}, {}], group_size=2)
    stop = anyio.Event()
    with caplog.at_level("WARNING", logger="jet.workers.rollout.episode"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(env.run, cfg, redis_url, stop, drain_timeout_s=5))
            trajs = await wait_for(lambda: _six(redis_url, keys), timeout=60)
            stop.set()
    assert all(t.meta["no_llm_calls"] and t.samples == () and not t.failed for t in trajs)
    r = await connect(redis_url)
    try:
        assert (await admin.report(r, keys, redis_url))["stats"]["no_llm_calls"] == 6
    finally:
        await r.aclose()
    warned = [rec.getMessage() for rec in caplog.records if "recorded no LLM call" in rec.getMessage()]
    assert len(warned) == 1 and "task quiet" in warned[0]  # once per worker and task, not per episode


async def _six(url, keys):
    got = await trajectories(url, keys)
    return got if len(got) >= 6 else None
