"""End to end on CPU against a real server: tasks -> env worker + inference worker -> trajectories.

Both workers run in this process (their `run` coroutines), with the hf backend
on a tiny random model. Checked: the trajectory tokens decode to the
conversation, the behaviour logprobs equal a fresh forward pass of the same
weights (float32, absolute tolerance 1e-4), failures stay within their episode.
"""

from __future__ import annotations

import contextlib
import functools

import anyio
import pytest
import torch

from jet.queues import admin, codec, registry
from jet.queues.connect import connect
from jet.tasks import dataset
from jet.tasks.guess import score
from jet.workers.inference import worker as infer
from jet.workers.rollout import worker as env
from tests.workers.conftest import HOST, MODEL, enqueue, trajectories, wait_for, write_config

LOGPROB_ATOL = 1e-4  # float32 on CPU: batched, left-padded, KV-cached decoding vs one unpadded forward


@contextlib.asynccontextmanager
async def running_workers(cfg, url):
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(infer.run, cfg, MODEL, url, stop))
        tg.start_soon(functools.partial(env.run, cfg, url, stop, drain_timeout_s=5))
        try:
            yield
        finally:
            stop.set()


def load_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_logprobs_match_a_forward_pass(model, sample, temperature):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([sample.tokens])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    trained = [i for i, m in enumerate(sample.mask) if m]
    ref = logp[[i - 1 for i in trained], [sample.tokens[i] for i in trained]]
    got = torch.tensor([sample.logprobs[i] for i in trained])
    torch.testing.assert_close(got, ref, atol=LOGPROB_ATOL, rtol=0)


