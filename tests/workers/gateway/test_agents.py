"""Agent frameworks trained unchanged through the gateway: LangChain, the OpenAI Agents SDK on the Responses
API (streamed) and on chat completions, plain httpx; each the built-in task's own agent code, run by a real
env worker against a real inference worker.

A scripted backend plays a perfect agent for every task (call the task's tool with the row's arguments, then
answer with the tool's result), so each episode's reward is exactly 1.0 and its calls merge into one timeline
(the kept token ids extend across the framework's turns); the embedded and the standalone gateway both serve.
"""

from __future__ import annotations

import json
import re

import pytest

from jet.tasks import dataset
from jet.tasks.lookup import code
from jet.tasks.units import convert_value
from tests.workers.conftest import enqueue, wait_for, write_config
from tests.workers.gateway.test_gateway import ScriptedBackend, standalone_gateway
from tests.workers.test_arith import long_model, n_trajectories, running  # noqa: F401 - fixtures
from tests.workers.test_e2e import runs


class ToolAgentBackend(ScriptedBackend):
    """ScriptedBackend that also knows the units, lookup and spell tasks' questions."""

    def reply(self, prompt_text: str) -> str:
        last = prompt_text[:prompt_text.rfind("<|im_start|>assistant")].rsplit("<|im_start|>", 1)[-1]
        if m := re.search(r"Convert (\d+) (\w+) to (\w+)\.", last):
            args = {"value": int(m.group(1)), "unit_from": m.group(2), "unit_to": m.group(3)}
            return f"<tool_call>{json.dumps({'name': 'convert', 'arguments': args})}</tool_call>"
        if m := re.search(r"code number of the (\w+)\?", last):
            return f"<tool_call>{json.dumps({'name': 'lookup', 'arguments': {'name': m.group(1)}})}</tool_call>"
        if m := re.search(r"Spell '(\w+)' backwards\.", last):
            return m.group(1)[::-1]
        return super().reply(prompt_text)


def config(tmp_path, keys, model_dir, name, workflow, dataset_name):
    return write_config(tmp_path / "c.yaml", keys.run, model_dir, [
        {"name": name, "workflow": workflow, "dataset": dataset_name, "episode_timeout_s": 60}])


def check_perfect(trajs, n, calls):
    assert len(trajs) == n and not [t.error for t in trajs if t.failed], [t.error for t in trajs]
    for t in trajs:
        assert t.reward == 1.0, t.meta
        [sample] = t.samples  # every call of the episode in one timeline
        assert t.meta["calls"] == calls and len(runs(sample.mask)) == calls and len(sample.tokens) > 0
        assert "undelivered_calls" not in t.meta


CASES = {  # task: (workflow, dataset, calls per perfect episode, row overrides)
    "langchain": ("jet.tasks.units:workflow", "units", 2, {}),
    "agents-responses": ("jet.tasks.lookup:workflow", "lookup", 2, {}),  # streamed
    "agents-responses-run": ("jet.tasks.lookup:workflow", "lookup", 2, {"stream": False}),
    "agents-chat": ("jet.tasks.lookup:chat_workflow", "lookup", 2, {}),
    "agents-chat-streamed": ("jet.tasks.lookup:chat_workflow", "lookup", 2, {"stream": True}),
    "httpx": ("jet.tasks.spell:workflow", "spell", 1, {}),
}


@pytest.mark.anyio
@pytest.mark.parametrize("case", sorted(CASES))
async def test_framework_agents_through_the_embedded_gateway(case, redis_url, keys, long_model, tmp_path):
    workflow, data, calls, extra = CASES[case]
    cfg = config(tmp_path, keys, long_model, case, workflow, data)
    backend = ToolAgentBackend(long_model)
    rows = [{**row, **extra} for row in dataset(data, 2, seed=5)]
    await enqueue(redis_url, keys, case, rows)
    async with running(cfg, redis_url, backend):
        trajs = await wait_for(lambda: n_trajectories(redis_url, keys, 4), timeout=90)
    check_perfect(trajs, 4, calls)
    for t in trajs:
        row = rows[int(t.group_id[1:])]
        text = backend.tok.decode(t.samples[0].tokens)
        if data == "units":
            assert f"\"result\": {convert_value(row['value'], row['unit_from'], row['unit_to'])}" in text
        if data == "lookup":
            assert t.meta["info"]["api"] == ("chat" if "chat" in workflow else "responses")
            assert t.meta["info"]["stream"] == row.get("stream", "chat" not in workflow)
            assert t.meta["info"]["gave_up"] is None and f"The answer is {code(row['name'])}." in text
        if data == "spell":
            assert t.meta["info"] == {"replies": 1, "solved_on": 1}


@pytest.mark.anyio
@pytest.mark.parametrize("case", ["agents-responses", "httpx"])
async def test_framework_agents_through_a_standalone_gateway(case, redis_url, keys, long_model, tmp_path):
    workflow, data, calls, _ = CASES[case]
    cfg = config(tmp_path, keys, long_model, case, workflow, data)
    await enqueue(redis_url, keys, case, dataset(data, 1, seed=6))
    async with standalone_gateway(cfg, redis_url) as base_url, running(cfg, redis_url, ToolAgentBackend(long_model),
                                                                        base_url):
        trajs = await wait_for(lambda: n_trajectories(redis_url, keys, 2), timeout=90)
    check_perfect(trajs, 2, calls)
