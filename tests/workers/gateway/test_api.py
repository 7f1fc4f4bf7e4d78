"""The gateway's API surface against a real server: the Responses API, the chat-completions parameters
frameworks send (tool_choice, stop, n, logprobs, response_format, stream_options), the 404 for other paths,
and calls whose client disconnected (withdrawn from the episode, never trained), streamed or not, embedded
and standalone, and through an env worker's episode.

Real pieces as in test_gateway: the embedded Valkey, an in-process inference worker with a scripted backend,
uvicorn on loopback, the `openai` SDK or httpx as the client.
"""

from __future__ import annotations

import json
import logging

import anyio
import httpx
import openai
import pytest

from jet.tasks import dataset
from jet.timeline import merge_calls
from jet.workers.gateway.app import episode_gateway
from tests.workers.conftest import MODEL, enqueue, trajectories, wait_for, write_config
from tests.workers.gateway.test_gateway import ScriptedBackend, inference_and_client, standalone_gateway
from tests.workers.test_arith import running

CALC = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": CALC}}]
RESP_TOOLS = [{"type": "function", "name": "calculator", "parameters": CALC, "strict": False}]
QUESTION = "What is 2 + 3?"


class RecordingBackend(ScriptedBackend):
    """ScriptedBackend that keeps the sampling parameters of each request."""

    def __init__(self, model_dir):
        super().__init__(model_dir)
        self.params = []

    def generate(self, prompts, params):
        self.params += list(params)
        return super().generate(prompts, params)


@pytest.fixture
def cfg(tmp_path, keys, tiny_model):
    return write_config(tmp_path / "c.yaml", keys.run, tiny_model, [{"name": "t", "workflow": "a.b:c"}])


async def an_episode(gw, llm, name="ep", task="t"):
    session = llm.session(name, MODEL)
    await gw.open(session, ttl_s=60, task=task)
    return session


# ---- the Responses API


@pytest.mark.anyio
async def test_responses_api_tools_previous_response_id_and_streaming(redis_url, cfg, tiny_model):
    backend = ScriptedBackend(tiny_model)
    async with inference_and_client(cfg, redis_url, backend) as llm, episode_gateway(cfg, redis_url, llm) as gw:
        session = await an_episode(gw, llm)
        async with session.openai_client(max_retries=0) as client:
            first = await client.responses.create(model="gpt-4o", instructions="Use the calculator.", input=QUESTION,
                                                  tools=RESP_TOOLS)
            [c1] = session.calls
            [call] = first.output
            assert first.status == "completed" and first.id.startswith("resp_") and first.model == MODEL
            assert call.type == "function_call" and call.name == "calculator" and call.status == "completed"
            assert json.loads(call.arguments) == {"expression": "2 + 3"}
            assert first.usage.input_tokens == len(c1.prompt_ids) and first.usage.output_tokens == len(c1.completion_ids)

            # The tool's output continues the first response by id: the prompt extends the kept ids.
            output = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"result": 5})}
            second = await client.responses.create(model=MODEL, instructions="Use the calculator.", tools=RESP_TOOLS,
                                                   previous_response_id=first.id, input=[output])
            _, c2 = session.calls
            assert second.output_text == "The answer is 5." and second.previous_response_id == first.id
            assert c2.prompt_ids[:len(c1.ids)] == c1.ids

            # The same conversation sent whole, item by item as the SDK keeps it, is the same prompt.
            items = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), output]
            again = await client.responses.create(model=MODEL, instructions="Use the calculator.", tools=RESP_TOOLS,
                                                  input=items, stream=True)
            events = [e async for e in again]
            c3 = session.calls[2]
            assert c3.prompt_ids == c2.prompt_ids
            assert [e.type for e in events] == [
                "response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                "response.content_part.done", "response.output_item.done", "response.completed"]
            assert [e.sequence_number for e in events] == list(range(len(events)))
            assert events[-1].response.output_text == "The answer is 5." and events[-1].response.usage.output_tokens

            # Cut by max_output_tokens: an incomplete response, as OpenAI answers it.
            cut = await client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=2)
            assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
            streamed = [e async for e in await client.responses.create(model=MODEL, input="Say hi.",
                                                                       max_output_tokens=2, stream=True)]
            assert streamed[-1].type == "response.incomplete"

            with pytest.raises(openai.BadRequestError) as err:
                await client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
            assert err.value.code == "previous_response_not_found"
            for bad, reason in (([{"type": "reasoning", "summary": []}], "item type 'reasoning'"),
                                ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
                                 "only text parts")):
                with pytest.raises(openai.BadRequestError, match=reason):
                    await client.responses.create(model=MODEL, input=bad)
            with pytest.raises(openai.BadRequestError, match="only function tools"):
                await client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
        assert len(merge_calls(session.calls, "exact")) == 4  # c1+c2, the resent c3 (a branch), the two cut

        # A response id of another episode is not this episode's.
        other = await an_episode(gw, llm, "ep-other")
        async with other.openai_client(max_retries=0) as client:
            with pytest.raises(openai.BadRequestError, match="no response"):
                await client.responses.create(model=MODEL, input=[output], previous_response_id=first.id)


