"""The "arith" task (an `openai`-SDK agent with a calculator tool) end to end: tasks -> env worker ->
gateway -> inference worker -> trajectories, with the embedded gateway and with a standalone one.

A scripted inference backend plays a perfect agent (call the calculator, then answer), so the
tool-call round trip and the reward are checked exactly; one run on the random tiny model checks
that real generation gives well-formed trajectories whose logprobs match a forward pass.
"""

from __future__ import annotations

import contextlib
import functools
import json

import anyio
import pytest

from jet.models import init_model
from jet.queues.connect import connect
from jet.tasks import dataset
from jet.tasks.arith import TOOLS, Attempt, calculator, last_number, score
from jet.workers.inference import worker as infer
from jet.workers.rollout import worker as env
from tests.workers.conftest import MODEL, enqueue, trajectories, wait_for, write_config
from tests.workers.gateway.test_gateway import ScriptedBackend, standalone_gateway
from tests.workers.test_e2e import assert_logprobs_match_a_forward_pass, load_model, runs


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny model with room for the tools preamble (about 200 tokens) and a few turns."""
    return init_model(tmp_path_factory.mktemp("model") / MODEL, vocab_size=512, hidden_size=32, layers=2,
                      heads=4, kv_heads=2, max_position=1024, seed=0)


def arith_config(tmp_path, keys, model_dir):
    return write_config(tmp_path / "c.yaml", keys.run, model_dir, [
        {"name": "arith", "workflow": "jet.tasks.arith:workflow", "dataset": "arith", "episode_timeout_s": 60}])


@contextlib.asynccontextmanager
async def running(cfg, url, backend=None, gateway_url=None):
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(infer.run, cfg, MODEL, url, stop, backend=backend))
        tg.start_soon(functools.partial(env.run, cfg, url, stop, drain_timeout_s=5, gateway_url=gateway_url))
        try:
            yield
        finally:
            stop.set()


async def n_trajectories(url, keys, n):
    trajs = await trajectories(url, keys)
    return trajs if len(trajs) >= n else None


def test_calculator_answers_and_rewards():
    assert calculator(json.dumps({"expression": "12 + 7 * 3"})) == ('{"result": 33}', True)
    for bad in ('{"expression": "__import__(1)"}', '{"x": 1}', "not json", '{"expression": "1/0"}'):
        text, ok = calculator(bad)
        assert not ok and "error" in json.loads(text)
    assert last_number("12 + 7 * 3 = 33.") == 33 and last_number("-4.5 then") == -4.5 and last_number("no") is None
    assert score(Attempt(answer=33.0), 33) == 1.0
    assert score(Attempt(answer=32.0, tool_ok=1), 33) == pytest.approx(0.2)
    assert score(Attempt(answer=None, tool_ok=1), 33) == pytest.approx(0.1) and score(Attempt(), 33) == 0.0


def check_perfect_episodes(trajs, rows, tok):
    assert len(trajs) == 2 * len(rows) and not [t.error for t in trajs if t.failed]
    for t in trajs:
        row = rows[int(t.group_id[1:])]
        info = t.meta["info"]
        assert t.reward == 1.0 and info == {"answer": row["answer"], "correct": True, "tool_calls": 1, "tool_ok": 1,
                                      "turns": 2}
        [sample] = t.samples  # tool call, tool result, answer: one timeline
        assert t.meta["calls"] == 2 and len(runs(sample.mask)) == 2 and set(sample.versions) <= {-1, 0}
        text = tok.decode(sample.tokens, skip_special_tokens=False)
        call = {"name": "calculator", "arguments": {"expression": row["question"]}}
        assert f"What is {row['question']}?<|im_end|>" in text and f"<tool_call>{json.dumps(call)}</tool_call>" in text
        assert text.endswith(f"<|im_start|>tool\n{json.dumps({'result': row['answer']})}<|im_end|>\n"
                             f"<|im_start|>assistant\nThe answer is {row['answer']}.<|im_end|>")
        trained = tok.decode([x for x, m in zip(sample.tokens, sample.mask) if m], skip_special_tokens=False)
        assert trained == f"<tool_call>{json.dumps(call)}</tool_call><|im_end|>The answer is {row['answer']}.<|im_end|>"


@pytest.mark.anyio
async def test_arith_through_the_embedded_gateway(redis_url, keys, long_model, tmp_path):
    cfg = arith_config(tmp_path, keys, long_model)
    backend = ScriptedBackend(long_model)
    rows = dataset("arith", 2, seed=1)
    await enqueue(redis_url, keys, "arith", rows)
    async with running(cfg, redis_url, backend):
        trajs = await wait_for(lambda: n_trajectories(redis_url, keys, 4), timeout=60)
    check_perfect_episodes(trajs, rows, backend.tok)


@pytest.mark.anyio
async def test_arith_through_a_standalone_gateway(redis_url, keys, long_model, tmp_path):
    cfg = arith_config(tmp_path, keys, long_model)
    backend = ScriptedBackend(long_model)
    rows = dataset("arith", 2, seed=2)
    await enqueue(redis_url, keys, "arith", rows)
    async with standalone_gateway(cfg, redis_url) as base_url, running(cfg, redis_url, backend, base_url):
        trajs = await wait_for(lambda: n_trajectories(redis_url, keys, 4), timeout=60)
    check_perfect_episodes(trajs, rows, backend.tok)
    r = await connect(redis_url)
    assert not [k for k in await r.keys(keys.pattern()) if b":calls:" in k]  # every calls stream collected
    await r.aclose()


def sync_agent(task, llm):
    """The arith game from a plain sync function with the blocking `openai.OpenAI` client: the workflow
    runs in a thread while the embedded gateway answers on the worker's event loop."""
    with llm.openai_client() as client:
        messages = [{"role": "user", "content": f"What is {task.row['question']}?"}]
        first = client.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=TOOLS).choices[0]
        [call] = first.message.tool_calls
        messages += [first.message.model_dump(), {"role": "tool", "tool_call_id": call.id,
                                                  "content": calculator(call.function.arguments)[0]}]
        final = client.chat.completions.create(model="gpt-4o-mini", messages=messages, tools=TOOLS).choices[0]
    return float(last_number(final.message.content) == task.row["answer"])


