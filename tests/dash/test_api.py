"""The dashboard's JSON API and /metrics against a real Redis: what the pages read, and the actions."""

from __future__ import annotations

import anyio
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jet.keys import GROUP_ENV, GROUP_INFER, Keys
from jet.queues import registry
from jet.queues.connect import connect
from jet.queues.consumer import Consumer, Settings
from jet.timeline import Call, merge_calls
from jet.wire import Task, Trajectory, WeightVersion

HOST = "hostA"


def until(fn, timeout=10.0, what="a truthy value"):
    """fn()'s first truthy value, polled (swarm snapshots are cached for a second); fails after `timeout` s."""
    import time

    deadline = time.monotonic() + timeout
    while not (got := fn()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last: {got!r})")
        time.sleep(0.1)
    return got


async def _poison_and_pending(url: str, keys: Keys) -> None:
    """tasks:guess with a malformed entry (dead-lettered by a real consumer), one task pending on a
    named env consumer, an infer group with its consumer, a weight announcement and one heartbeat."""
    r = await connect(url)
    try:
        stream = keys.tasks("guess")
        await r.xadd(stream, {b"x": b"garbage"})
        c = Consumer(r, r, url, keys, stream, GROUP_ENV, f"{HOST}-env-guess-0", Settings(block_ms=100))
        await c.ensure_group()
        assert await c.fetch() == []  # the garbage went to dead, with its reason
        await r.xadd(stream, Task("guess", {"n": 1}, "g1").to_fields())
        assert len(await c.fetch()) == 1  # now pending on hostA-env-guess-0
        gen = Consumer(r, r, url, keys, keys.gen("tiny"), GROUP_INFER, f"{HOST}-infer-tiny-0", Settings(block_ms=100))
        await gen.ensure_group()
        await gen.fetch()
        # Redis 7.0 creates a consumer only when a read returns entries (Valkey on any read): name it outright.
        await r.xgroup_createconsumer(keys.gen("tiny"), GROUP_INFER, f"{HOST}-infer-tiny-0")
        await r.xadd(keys.weights("tiny"), WeightVersion("tiny", 3, "/w/v3", "ab" * 32, step=3).to_fields())
        await registry.beat(r, keys, "gpu1-infer-tiny-0", "infer", model="tiny", weight_version=3, code_version="c0de")
    finally:
        await r.aclose()


def test_swarm_shows_streams_groups_consumers_dead_letters_and_workers(client, redis_url, keys):
    anyio.run(_poison_and_pending, redis_url, keys)
    s = client.get("/api/swarm").json()
    streams = {x["name"]: x for x in s["streams"]}
    assert streams["tasks:guess"]["length"] == 2  # the garbage (acked, copied to dead) and the task
    [g] = streams["tasks:guess"]["groups"]
    assert g["name"] == "env" and g["pending"] == 1 and g["lag"] == 0
    assert [c["name"] for c in g["consumers"]] == [f"{HOST}-env-guess-0"]
    [d] = s["dead_letters"]
    assert s["dead"] == 1 and d["stream"] == "tasks:guess" and "no schema version" in d["reason"]
    workers = {w["name"]: w for w in s["workers"]}
    env = workers[f"{HOST}-env-guess-0"]
    assert (env["role"], env["host"], env["alive"], env["pending"], env["source"]) == ("env", HOST, True, 1, "consumer")
    infer = workers[f"{HOST}-infer-tiny-0"]  # reads gen:tiny, beats not: the announced version
    assert (infer["role"], infer["model"], infer["weight_version"], infer["weight_source"]) == ("infer", "tiny", 3,
                                                                                             "announced")
    beat = workers["gpu1-infer-tiny-0"]
    assert (beat["alive"], beat["weight_version"], beat["code_version"], beat["source"]) == (True, 3, "c0de",
                                                                                          "heartbeat")
    assert s["weights"]["tiny"]["version"] == 3 and s["models"] == ["tiny"]