# ---- chat-completions parameters


@pytest.mark.anyio
async def test_chat_parameters_frameworks_send(redis_url, cfg, tiny_model, caplog):
    backend = RecordingBackend(tiny_model)
    question = [{"role": "user", "content": QUESTION}]
    async with inference_and_client(cfg, redis_url, backend) as llm, episode_gateway(cfg, redis_url, llm) as gw:
        session = await an_episode(gw, llm, task="framework-task")
        async with session.openai_client(max_retries=0) as client:
            # tool_choice "none": the model's tool-call markup is content, no tool call is made.
            plain = await client.chat.completions.create(model=MODEL, messages=question, tools=CHAT_TOOLS,
                                                         tool_choice="none")
            assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "stop"
            assert plain.choices[0].message.content.startswith("<tool_call>")
            auto = await client.chat.completions.create(model=MODEL, messages=question, tools=CHAT_TOOLS,
                                                        tool_choice="auto")
            assert auto.choices[0].message.tool_calls
            for choice in ("required", {"type": "function", "function": {"name": "calculator"}}):
                with pytest.raises(openai.BadRequestError, match="cannot be honoured") as err:
                    await client.chat.completions.create(model=MODEL, messages=question, tools=CHAT_TOOLS,
                                                         tool_choice=choice)
                assert err.value.code == "unsupported_tool_choice"

            # logprobs: the sampled tokens' behaviour logprobs, in the content's tokens.
            lp = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                      logprobs=True, top_logprobs=0)
            tokens = lp.choices[0].logprobs.content
            assert "".join(t.token for t in tokens) == lp.choices[0].message.content == "I guess 5."
            assert {t.logprob for t in tokens} == {-0.5} and all(t.top_logprobs == [] for t in tokens)
            assert lp.usage.total_tokens == lp.usage.prompt_tokens + lp.usage.completion_tokens
            with pytest.raises(openai.BadRequestError, match="top_logprobs"):
                await client.chat.completions.create(model=MODEL, messages=question, logprobs=True, top_logprobs=3)
            stream = await client.chat.completions.create(model=MODEL, messages=question, logprobs=True, stream=True)
            streamed = [t for ch in [c async for c in stream] if ch.choices and ch.choices[0].logprobs
                        for t in ch.choices[0].logprobs.content]
            assert len(streamed) == len(session.calls[-1].completion_ids) - 1  # all but the stop token

            # stop: one-token strings become stop ids of the request.
            await client.chat.completions.create(model=MODEL, messages=question, stop=["."])
            assert backend.params[-1].stop_token_ids[-1] == backend.tok.encode(".", add_special_tokens=False)[0]

            # response_format: served as plain text, with a warning (logged once per task and kind).
            with caplog.at_level(logging.WARNING, logger="jet.workers.gateway.app"):
                for _ in range(2):
                    raw = await client.chat.completions.with_raw_response.create(
                        model=MODEL, messages=question, response_format={"type": "json_object"})
            assert "served as plain text" in raw.headers["jet-warning"]
            assert len([r for r in caplog.records if "served as plain text" in r.message
                        and "framework-task" in r.message]) == 1
            with pytest.raises(openai.BadRequestError, match="only n=1"):
                await client.chat.completions.create(model=MODEL, messages=question, n=2)

        # Any other path: 404 naming what is served, and a warning naming the episode's task.
        auth = {"Authorization": f"Bearer {session.openai_api_key}"}
        async with httpx.AsyncClient(base_url=session.openai_base_url + "/", headers=auth) as http:
            with caplog.at_level(logging.WARNING, logger="jet.workers.gateway.app"):
                res = await http.post("embeddings", json={"input": "x"})
            assert res.status_code == 404 and res.json()["error"]["code"] == "unknown_url"
            assert "POST /v1/responses" in res.json()["error"]["message"]
            assert [r for r in caplog.records if "'framework-task'" in r.message and "/v1/embeddings" in r.message]
            assert (await http.get("chat/completions")).status_code == 405


