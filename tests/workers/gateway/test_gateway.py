"""The gateway against a real server: the official `openai` client over HTTP, calls recorded in episodes.

Real pieces throughout: the embedded Valkey, an inference worker (`infer.run`
in this process) with the hf backend on the tiny model or, where a test needs
the model to call a tool, a scripted backend that answers like a perfect
arithmetic agent; the gateway served by uvicorn on a loopback port; the
`openai.AsyncOpenAI` client. Checked: responses in OpenAI's shape (plain,
streamed, tool calls), each call recorded with its token ids and a later
turn's prompt extending the kept ids, the standalone gateway's calls
collected into the session (also after a gateway restart), 401 for bad keys
and 400 with a reason for bad bodies, and the `jet gateway` command.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import openai
import orjson
import pytest

from jet.keys import Keys
from jet.llm import LLMClient, Tokenizers, open_client
from jet.queues.connect import connect
from jet.timeline import merge_calls
from jet.workers.gateway import app as gateway
from jet.workers.gateway.app import episode_gateway, make_app, serving
from jet.workers.gateway.auth import Claims, InvalidKey, Signer, load_secret
from jet.workers.gateway.sessions import LocalSessions
from jet.workers.inference import worker as infer
from jet.workers.inference.backend import GenOutput
from tests.workers.conftest import MODEL, wait_for, write_config

ROOT = Path(__file__).resolve().parents[3]
SYSTEM = {"role": "system", "content": "You play a guessing game."}
USER = {"role": "user", "content": "Guess a number between 1 and 10."}


class ScriptedBackend:
    """An inference backend that answers like a perfect calculator agent (tests need tool calls that a
    random tiny model never makes): to "What is X?" it calls the calculator on X; to a tool result
    {"result": N} it answers "The answer is N."; to anything else "I guess 5.", after 1.5 s when the prompt
    says "Think slowly.". Completions end with
    the end-of-turn token unless cut by max_tokens; every logprob is -0.5."""

    version = 0

    def __init__(self, model_dir):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.prompts: list[list[int]] = []

    def reply(self, prompt_text: str) -> str:
        last = prompt_text[:prompt_text.rfind("<|im_start|>assistant")].rsplit("<|im_start|>", 1)[-1]
        if last.startswith("tool"):
            return f"The answer is {json.loads(last[len('tool'):].split('<|im_end|>')[0])['result']}."
        question = re.search(r"What is (.+)\?", last)
        if question:
            call = {"name": "calculator", "arguments": {"expression": question.group(1)}}
            return f"<tool_call>{json.dumps(call)}</tool_call>"
        return "I guess 5."

    def generate(self, prompts, params):
        outs = []
        for prompt, sp in zip(prompts, params):
            self.prompts.append(list(prompt))
            text = self.tok.decode(prompt)
            if "Think slowly." in text:
                time.sleep(1.5)
            ids = self.tok.encode(self.reply(text), add_special_tokens=False)
            ids.append(self.tok.convert_tokens_to_ids("<|im_end|>"))
            finish = "length" if len(ids) > sp.max_tokens else "stop"
            ids = ids[: sp.max_tokens]
            outs.append(GenOutput(ids, [-0.5] * len(ids), finish, None, self.version))
        return outs

    async def agenerate_one(self, prompt, sp):
        """The inference worker's per-request call (requests in flight run side by side, in threads)."""
        [out] = await anyio.to_thread.run_sync(self.generate, [prompt], [sp])
        return out


@contextlib.asynccontextmanager
async def inference_and_client(cfg, url, backend=None):
    """An inference worker of MODEL (hf, or `backend`) and an LLM client, both in this process."""
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(infer.run, cfg, MODEL, url, stop, backend=backend))
        try:
            tokenizers = Tokenizers({m.name: m.path for m in cfg.models})
            async with open_client(url, Keys(cfg.run), tokenizers, timeout_s=60) as llm:
                yield llm
        finally:
            stop.set()


@contextlib.asynccontextmanager
async def standalone_gateway(cfg, url):
    """`jet gateway`'s coroutine on a free loopback port; yields its base URL."""
    stop, ready = anyio.Event(), []
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(gateway.run, cfg, url, stop, host="127.0.0.1", port=0, ready=ready.append))
        with anyio.fail_after(30):
            while not ready:
                await anyio.sleep(0.02)
        try:
            yield ready[0]
        finally:
            stop.set()