def test_dead_letters_are_requeued_and_dropped_with_the_code_of_jet_dlq(client, redis_url, keys):
    anyio.run(_poison_and_pending, redis_url, keys)
    [d] = client.get("/api/swarm").json()["dead_letters"]
    res = client.post("/api/dlq", json={"op": "requeue", "ids": [d["id"]], "run": keys.run})
    assert res.status_code == 200 and res.json() == {"op": "requeue", "changed": 1}
    s = client.get("/api/swarm").json()
    assert s["dead"] == 0 and {x["name"]: x for x in s["streams"]}["tasks:guess"]["length"] == 3  # back on its stream
    import redis

    r = redis.Redis.from_url(redis_url)
    last = r.xrevrange(keys.tasks("guess"), count=1)[0][1]
    assert last == {b"x": b"garbage"}  # the very entry, as it was
    # poison it again, then drop it
    anyio.run(_dead_again, redis_url, keys)
    [d] = until(lambda: client.get("/api/swarm").json()["dead_letters"], what="the dead letter in /api/swarm")
    assert client.post("/api/dlq", json={"op": "drop", "ids": [d["id"]]}).json()["changed"] == 1
    assert client.get("/api/swarm").json()["dead"] == 0


async def _dead_again(url, keys):
    r = await connect(url)
    try:
        c = Consumer(r, r, url, keys, keys.tasks("guess"), GROUP_ENV, f"{HOST}-env-guess-1", Settings(block_ms=100))
        await c.fetch()
    finally:
        await r.aclose()


def test_actions_refuse_bad_bodies_forms_and_other_origins(client, redis_url, keys):
    assert client.post("/api/dlq", json={"op": "explode", "ids": []}).status_code == 400
    assert client.post("/api/dlq", json={"op": "drop", "ids": "1-0"}).status_code == 400
    form = client.post("/api/dlq", data={"op": "drop"})  # what a form on another site could send
    assert form.status_code == 400 and "JSON body" in form.json()["error"]
    other = client.post("/api/dlq", json={"op": "drop", "ids": []}, headers={"Origin": "http://evil.example"})
    assert other.status_code == 403
    assert client.get("/api/swarm", params={"run": "bad run"}).status_code == 400


def test_loopback_answers_loopback_names_only_and_a_token_guards_the_rest(redis_url, keys, runs_dir):
    from starlette.testclient import TestClient

    from jet.dash.server import Settings as DashSettings
    from jet.dash.server import create_app

    loop = TestClient(create_app(DashSettings(redis_url=redis_url, runs_dir=str(runs_dir), run=keys.run)),
                      base_url="http://127.0.0.1:8265")
    assert loop.get("/api/runs").status_code == 200
    assert loop.get("/api/runs", headers={"Host": "localhost:8265"}).status_code == 200
    assert loop.get("/api/runs", headers={"Host": "rebind.example:8265"}).status_code == 421  # DNS rebinding
    app = create_app(DashSettings(redis_url=redis_url, runs_dir=str(runs_dir), run=keys.run, token="s3cret",
                                  loopback=False))
    with TestClient(app, base_url="http://10.1.2.3:8265") as c:
        assert c.get("/api/runs").status_code == 401 and c.get("/metrics").status_code == 401
        assert c.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        first = c.get("/?token=s3cret", follow_redirects=False)  # the printed URL: sets the cookie, drops the token
        assert first.status_code == 303 and first.headers["location"] == "/"
        assert "HttpOnly" in first.headers["set-cookie"] and "SameSite=Strict" in first.headers["set-cookie"]
        assert c.get("/").status_code == 200 and c.get("/api/runs").status_code == 200  # by cookie now
        assert c.get("/static/app.js").status_code == 200


def _traj_fields(tokenizer_dir, *, reward=1.0, task="guess", failed=False, no_calls=False) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Guess a number ü 🎉"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    answer = tok.encode("I guess 7 — naïve", add_special_tokens=False)
    samples = merge_calls([Call(prompt, answer, [-0.25] * len(answer), 2, "tiny")], "exact", episode_id="e",
                          reward=reward)
    meta = {"worker": f"{HOST}-env-{task}-0", "code_version": "c0ffee", "host": HOST, "calls": 0 if no_calls else 1}
    if no_calls:
        meta["no_llm_calls"] = True
    t = Trajectory(task=task, group_id="g", index=0, episode_id="e", model="tiny", reward=reward,
                   samples=() if failed or no_calls else tuple(samples), failed=failed,
                   error="ValueError: boom" if failed else None,
                   traceback="Traceback (most recent call last):\n  ...\nValueError: boom" if failed else None, meta=meta)
    return t.to_fields()