# ---- calls the client never received


async def disconnect_mid_stream(base_url: str, key: str, backend, path="chat/completions") -> str:
    """Start a slow streamed call, read its opening event, hang up while it generates; the opening line."""
    calls = len(backend.prompts)
    body = ({"model": MODEL, "messages": [{"role": "user", "content": "Think slowly."}], "stream": True}
            if path == "chat/completions" else {"model": MODEL, "input": "Think slowly.", "stream": True})
    async with httpx.AsyncClient(base_url=base_url + "/", headers={"Authorization": f"Bearer {key}"}) as http:
        async with http.stream("POST", path, json=body) as res:
            assert res.status_code == 200
            first = await anext(res.aiter_lines())
            await wait_for(lambda: _more(backend, calls), timeout=10, every=0.02)  # it is generating
    return first


async def _more(backend, n):
    return len(backend.prompts) > n


async def hang_up_early(base_url: str, key: str, backend) -> None:
    """A non-streamed slow call whose client gives up (read timeout) while it generates."""
    async with httpx.AsyncClient(base_url=base_url + "/", headers={"Authorization": f"Bearer {key}"}) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("chat/completions", timeout=0.5,
                            json={"model": MODEL, "messages": [{"role": "user", "content": "Think slowly."}]})


@pytest.mark.anyio
async def test_a_call_whose_client_disconnected_is_withdrawn_embedded(redis_url, cfg, tiny_model):
    backend = ScriptedBackend(tiny_model)
    async with inference_and_client(cfg, redis_url, backend) as llm, episode_gateway(cfg, redis_url, llm) as gw:
        session = await an_episode(gw, llm)
        first = await disconnect_mid_stream(session.openai_base_url, session.openai_api_key, backend)
        assert first.startswith("data: ") and json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
        await wait_for(lambda: _n(session.undelivered, 1), timeout=10)
        opening = await disconnect_mid_stream(session.openai_base_url, session.openai_api_key, backend, "responses")
        assert opening == "event: response.created"
        await hang_up_early(session.openai_base_url, session.openai_api_key, backend)
        await wait_for(lambda: _n(session.undelivered, 3), timeout=10)
        async with session.openai_client(max_retries=0) as client:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
        [kept] = session.calls  # only the call the client received is the episode's
        assert backend.tok.decode(kept.completion_ids).startswith("I guess 5.")
        assert all(backend.tok.decode(c.completion_ids).startswith("I guess 5.") for c in session.undelivered)


async def _n(items, n):
    return len(items) >= n