async def a_late_call(session, backend, end_episode) -> openai.AuthenticationError:
    """Start a slow call with the session's key, end the episode while it generates; return its error."""
    calls, errors = len(backend.prompts), []

    async def call() -> None:
        try:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Think slowly."}])
        except openai.AuthenticationError as e:
            errors.append(e)

    async def generating() -> bool:
        return len(backend.prompts) > calls

    async with session.openai_client(max_retries=0) as client, anyio.create_task_group() as tg:
        tg.start_soon(call)
        await wait_for(generating, timeout=10, every=0.02)
        await end_episode()
    [error] = errors
    return error


@pytest.fixture
def cfg(tmp_path, keys, tiny_model):
    return write_config(tmp_path / "c.yaml", keys.run, tiny_model, [{"name": "t", "workflow": "a.b:c"}])


def decoded(tok, ids, finish):
    return tok.decode(list(ids[:-1] if finish == "stop" else ids), skip_special_tokens=False)


# ---- keys


def test_keys_are_signed_opaque_and_expire():
    signer = Signer(b"k" * 32, "run1")
    claims = Claims("ep-1", "tag1", "tiny", "solver", int(time.time()) + 60)
    key = signer.mint(claims)
    assert signer.verify(key) == claims
    raw = base64.urlsafe_b64decode(key[4:] + "=" * (-len(key[4:]) % 4))
    payload = raw[:-32]  # a binary layout, then the MAC: the ids are visible, but it is no JSON
    # (not `b"{" not in payload`: the expiry's binary bytes are 0x7b at some seconds, a flake)
    assert not payload.startswith(b"{") and b"ep-1" in payload
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(raw)
    named = Claims("ep-1", "tag1", "tiny", "solver", claims.expires, task="arith")
    assert signer.verify(signer.mint(named)).task == "arith"  # the task travels in the key
    v1 = bytes([1]) + payload[1:-1]  # a version-1 key (no task field), signed: still read, as task ""
    old = "jet-" + base64.urlsafe_b64encode(v1 + signer._mac(v1)).rstrip(b"=").decode()
    assert signer.verify(old) == claims
    for i in range(4, len(key)):  # any changed character is refused
        tampered = key[:i] + ("A" if key[i] != "A" else "B") + key[i + 1:]
        with pytest.raises(InvalidKey, match="invalid API key"):
            signer.verify(tampered)
    for bad in ("", "sk-123", "jet-", "jet-!!!!", "jet-" + "A" * 3000, key + "AA"):
        with pytest.raises(InvalidKey):
            signer.verify(bad)
    with pytest.raises(InvalidKey):  # another run's gateway refuses it, even with the same secret
        Signer(b"k" * 32, "run2").verify(key)
    with pytest.raises(InvalidKey) as err:
        signer.verify(key, now=claims.expires)
    assert err.value.code == "expired_api_key"


@pytest.mark.anyio
async def test_the_run_secret_is_made_once_or_taken_from_the_environment(redis_url, keys, monkeypatch):
    monkeypatch.delenv("JET_GATEWAY_SECRET", raising=False)
    r = await connect(redis_url)
    first, again = await load_secret(r, keys), await load_secret(r, keys)
    assert first == again and len(first) == 32
    monkeypatch.setenv("JET_GATEWAY_SECRET", "s" * 40)
    assert await load_secret(r, keys) == b"s" * 40
    await r.aclose()


# ---- the official client through the embedded gateway