def test_episodes_are_listed_filtered_and_decoded_without_consuming(client, redis_url, keys, tokenizer_dir):
    import redis

    r = redis.Redis.from_url(redis_url)
    stream = keys.traj("tiny")
    r.xgroup_create(stream, "trainer", id="0", mkstream=True)
    ids = [r.xadd(stream, _traj_fields(tokenizer_dir, reward=x)).decode() for x in (0.0, 0.5, 1.0)]
    failed = r.xadd(stream, _traj_fields(tokenizer_dir, failed=True)).decode()
    empty = r.xadd(stream, _traj_fields(tokenizer_dir, task="arith", no_calls=True)).decode()
    r.xadd(stream, {b"v": b"1", b"k": b"traj", b"i": b"x", b"m": b"{}"})  # unreadable: listed as such
    rows = client.get("/api/episodes", params={"model": "tiny"}).json()
    assert [e["id"] for e in rows["rows"]] == [empty, failed, *reversed(ids)] and len(rows["unreadable"]) == 1
    pick = lambda **q: [e["id"] for e in client.get("/api/episodes", params={"model": "tiny", **q}).json()["rows"]]
    assert pick(min_reward=0.5) == [empty, ids[2], ids[1]]
    assert pick(min_reward=0.5, task="guess") == [ids[2], ids[1]]
    assert pick(max_reward=0.2, task="gue") == [ids[0]] and pick(failed="true") == [failed]
    assert pick(no_llm_calls="1") == [empty] and pick(limit=2) == [empty, failed]
    page = client.get("/api/episodes", params={"model": "tiny", "limit": 2}).json()
    assert pick(limit=2, before=page["next"]) == [ids[2], ids[1]]
    assert r.xinfo_groups(stream)[0]["pending"] == 0 and r.xinfo_groups(stream)[0]["lag"] == 6  # nothing consumed

    one = client.get("/api/episode", params={"model": "tiny", "id": ids[1]}).json()
    [s] = one["samples_view"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert "".join(s["text"]) == tok.decode(s["tokens"], skip_special_tokens=False)
    assert "Guess a number ü 🎉" in "".join(s["text"]) and "naïve" in "".join(s["text"])
    assert one["decoded"] and one["reward"] == 0.5 and one["code_version"] == "c0ffee" and one["versions"] == [2]
    trained = [t for t, m in zip(s["text"], s["mask"]) if m]
    assert "".join(trained).startswith("I guess 7") and set(s["logprobs"][-1:]) == {-0.25}
    bad = client.get("/api/episode", params={"model": "tiny", "id": failed}).json()
    assert bad["failed"] and bad["error"] == "ValueError: boom" and "Traceback" in bad["traceback"]
    assert client.get("/api/episode", params={"model": "tiny", "id": "1-1"}).status_code == 404


def test_prometheus_metrics_scrape(client, redis_url, keys, runs_dir):
    anyio.run(_poison_and_pending, redis_url, keys)
    folder = runs_dir / keys.run / "trainer" / "tiny"
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(orjson.dumps(
        {"step": s, "time": 1.0, "rollout/reward_mean": s / 10, "policy/staleness": 0.5, "perf/tokens_per_s": 99.0,
         "policy/version": s}).decode() + "\n" for s in (1, 2, 3)))
    text = client.get("/metrics").text
    got = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            got[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    run = ("run", keys.run)
    assert got[("jet_stream_length", (run, ("stream", "tasks:guess")))] == 2
    assert got[("jet_group_pending", (("group", "env"), run, ("stream", "tasks:guess")))] == 1
    assert got[("jet_group_lag", (("group", "env"), run, ("stream", "tasks:guess")))] == 0
    assert got[("jet_consumers_alive", (("group", "env"), run, ("stream", "tasks:guess")))] == 1
    assert got[("jet_dead_letters", (run,))] == 1
    assert got[("jet_queue_events_total", (("event", "dead"), run))] == 1
    assert got[("jet_workers_alive", (("role", "infer"), run))] == 2
    assert got[("jet_weight_version", (("model", "tiny"), run))] == 3
    assert got[("jet_trainer_step", (("model", "tiny"), run))] == 3
    assert got[("jet_reward_mean", (("model", "tiny"), run))] == pytest.approx(0.3)
    assert got[("jet_staleness", (("model", "tiny"), run))] == 0.5
    assert got[("jet_trainer_tokens_per_second", (("model", "tiny"), run))] == 99.0


def test_the_api_index_names_every_route(client):
    endpoints = client.get("/api").json()["endpoints"]
    assert any(k.startswith("GET /api/swarm") for k in endpoints) and "GET /metrics" in endpoints
    assert client.get("/").headers["content-type"].startswith("text/html")