@pytest.mark.anyio
async def test_a_call_whose_client_disconnected_is_withdrawn_standalone(redis_url, cfg, tiny_model):
    backend = ScriptedBackend(tiny_model)
    async with inference_and_client(cfg, redis_url, backend) as llm, standalone_gateway(cfg, redis_url) as url:
        async with episode_gateway(cfg, redis_url, llm, gateway_url=url) as gw:
            session = await an_episode(gw, llm)
            await disconnect_mid_stream(url, session.openai_api_key, backend)
            async with session.openai_client(max_retries=0) as client:
                await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
            r = llm.r

            async def marked():  # the gateway wrote its mark once the stream ended
                return any(b"gw_undelivered" in b"".join(f.values()) for _, f in await r.xrange(
                    llm.keys.calls(session.episode_id, session.tag)))

            await wait_for(marked, timeout=10)
            await gw.collect(session)
        [kept], [gone] = session.calls, session.undelivered
        assert backend.tok.decode(gone.completion_ids).startswith("I guess 5.") and kept is not gone


async def streams_and_hangs_up(task, llm) -> float:
    """A workflow: one streamed call it abandons mid-stream, then one it receives."""
    async with httpx.AsyncClient(base_url=llm.openai_base_url + "/",
                                 headers={"Authorization": f"Bearer {llm.openai_api_key}"}) as http:
        async with http.stream("POST", "chat/completions", json={
                "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "Think slowly."}]}) as res:
            await anext(res.aiter_lines())
    with anyio.fail_after(20):  # the abandoned call finishes generating (1.5 s) and is withdrawn
        while not llm.undelivered:
            await anyio.sleep(0.05)
    async with llm.openai_client() as client:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    return 1.0


@pytest.mark.anyio
async def test_an_undelivered_call_is_left_out_of_the_trajectory(redis_url, keys, tiny_model, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", keys.run, tiny_model, [
        {"name": "hangup", "workflow": "tests.workers.gateway.test_api:streams_and_hangs_up", "dataset": "guess"}])
    await enqueue(redis_url, keys, "hangup", dataset("guess", 1), group_size=1)
    backend = ScriptedBackend(tiny_model)
    async with running(cfg, redis_url, backend):
        [t] = await wait_for(lambda: _trajs(redis_url, keys, 1), timeout=60)
    assert not t.failed and t.meta["calls"] == 1 and t.meta["undelivered_calls"] == 1
    [sample] = t.samples
    trained = backend.tok.decode([x for x, m in zip(sample.tokens, sample.mask) if m])
    assert trained == "I guess 5.<|im_end|>" and "Think slowly" not in backend.tok.decode(sample.tokens)


async def _trajs(url, keys, n):
    found = await trajectories(url, keys)
    return found if len(found) >= n else None


@pytest.mark.anyio
async def test_previous_response_id_survives_a_standalone_gateway_restart(redis_url, cfg, tiny_model):
    backend = ScriptedBackend(tiny_model)
    async with inference_and_client(cfg, redis_url, backend) as llm:
        async with standalone_gateway(cfg, redis_url) as url, episode_gateway(cfg, redis_url, llm, url) as gw:
            session = await an_episode(gw, llm)
            async with openai.AsyncOpenAI(base_url=url, api_key=session.openai_api_key, max_retries=0) as client:
                first = await client.responses.create(model=MODEL, input=QUESTION, tools=RESP_TOOLS)
        async with standalone_gateway(cfg, redis_url) as url, episode_gateway(cfg, redis_url, llm, url) as gw:
            async with openai.AsyncOpenAI(base_url=url, api_key=session.openai_api_key, max_retries=0) as client:
                output = {"type": "function_call_output", "call_id": first.output[0].call_id,
                          "output": json.dumps({"result": 5})}
                second = await client.responses.create(model=MODEL, tools=RESP_TOOLS, input=[output],
                                                       previous_response_id=first.id)
            assert second.output_text == "The answer is 5."
            await gw.collect(session)
    c1, c2 = session.calls
    assert c2.prompt_ids[:len(c1.ids)] == c1.ids  # the new gateway extended the kept ids it rebuilt