@pytest.mark.anyio
async def test_openai_sdk_calls_are_recorded_in_the_episode(redis_url, cfg, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    async with inference_and_client(cfg, redis_url) as llm, episode_gateway(cfg, redis_url, llm) as gw:
        session = llm.session("ep1", MODEL)
        await gw.open(session, ttl_s=60)
        assert session.openai_base_url.startswith("http://127.0.0.1:") and session.openai_base_url.endswith("/v1")
        async with session.openai_client() as client:
            assert [m.id for m in (await client.models.list()).data] == [MODEL]
            first = await client.chat.completions.create(model="gpt-4o", messages=[SYSTEM, USER], max_tokens=6,
                                                         temperature=0.7, seed=3)
            [c1] = session.calls
            choice = first.choices[0]
            assert first.model == MODEL and first.object == "chat.completion" and first.id.startswith("chatcmpl-")
            assert choice.finish_reason == c1.finish_reason and choice.message.role == "assistant"
            assert choice.message.content == decoded(tok, c1.completion_ids, c1.finish_reason)
            assert first.usage.prompt_tokens == len(c1.prompt_ids) == len(tok.apply_chat_template(
                [SYSTEM, USER], add_generation_prompt=True, tokenize=True, return_dict=False))
            assert first.usage.completion_tokens == len(c1.completion_ids) >= 1
            assert first.system_fingerprint == "jet-v0" and c1.agent == "main" and c1.model == MODEL

            # Turn 2, streamed: the reply goes back as the SDK returned it, the prompt extends the kept ids.
            messages = [SYSTEM, USER, choice.message.model_dump(), {"role": "user", "content": "5 is too low."}]
            stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True,
                                                          stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
        _, c2 = session.calls
        assert c2.prompt_ids[:len(c1.ids)] == c1.ids and len(c2.prompt_ids) > len(c1.ids)
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert content == decoded(tok, c2.completion_ids, c2.finish_reason)
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-2].choices[0].finish_reason in ("stop", "length")
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(c2.completion_ids)
        [sample] = merge_calls(session.calls, "exact")  # one timeline: both calls' completions trained
        assert sample.n_trained == len(c1.completion_ids) + len(c2.completion_ids)

        llm.close_session("ep1")  # the episode is over: its key is refused
        async with session.openai_client(max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError) as err:
                await client.chat.completions.create(model=MODEL, messages=[USER])
        assert err.value.code == "episode_over"