@pytest.mark.anyio
async def test_a_sync_agent_with_the_blocking_client(redis_url, keys, long_model, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", keys.run, long_model, [
        {"name": "sync", "workflow": "tests.workers.test_arith:sync_agent", "dataset": "arith"}])
    await enqueue(redis_url, keys, "sync", dataset("arith", 1, seed=4), group_size=1)
    async with running(cfg, redis_url, ScriptedBackend(long_model)):
        [t] = await wait_for(lambda: n_trajectories(redis_url, keys, 1), timeout=60)
    assert not t.failed and t.reward == 1.0 and t.meta["calls"] == 2 and len(runs(t.samples[0].mask)) == 2


@pytest.mark.anyio
async def test_arith_on_the_random_tiny_model(redis_url, keys, long_model, tmp_path):
    cfg = arith_config(tmp_path, keys, long_model)
    rows = [{**row, "max_tokens": 12, "max_turns": 2} for row in dataset("arith", 2, seed=3)]
    await enqueue(redis_url, keys, "arith", rows)
    async with running(cfg, redis_url):
        trajs = await wait_for(lambda: n_trajectories(redis_url, keys, 4), timeout=90)
    assert len(trajs) == 4 and not [t.error for t in trajs if t.failed]
    model = load_model(long_model)
    for t in trajs:
        info = t.meta["info"]
        assert 1 <= info["turns"] == t.meta["calls"] <= 2 and t.reward in (0.0, 0.1, 0.2, 1.0)
        assert t.reward == score(Attempt(answer=info["answer"], tool_ok=info["tool_ok"]),
                                 rows[int(t.group_id[1:])]["answer"])
        assert sum(len(runs(s.mask)) for s in t.samples) == t.meta["calls"]
        for sample in t.samples:
            assert_logprobs_match_a_forward_pass(model, sample, temperature=1.0)