def runs(mask):
    """(start, end) of each run of trained tokens: one per call in a linear timeline."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def chatml_transcript(tok, messages, sample):
    """The ChatML text of the conversation, written out by hand (independent of jet.chat):
    each completion as generated, closed by the template where the model did not close it."""
    text = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    users = [m["content"] for m in messages[3::2]]
    for k, (a, b) in enumerate(runs(sample.mask)):
        text += tok.decode(sample.tokens[a:b], skip_special_tokens=False)
        if k < len(users):
            closed = sample.tokens[b - 1] == tok.convert_tokens_to_ids("<|im_end|>")
            text += ("\n" if closed else "<|im_end|>\n") + f"<|im_start|>user\n{users[k]}<|im_end|>\n"
            text += "<|im_start|>assistant\n"
    return text


@pytest.mark.anyio
async def test_episodes_end_to_end(redis_url, keys, tiny_model, tmp_path):
    from transformers import AutoTokenizer

    cfg = write_config(tmp_path / "c.yaml", keys.run, tiny_model, [
        {"name": "chat", "workflow": "tests.workers.flows:chat"},
        {"name": "guess", "workflow": "jet.tasks.guess:workflow"},
        {"name": "sync", "workflow": "tests.workers.flows:sync_chat", "reward": "tests.workers.flows:turns_reward"},
    ])
    await enqueue(redis_url, keys, "chat", [{"turns": 3, "temperature": 0.7, "max_tokens": 6}] * 3)
    await enqueue(redis_url, keys, "guess", [{**row, "max_turns": 3, "max_tokens": 4}
                                             for row in dataset("guess", 2, seed=0)])
    await enqueue(redis_url, keys, "sync", [{}])
    async with running_workers(cfg, redis_url):
        trajs = await wait_for(lambda: _at_least(redis_url, keys, 12), timeout=90)
        r = await connect(redis_url)
        swarm = {w["name"]: w for w in await registry.workers(r, keys) if w["alive"]}
        await r.aclose()
    assert len(trajs) == 12 and not [t.error for t in trajs if t.failed]
    # Every runtime beats in the worker registry: role, host, and what it serves and runs.
    assert swarm[f"{HOST}-infer-{MODEL}-0"]["role"] == "infer" and swarm[f"{HOST}-infer-{MODEL}-0"]["weight_version"] == 0
    envs = {w["task"]: w for w in swarm.values() if w["role"] == "env"}
    assert sorted(envs) == ["chat", "guess", "sync"] and all(w["host"] == HOST for w in envs.values())
    assert {w["code_version"] for w in envs.values()} >= {trajs[0].meta["code_version"]}
    by_task = {name: [t for t in trajs if t.task == name] for name in ("chat", "guess", "sync")}
    assert [len(v) for v in by_task.values()] == [6, 4, 2]
    assert {(t.group_id, t.index) for t in by_task["chat"]} == {(f"g{i}", j) for i in range(3) for j in range(2)}

    tok, model = AutoTokenizer.from_pretrained(tiny_model), load_model(tiny_model)
    for t in by_task["chat"]:
        [sample] = t.samples  # a linear conversation merges into one timeline
        assert t.reward == 3.0 and sample.rewards == (3.0,) and sample.episode_ids == (t.episode_id,)
        assert len(runs(sample.mask)) == 3 == t.meta["calls"] and set(sample.versions) <= {-1, 0}
        messages = t.meta["info"]["messages"]
        assert tok.decode(sample.tokens, skip_special_tokens=False) == chatml_transcript(tok, messages, sample)
        assert_logprobs_match_a_forward_pass(model, sample, temperature=0.7)
        assert t.meta["worker"].endswith("-env-chat-0") and t.attempt == 0

    secrets = [row["secret"] for row in dataset("guess", 2, seed=0)]
    for t in by_task["guess"]:
        info = t.meta["info"]
        assert 1 <= info["turns"] == t.meta["calls"] <= 3 and len(info["guesses"]) == info["turns"]
        assert t.reward == pytest.approx(score(info["guesses"], secrets[int(t.group_id[1:])], 1, 10))
        [sample] = t.samples
        assert_logprobs_match_a_forward_pass(model, sample, temperature=1.0)
    assert all(t.reward == 1.0 and t.meta["calls"] == 2 for t in by_task["sync"])

    r = await connect(redis_url)
    for stream, group in [(keys.tasks("chat"), "env"), (keys.gen(MODEL), "infer")]:
        assert (await r.xpending(stream, group))["pending"] == 0
    assert not [k for k in await r.keys(keys.pattern()) if b":reply:" in k]  # the client deleted its stream
    await r.aclose()


async def _at_least(url, keys, n):
    trajs = await trajectories(url, keys)
    return trajs if len(trajs) >= n else None


@pytest.mark.anyio
async def test_a_failing_workflow_fails_its_episode_and_nothing_else(redis_url, keys, tiny_model, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", keys.run, tiny_model, [
        {"name": "flaky", "workflow": "tests.workers.flows:chat", "episode_timeout_s": 3, "max_retries": 1,
         "group_size": 1}])
    rows = [{"turns": 2}, {"boom": True, "turns": 2}, {"sleep": 60}, {"turns": 2}]
    await enqueue(redis_url, keys, "flaky", rows, group_size=1)
    r = await connect(redis_url)
    await r.xadd(keys.tasks("flaky"), {b"v": b"1", b"k": b"task", b"i": b"x", b"m": b"not json"})
    async with running_workers(cfg, redis_url):
        trajs = await wait_for(lambda: _at_least(redis_url, keys, 6), timeout=60)
        # The worker keeps going: new work after the failures is done.
        await enqueue(redis_url, keys, "flaky", [{"turns": 1}], group_size=1, prefix="late")
        trajs = await wait_for(lambda: _at_least(redis_url, keys, 7), timeout=30)
        # A requeued dead letter runs again as a fresh first attempt (and fails twice again).
        [boom] = [row["id"] for row in await admin.dead_letters(r, keys) if "boom" in row["reason"]]
        assert await admin.requeue(r, keys, [boom], redis_url) == 1
        again = await wait_for(lambda: _at_least(redis_url, keys, 9), timeout=30)
    assert sorted((t.group_id, t.attempt, t.failed) for t in again[7:]) == [("g1", 0, True), ("g1", 1, True)]
    member = {(t.group_id, t.attempt): t for t in trajs}
    assert len(trajs) == 7 == len(member)
    for g in ("g0", "g3", "late0"):
        ok = member[g, 0]
        assert not ok.failed and ok.reward == ok.meta["calls"] == (1 if g == "late0" else 2) and len(ok.samples) == 1
    boom0, boom1 = member["g1", 0], member["g1", 1]
    assert boom0.failed and boom0.retry and boom1.failed and not boom1.retry
    assert boom0.error == "RuntimeError: boom in g1" and "RuntimeError: boom in g1" in boom0.traceback
    assert boom0.samples == () and boom0.meta["calls"] == 1
    slow0, slow1 = member["g2", 0], member["g2", 1]
    assert slow0.error == slow1.error == "episode timed out after 3s" and slow0.retry and not slow1.retry
    dead = [codec.decode(f).meta for _, f in await r.xrange(keys.dead)]
    reasons = sorted(d["reason"] for d in dead)
    assert len(dead) == 3 and reasons[0] == "episode failed 2 times: RuntimeError: boom in g1"  # again
    assert reasons[1] == "episode failed 2 times: episode timed out after 3s"
    assert reasons[2].startswith("malformed entry")
    assert "RuntimeError: boom in g1" in next(d["last_error"] for d in dead if "boom" in d["reason"])
    assert (await r.xpending(keys.tasks("flaky"), "env"))["pending"] == 0
    await r.aclose()