@pytest.mark.anyio
async def test_tool_calls_round_trip_plain_and_streamed(redis_url, cfg, tiny_model):
    backend = ScriptedBackend(tiny_model)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    async with inference_and_client(cfg, redis_url, backend) as llm, episode_gateway(cfg, redis_url, llm) as gw:
        session = llm.session("ep2", MODEL, agent="solver")
        await gw.open(session, ttl_s=60)
        async with session.openai_client() as client:
            first = await client.chat.completions.create(model=MODEL, messages=question, tools=tools)
            msg = first.choices[0].message
            assert first.choices[0].finish_reason == "tool_calls" and msg.content is None
            [call] = msg.tool_calls
            assert call.type == "function" and call.function.name == "calculator" and call.id.startswith("call_")
            assert json.loads(call.function.arguments) == {"expression": "2 + 3"}
            messages = question + [msg.model_dump(exclude_none=True),
                                   {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": 5})}]
            second = await client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
            assert second.choices[0].message.content == "The answer is 5."
            assert second.choices[0].finish_reason == "stop" and second.choices[0].message.tool_calls is None

            # The same first turn streamed: the tool call arrives as deltas the SDK accumulates.
            stream = await client.chat.completions.create(model=MODEL, messages=question, tools=tools, stream=True)
            chunks = [chunk async for chunk in stream]
        deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
        assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
            (0, "calculator", {"expression": "2 + 3"})]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        c1, c2, c3 = session.calls
        assert c2.prompt_ids[:len(c1.ids)] == c1.ids and c3.prompt_ids == c1.prompt_ids  # a branch from the start
        assert {c.agent for c in session.calls} == {"solver"}
        text = backend.tok.decode(c2.prompt_ids[len(c1.ids):])
        assert '{"result": 5}' in text and text.startswith("\n<|im_start|>tool")
        assert len(merge_calls(session.calls, "exact")) == 2

        # A call still generating when its episode ends is refused (the merge has read the calls).
        late = llm.session("ep-late", MODEL)
        await gw.open(late, ttl_s=60)

        async def end_episode():
            llm.close_session("ep-late")

        error = await a_late_call(late, backend, end_episode)
        assert "not recorded" in str(error) and error.code == "episode_over"


# ---- bad requests


@pytest.fixture
async def live_gateway(tmp_path, keys, tiny_model):
    """An embedded-style gateway over a client that is never opened (nothing here reaches generation),
    with one live session; yields (base URL, signer, its session's key)."""
    llm = LLMClient("redis://127.0.0.1:1/0", keys, Tokenizers({MODEL: str(tiny_model)}))
    signer = Signer(os.urandom(32), keys.run)
    session = llm.session("live", MODEL)
    async with serving(make_app(LocalSessions(llm), signer, [MODEL])) as base_url:
        yield base_url, signer, signer.key("live", session.tag, MODEL, "main", 60)


@pytest.mark.anyio
async def test_bad_keys_get_401(live_gateway):
    base_url, signer, key = live_gateway
    other_run = Signer(os.urandom(32), "other").key("live", "x", MODEL, "main", 60)
    cases = {
        None: "invalid_api_key",
        "sk-123": "invalid_api_key",
        key[:20] + ("A" if key[20] != "A" else "B") + key[21:]: "invalid_api_key",  # tampered
        other_run: "invalid_api_key",
        signer.key("live", "x", MODEL, "main", -1): "expired_api_key",
        signer.key("gone", "x", MODEL, "main", 60): "episode_over",  # genuine, but its episode is not running
    }
    async with httpx.AsyncClient(base_url=base_url) as http:
        for bad, code in cases.items():
            headers = {"Authorization": f"Bearer {bad}"} if bad else {}
            for method, path in (("POST", "/chat/completions"), ("GET", "/models")):
                if code == "episode_over" and path == "/models":
                    continue  # listing models needs a genuine key only
                res = await http.request(method, base_url + path, headers=headers, json={"messages": [USER]})
                assert res.status_code == 401, (bad, path, res.text)
                assert res.json()["error"]["code"] == code and res.json()["error"]["type"] == "authentication_error"
        assert (await http.get(base_url + "/models", headers={"Authorization": f"Bearer {key}"})).status_code == 200
    client = openai.AsyncOpenAI(base_url=base_url, api_key="sk-not-a-jet-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        await client.chat.completions.create(model=MODEL, messages=[USER])
    await client.close()


@pytest.mark.anyio
async def test_malformed_bodies_get_400_with_a_reason(live_gateway):
    base_url, _, key = live_gateway
    auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    tool_msg = {"role": "tool", "content": "5"}
    cases = [
        (b"{not json", None, "not valid JSON"),
        (b"[1, 2]", None, "must be a JSON object"),
        ({"model": MODEL}, "messages", "messages: required"),
        ({"messages": []}, "messages", "messages: required"),
        ({"messages": "hi"}, "messages", "messages: required"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "messages[0].role: expected one of"),
        ({"messages": [{"content": "x"}]}, "messages", "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "content is required"),
        ({"messages": [USER, tool_msg]}, "messages", "messages[1].tool_call_id"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content", "only text content parts"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, "messages[0].tool_calls",
         "messages[0].tool_calls[0]"),
        ({"messages": [USER], "n": 2}, "n", "only n=1 is supported"),
        ({"messages": [USER], "temperature": "hot"}, "temperature", "expected a number"),
        ({"messages": [USER], "temperature": 3}, "temperature", "must be in [0, 2]"),
        ({"messages": [USER], "top_p": 0}, "top_p", "must be in (0, 1]"),
        ({"messages": [USER], "max_tokens": 0}, "max_tokens", "must be >= 1"),
        ({"messages": [USER], "stream": "yes"}, "stream", "expected a boolean"),
        ({"messages": [USER], "tools": [{"type": "function"}]}, "tools", "tools[0]"),
        ({"messages": [USER], "stop": "a phrase of many tokens"}, "stop", "supports stop strings of exactly one token"),
    ]
    async with httpx.AsyncClient() as http:
        for body, param, reason in cases:
            content = body if isinstance(body, bytes) else orjson.dumps(body)
            res = await http.post(base_url + "/chat/completions", headers=auth, content=content)
            assert res.status_code == 400, (body, res.text)
            error = res.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)
            assert reason in error["message"], (body, error)
        res = await http.get(base_url + "/nothing-here", headers=auth)
        assert res.status_code == 404 and "error" in res.json()
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="only n=1 is supported"):
        await client.chat.completions.create(model=MODEL, messages=[USER], n=3)
    await client.close()


# ---- the standalone gateway


@pytest.mark.anyio
async def test_standalone_gateway_calls_reach_the_session(redis_url, keys, cfg, tiny_model):
    backend = ScriptedBackend(tiny_model)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "What is 4 * 5?"}]
    r = await connect(redis_url)
    async with inference_and_client(cfg, redis_url, backend) as llm:
        async with standalone_gateway(cfg, redis_url) as base_url:
            async with episode_gateway(cfg, redis_url, llm, gateway_url=base_url) as gw:
                session = llm.session("ep3", MODEL)
                await gw.open(session, ttl_s=60)
                assert session.openai_base_url == base_url
                calls_key = keys.calls("ep3", session.tag)
                assert 0 < await r.ttl(calls_key) <= 60
                client = session.openai_client(max_retries=0)
                first = await client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
                [call] = first.choices[0].message.tool_calls
                messages += [first.choices[0].message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": 20})}]
                assert await r.xlen(calls_key) == 2  # the "open" entry and the call
                await client.close()
        # A new gateway process (a restart) rebuilds the episode's kept ids from its calls stream.
        async with standalone_gateway(cfg, redis_url) as base_url:
            async with episode_gateway(cfg, redis_url, llm, gateway_url=base_url) as gw:
                client = openai.AsyncOpenAI(base_url=base_url, api_key=session.openai_api_key, max_retries=0)
                second = await client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
                assert second.choices[0].message.content == "The answer is 20."
                _, judge_key = session.openai_credentials(agent="judge")
                judge = openai.AsyncOpenAI(base_url=base_url, api_key=judge_key, max_retries=0)
                await judge.chat.completions.create(model=MODEL, messages=[USER], max_tokens=3)
                assert session.calls == []  # recorded in Redis so far, not here
                await gw.collect(session)
                c1, c2, c3 = session.calls
                assert c2.prompt_ids[:len(c1.ids)] == c1.ids and (c1.agent, c2.agent, c3.agent) == ("main", "main", "judge")
                assert [backend.tok.decode(c.completion_ids) for c in session.calls] == [
                    '<tool_call>{"name": "calculator", "arguments": {"expression": "4 * 5"}}</tool_call><|im_end|>',
                    "The answer is 20.<|im_end|>", backend.tok.decode(backend.tok.encode("I guess 5.")[:3])]
                assert c3.finish_reason == "length" and len(c3.completion_ids) == 3
                assert not await r.exists(calls_key)
                with pytest.raises(openai.AuthenticationError) as err:  # the episode is over
                    await client.chat.completions.create(model=MODEL, messages=messages, tools=tools)
                assert err.value.code == "episode_over"

                # A call still generating when its episode is collected is refused, and never written.
                late = llm.session("ep4", MODEL)
                await gw.open(late, ttl_s=60)
                error = await a_late_call(late, backend, functools.partial(gw.collect, late))
                assert late.calls == [] and "not recorded" in str(error) and error.code == "episode_over"
                assert not await r.exists(keys.calls("ep4", late.tag))
                for c in (client, judge):
                    await c.close()
    await r.aclose()


@pytest.mark.slow
def test_jet_gateway_command_binds_loopback_and_drains(redis_url, keys, tmp_path, tiny_model):
    write_config(tmp_path / "c.yaml", keys.run, tiny_model, [{"name": "t", "workflow": "a.b:c"}])
    env = {**os.environ, "JET_REDIS_URL": redis_url, "JET_LOG_LEVEL": "INFO", "OMP_NUM_THREADS": "1"}
    env.pop("JET_GATEWAY_SECRET", None)
    log = tmp_path / "gateway.log"
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "jet.workers.gateway.app", "--config", str(tmp_path / "c.yaml"),
                              "--port", "0"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (found := re.search(r"serving on (http://\S+/v1)", log.read_text())):
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        base_url = found.group(1)
        assert base_url.startswith("http://127.0.0.1:")

        async def a_key() -> str:
            r = await connect(redis_url)
            secret = await load_secret(r, keys)
            await r.aclose()
            return Signer(secret, keys.run).key("e", "t", MODEL, "main", 60)

        key = anyio.run(a_key)
        res = httpx.get(base_url + "/models", headers={"Authorization": f"Bearer {key}"})
        assert res.status_code == 200 and [m["id"] for m in res.json()["data"]] == [MODEL]
        p.send_signal(signal.SIGTERM)
        assert p.wait(20) == 0, log.read_text()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.anyio
async def test_prompts_over_the_context_get_400_before_any_request_is_built(live_gateway, tiny_model):
    """The three checks, none of which builds a generation request (the client here never reaches Redis):
    characters, tokens counted piecewise, and the rendered prompt's exact length."""
    from transformers import AutoTokenizer

    base_url, _, key = live_gateway
    tok = AutoTokenizer.from_pretrained(tiny_model)  # max_position 256: at most 255 prompt tokens
    word = " cat"
    per_word = len(tok.encode(word * 100, add_special_tokens=False)) / 100
    cases = {"x" * 100_000: "characters of text",  # more characters than 255 of the longest token hold
             word * int(400 / per_word): "over ",  # counted: over 255 x 1.1 + 64 tokens
             word * int(270 / per_word): "the prompt is "}  # fits the count, not the context once rendered
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as http:
        for text, reason in cases.items():
            res = await http.post(base_url + "/chat/completions", json={"messages": [{"role": "user", "content": text}]})
            error = res.json()["error"]
            assert res.status_code == 400 and error["code"] == "context_length_exceeded", error
            assert reason in error["message"] and error["param"] == "messages", error
