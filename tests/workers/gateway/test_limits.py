"""The gateway's memory is bounded (docs/gateway.md), measured from the process: a standalone `jet gateway`
subprocess, its peak resident set (VmHWM in /proc/<pid>/status) read before and after

- oversized bodies: a 14 MB chat body (under the 16 MiB cap) is refused with 400 context_length_exceeded
  before any prompt or generation request is built, a body over the cap gets 413;
- many concurrent requests: past `--max-in-flight` requests or `--max-body-in-flight-mb` bytes of bodies,
  429 with Retry-After (never a 503), and the held requests complete once inference runs;
- more concurrent requests than redis-py's default pool of 100 connections, all answered 200.

The bound asserted is the one docs/gateway.md documents: MEMORY_BOUND_MB over the process's own resident set after
start-up, whatever the load.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import sys
import time

import anyio
import httpx
import orjson
import pytest

from jet.keys import Keys
from jet.llm import LLMClient, Tokenizers
from jet.queues.connect import connect
from jet.workers.gateway.auth import Signer, load_secret
from jet.workers.gateway.sessions import Episodes
from jet.workers.inference import worker as infer
from tests.workers.conftest import MODEL, ROOT, wait_for, write_config
from tests.workers.gateway.test_gateway import ScriptedBackend

pytestmark = pytest.mark.slow  # every test here starts processes (tests/conftest.py: the process guard)
MEMORY_BOUND_MB = 200  # docs/gateway.md's bound: peak resident set over the gateway's own after start-up
USER = {"role": "user", "content": "Hi"}


def status_mb(pid: int, field: str) -> float:
    text = open(f"/proc/{pid}/status").read()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) / 1024


@contextlib.contextmanager
def gateway_process(tmp_path, cfg_path, url, *args):
    """`jet gateway` as a subprocess on a free port; yields (process, base URL)."""
    env = {**os.environ, "JET_REDIS_URL": url, "JET_LOG_LEVEL": "INFO", "OMP_NUM_THREADS": "1"}
    env.pop("JET_GATEWAY_SECRET", None)
    log = tmp_path / "gateway.log"
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "jet.workers.gateway.app", "--config", str(cfg_path), "--port", "0",
                              *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (found := re.search(r"serving on (http://\S+/v1)", log.read_text())):
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield p, found.group(1)
    finally:
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def episode_key(url: str, keys: Keys, base_url: str, tiny_model) -> str:
    """Open an episode on the standalone gateway (as an env worker does); its API key."""
    r = await connect(url)
    try:
        episodes = Episodes(Signer(await load_secret(r, keys, url), keys.run), base_url, r, keys, url)
        session = LLMClient(url, keys, Tokenizers({MODEL: str(tiny_model)})).session("ep", MODEL)
        await episodes.open(session, ttl_s=300, task="limits")
        return session.openai_api_key
    finally:
        await r.aclose()


@pytest.fixture
def cfg_path(tmp_path, keys, tiny_model):
    write_config(tmp_path / "c.yaml", keys.run, tiny_model, [{"name": "t", "workflow": "a.b:c"}])
    return tmp_path / "c.yaml"


@pytest.mark.anyio
async def test_oversized_bodies_are_refused_before_anything_is_built(redis_url, keys, cfg_path, tmp_path, tiny_model):
    with gateway_process(tmp_path, cfg_path, redis_url) as (p, base_url):
        key = await episode_key(redis_url, keys, base_url, tiny_model)
        auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        async with httpx.AsyncClient(base_url=base_url + "/", headers=auth, timeout=60) as http:
            res = await http.post("chat/completions", json={"messages": [{"role": "user", "content": "a b " * 2000}]})
            assert res.status_code == 400 and res.json()["error"]["code"] == "context_length_exceeded"  # tokens
            start = status_mb(p.pid, "VmRSS")
            for body in (orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * 2_800_000}]}),
                         orjson.dumps({"model": MODEL, "messages": [USER] + [{"role": "user", "content": "x" * 1000}]
                                       * 14_000})):
                assert 13e6 < len(body) < 16 * 2**20
                t0 = time.monotonic()
                res = await http.post("chat/completions", content=body)
                took = time.monotonic() - t0
                error = res.json()["error"]
                assert res.status_code == 400 and error["code"] == "context_length_exceeded", error
                assert "characters of text" in error["message"] and took < 10
                print(f"{len(body) / 1e6:.1f} MB body: 400 in {took:.2f}s")
            res = await http.post("chat/completions", content=b'{"messages": "' + b"x" * (17 * 2**20) + b'"}')
            assert res.status_code == 413 and res.json()["error"]["code"] == "request_too_large"
            grew = status_mb(p.pid, "VmHWM") - start
        assert grew < MEMORY_BOUND_MB, f"peak resident set grew by {grew:.0f} MB"
        print(f"oversized bodies: peak resident set +{grew:.0f} MB over {start:.0f} MB")


async def post(http, body: bytes) -> httpx.Response:
    return await http.post("chat/completions", content=body)


@pytest.mark.anyio
async def test_requests_past_the_limits_get_429_and_memory_stays_bounded(redis_url, keys, cfg_path, tmp_path,
                                                                          tiny_model):
    args = ("--max-in-flight", "8", "--max-body-in-flight-mb", "4")
    small = orjson.dumps({"model": MODEL, "messages": [USER], "max_tokens": 4})
    padded = orjson.dumps({"model": MODEL, "messages": [USER], "max_tokens": 4, "metadata": {"pad": "x" * 1_500_000}})
    r = await connect(redis_url)
    with gateway_process(tmp_path, cfg_path, redis_url, *args) as (p, base_url):
        key = await episode_key(redis_url, keys, base_url, tiny_model)
        auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
        held, answers = [], []
        async with httpx.AsyncClient(base_url=base_url + "/", headers=auth, timeout=120, limits=limits) as http:
            async with anyio.create_task_group() as tg:
                async def hold(body):
                    held.append(await post(http, body))

                # No inference worker yet: admitted requests wait for generation, holding their places.
                for body in (padded, padded):
                    tg.start_soon(hold, body)
                await wait_for(lambda: _requests(r, keys, 2), timeout=30)
                start = status_mb(p.pid, "VmRSS")
                over = await post(http, padded)  # 3 x 1.5 MB of bodies > 4 MiB
                assert over.status_code == 429 and "request bodies in flight" in over.json()["error"]["message"]
                for _ in range(6):
                    tg.start_soon(hold, small)
                await wait_for(lambda: _requests(r, keys, 8), timeout=30)

                async def burst():
                    answers.append(await post(http, small))

                async with anyio.create_task_group() as many:
                    for _ in range(200):
                        many.start_soon(burst)
                grew = status_mb(p.pid, "VmHWM") - start
                assert [a.status_code for a in answers] == [429] * 200
                assert {a.headers["retry-after"] for a in answers} == {"1"}
                assert {a.json()["error"]["code"] for a in answers} == {"gateway_busy"}

                # Inference starts: the held requests are answered, and the gateway admits again.
                stop = anyio.Event()
                cfg = write_config(tmp_path / "c.yaml", keys.run, tiny_model, [{"name": "t", "workflow": "a.b:c"}])
                tg.start_soon(functools.partial(infer.run, cfg, MODEL, redis_url, stop,
                                                backend=ScriptedBackend(tiny_model)))
                await wait_for(lambda: _n(held, 8), timeout=60)
                assert (await post(http, small)).status_code == 200
                stop.set()
        assert [h.status_code for h in held] == [200] * 8
    await r.aclose()
    assert grew < MEMORY_BOUND_MB, f"peak resident set grew by {grew:.0f} MB"
    print(f"200 concurrent requests past the limits: peak resident set +{grew:.0f} MB over {start:.0f} MB")


@pytest.mark.anyio
async def test_more_concurrent_requests_than_a_default_redis_pool(redis_url, keys, cfg_path, tmp_path, tiny_model):
    """150 requests at once through a gateway admitting 160: redis-py's default pool (100 connections) answered
    503 "Too many connections"; the pool now follows --max-in-flight and every request gets 200."""
    body = orjson.dumps({"model": MODEL, "messages": [USER], "max_tokens": 2})
    stop = anyio.Event()
    cfg = write_config(tmp_path / "c.yaml", keys.run, tiny_model, [{"name": "t", "workflow": "a.b:c"}])
    with gateway_process(tmp_path, cfg_path, redis_url, "--max-in-flight", "160") as (p, base_url):
        key = await episode_key(redis_url, keys, base_url, tiny_model)
        auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
        codes = []
        async with httpx.AsyncClient(base_url=base_url + "/", headers=auth, timeout=120, limits=limits) as http:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(infer.run, cfg, MODEL, redis_url, stop,
                                                backend=ScriptedBackend(tiny_model)))

                async def call():
                    codes.append((await post(http, body)).status_code)

                async with anyio.create_task_group() as many:
                    for _ in range(150):
                        many.start_soon(call)
                stop.set()
    assert sorted(codes) == [200] * 150, sorted(set(codes))


async def _requests(r, keys, n):
    return await r.xlen(keys.gen(MODEL)) >= n


async def _n(items, n):
    return len(items) >= n
