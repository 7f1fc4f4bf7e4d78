"""`planner: llm`: proposals are validated; anything off the space or past the budget falls back, logged.

Two endpoints, both real HTTP servers:
- a small OpenAI-compatible test server (Starlette on uvicorn, here) that
  answers with a fixed proposal: a valid one is accepted (the accepted path);
  one off the space is refused and the sampler plans instead;
- Jet's own gateway serving the tiny model (`jet worker infer` and `jet gateway`
  processes): its output is noise, so the proposal is refused and the default
  sampler plans (the fallback path).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from types import SimpleNamespace

import anyio
import pytest
import uvicorn
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from jet.keys import Keys
from jet.models import init_model
from jet.queues.connect import connect
from jet.study.llm_planner import LLMPlanner
from jet.study.runner import Runner
from jet.study.studyfile import parse_study
from jet.workers.gateway.auth import Signer
from jet.workers.gateway.sessions import Episodes
from tests.study.conftest import ROOT, base_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FixedLLM:
    """An OpenAI-compatible /v1/chat/completions that always answers `content`; records the requests."""

    def __init__(self, content: str):
        self.content, self.requests = content, []

        async def chat(request: Request) -> JSONResponse:
            self.requests.append(await request.json())
            return JSONResponse({"id": "x", "object": "chat.completion", "created": 0, "model": "fixed",
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": self.content}}],
                                 "usage": {"prompt_tokens": 100, "completion_tokens": 23, "total_tokens": 123}})

        self.port = free_port()
        app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}/v1"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


def llm_study(tmp_path, tiny_model, tokens: int = 100_000):
    base_config(tmp_path, tiny_model)
    return parse_study({
        "name": f"llm-{uuid.uuid4().hex[:6]}", "question": "Which learning rate learns the guess game fastest?",
        "base": str(tmp_path / "base.yaml"), "studies_dir": str(tmp_path / "studies"),
        "space": {"trainer.lr": {"low": 1e-4, "high": 1e-2, "log": True}}, "seeds": [0, 1],
        "planner": {"kind": "llm", "trials": 4, "fallback": "tpe", "llm": {"model": "planner", "max_tokens": 64}},
        "budget": {"max_planner_tokens": tokens}})


async def ask_once(study, url: str) -> tuple[Runner, list[dict]]:
    runner = Runner(study, url, study.folder(), LLMPlanner(study))
    await runner.open()
    try:
        assert await runner.ask()
    finally:
        await runner.lease.release()
        await runner.r.aclose()
    return runner, runner.decisions.read()


def test_a_valid_proposal_is_accepted_with_its_rationale(tmp_path, redis_url, tiny_model, monkeypatch):
    study = llm_study(tmp_path, tiny_model)
    reply = json.dumps({"arms": [{"trainer.lr": 0.0007}], "rationale": "between the defaults, on a log scale"})
    with FixedLLM(f"Here is my plan:\n```json\n{reply}\n```") as base_url:
        monkeypatch.setenv("JET_STUDY_LLM_BASE_URL", base_url)
        monkeypatch.setenv("JET_STUDY_LLM_API_KEY", "test-key")
        runner, decisions = anyio.run(ask_once, study, redis_url)
    [arm] = runner.arms.values()
    assert arm.params == {"trainer.lr": 0.0007}
    [planned] = [d for d in decisions if d["kind"] == "planner"]
    assert planned["rationale"] == "between the defaults, on a log scale" and planned["tokens"] == 123
    [asked] = [d for d in decisions if d["kind"] == "ask"]
    assert asked["how"] == "llm" and asked["rationale"] == planned["rationale"]


def test_the_prompt_carries_the_question_space_and_results(tmp_path, redis_url, tiny_model, monkeypatch):
    study = llm_study(tmp_path, tiny_model)
    fixed = FixedLLM(json.dumps({"arms": [{"trainer.lr": 0.002}], "rationale": "r"}))
    with fixed as base_url:
        monkeypatch.setenv("JET_STUDY_LLM_BASE_URL", base_url)
        anyio.run(ask_once, study, redis_url)
    [request] = fixed.requests
    assert request["model"] == "planner" and request["max_tokens"] == 64
    body = json.loads(request["messages"][1]["content"])
    assert body["question"] == study.question
    assert body["search_space"] == {"trainer.lr": {"low": 1e-4, "high": 1e-2, "log": True, "int": False}}
    assert body["arms_so_far"] == [] and body["budget"]["runs_left"] == 100


def test_off_space_proposals_and_a_spent_budget_fall_back_to_the_sampler(tmp_path, redis_url, tiny_model,
                                                                         monkeypatch):
    study = llm_study(tmp_path, tiny_model)
    fixed = FixedLLM(json.dumps({"arms": [{"trainer.lr": 5.0}], "rationale": "go big"}))
    with fixed as base_url:
        monkeypatch.setenv("JET_STUDY_LLM_BASE_URL", base_url)
        runner, decisions = anyio.run(ask_once, study, redis_url)
        [refused] = [d for d in decisions if d["kind"] == "planner_refused"]
        assert "off the space" in refused["why"] and refused["tokens"] == 123
        [arm] = runner.arms.values()
        assert 1e-4 <= arm.params["trainer.lr"] <= 1e-2  # the sampler's arm, inside the space
        assert [d["how"] for d in decisions if d["kind"] == "ask"] == ["tpe"]
        # A budget smaller than one call: the endpoint is never called.
        (tmp_path / "poor").mkdir()
        poor = llm_study(tmp_path / "poor", tiny_model, tokens=50)
        _, decisions = anyio.run(ask_once, poor, redis_url)
    assert len(fixed.requests) == 1
    assert any("planner token budget" in d["why"] for d in decisions if d["kind"] == "planner_refused")


@pytest.mark.slow
def test_jets_gateway_serving_the_tiny_model_is_noise_and_falls_back(tmp_path, redis_url, tiny_model, monkeypatch):
    # The planner's prompt is longer than the test model's 256-token context: this tiny model has 4096.
    served = init_model(tmp_path / "tiny4k", vocab_size=512, hidden_size=32, layers=2, heads=4, kv_heads=2,
                        max_position=4096, seed=0)
    run = f"planner{uuid.uuid4().hex[:6]}"
    secret = "s" * 40
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump({"run": run, "queues": {"block_ms": 200},
                                   "models": [{"name": "tiny", "path": str(served), "max_batch": 4}]}))
    env = {**os.environ, "JET_REDIS_URL": redis_url, "JET_GATEWAY_SECRET": secret, "OMP_NUM_THREADS": "1",
           "JET_LOG_LEVEL": "INFO"}
    logs = {role: open(tmp_path / f"{role}.log", "w") for role in ("infer", "gateway")}
    procs = [subprocess.Popen([sys.executable, "-m", "jet.workers.inference.worker", "--config", str(cfg), "--model", "tiny"],
                              cwd=ROOT, env=env, stdout=logs["infer"], stderr=subprocess.STDOUT),
             subprocess.Popen([sys.executable, "-m", "jet.workers.gateway.app", "--config", str(cfg), "--port", "0"],
                              cwd=ROOT, env=env, stdout=logs["gateway"], stderr=subprocess.STDOUT)]
    try:
        deadline = time.monotonic() + 120
        while not (found := re.search(r"serving on (http://\S+/v1)", (tmp_path / "gateway.log").read_text())):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
            time.sleep(0.2)
        base_url = found.group(1)

        async def an_episode_key() -> str:  # what an env worker does for an episode: open it, mint its key
            r = await connect(redis_url)
            session = SimpleNamespace(episode_id="planner", tag="t1", model="tiny", agent="planner")
            await Episodes(Signer(secret.encode(), run), base_url, r, Keys(run), redis_url).open(session, 600)
            await r.aclose()
            return session.openai_api_key

        monkeypatch.setenv("JET_STUDY_LLM_BASE_URL", base_url)
        monkeypatch.setenv("JET_STUDY_LLM_API_KEY", anyio.run(an_episode_key))
        study = llm_study(tmp_path, tiny_model)
        runner, decisions = anyio.run(ask_once, study, redis_url)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    [refused] = [d for d in decisions if d["kind"] == "planner_refused"]
    assert refused["tokens"] > 0 and "LLM proposal refused" in refused["why"], refused  # it answered: noise
    assert [d["how"] for d in decisions if d["kind"] == "ask"] == ["tpe"]
    [arm] = runner.arms.values()
    assert study.contains(arm.params)
