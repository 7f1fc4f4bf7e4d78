"""The readers behind the pages: growing metrics files, token texts, study folders, the worker registry."""

from __future__ import annotations

import json

import anyio
import pytest

from jet.dash import studies
from jet.dash.episodes import token_texts
from jet.dash.training import Curves
from jet.queues import registry
from jet.queues.connect import connect


def _lines(path, steps, **extra):
    with open(path, "a") as f:
        for s in steps:
            f.write(json.dumps({"step": s, "time": 100.0 + s, "train/loss": 1 / s, **extra}) + "\n")


def test_curves_send_only_new_points_and_start_over_when_a_resume_rewrites_the_file(tmp_path):
    folder = tmp_path / "demo" / "trainer" / "tiny"
    folder.mkdir(parents=True)
    path = folder / "metrics.jsonl"
    _lines(path, [1, 2, 3], **{"rollout/reward_mean": 0.5})
    curves = Curves(tmp_path)
    assert curves.models("demo") == ["tiny"]
    first = curves.since("demo", "tiny")
    assert first["reset"] and first["lines"] == 3
    assert first["series"]["train/loss"] == [[1.0, 1.0], [2.0, 0.5], [3.0, 1 / 3]]
    with open(path, "a") as f:
        f.write('{"step": 4, "train/loss": 0.25}\n{"step": 5, "train/lo')  # the trainer mid-write
    more = curves.since("demo", "tiny", first["epoch"], first["lines"])
    assert not more["reset"] and more["series"] == {"train/loss": [[4.0, 0.25]]} and more["lines"] == 4
    assert curves.since("demo", "tiny", first["epoch"], 4)["series"] == {}
    # a resumed trainer drops the lost steps in place (same inode), then logs again past the old size
    kept = path.read_text().splitlines()[:2]
    path.write_text("".join(line + "\n" for line in kept))
    _lines(path, [3, 4, 5, 6, 7, 8], **{"rollout/reward_mean": 0.9, "note": "x"})
    again = curves.since("demo", "tiny", first["epoch"], 4)
    assert again["reset"] and again["epoch"] == first["epoch"] + 1 and again["lines"] == 8
    assert [p[0] for p in again["series"]["train/loss"]] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert again["series"]["rollout/reward_mean"][-1] == [8.0, 0.9] and "note" not in again["series"]
    assert curves.latest("demo", "tiny")["step"] == 8 and curves.started("demo", "tiny") == 101.0


def test_the_evaluators_rows_join_the_curves_under_one_cursor(tmp_path):
    folder = tmp_path / "demo" / "trainer" / "tiny"
    folder.mkdir(parents=True)
    _lines(folder / "metrics.jsonl", [1, 2])
    curves = Curves(tmp_path)
    first = curves.since("demo", "tiny")
    assert first["lines"] == 2 and "eval/add/reward_mean" not in first["series"]
    evals = folder / "eval.jsonl"  # appears once the evaluator wrote the base weights' result
    evals.write_text(json.dumps({"step": 0, "version": 0, "time": 50.0, "eval/add/reward_mean": 0.1,
                                 "eval/add/results": [0, 1]}) + "\n")
    second = curves.since("demo", "tiny", first["epoch"], first["lines"])
    assert second["reset"], "a file that appears starts the columns over"
    assert second["series"]["eval/add/reward_mean"] == [[0.0, 0.1]] and second["lines"] == 3
    _lines(folder / "metrics.jsonl", [3])
    with open(evals, "a") as f:
        f.write(json.dumps({"step": 2, "version": 2, "time": 102.0, "eval/add/reward_mean": 0.4}) + "\n")
    third = curves.since("demo", "tiny", second["epoch"], second["lines"])
    assert not third["reset"] and third["lines"] == 5
    assert third["series"] == {"train/loss": [[3.0, 1 / 3]], "eval/add/reward_mean": [[2.0, 0.4]]}
    assert curves.latest("demo", "tiny")["step"] == 3, "the latest line is the trainer's"
    assert curves.started("demo", "tiny") == 101.0, "the evaluator's rows do not move the start"


@pytest.mark.parametrize("text", ["plain ascii words", "naïve café ü 🎉 日本語", "  spaces\n\nand\ttabs  "])
def test_token_texts_join_to_the_decoded_sequence(tokenizer_dir, text):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok.encode(text, add_special_tokens=False)
    decode = lambda xs: tok.decode(xs, skip_special_tokens=False)
    parts = token_texts(decode, ids)
    assert len(parts) == len(ids) and "".join(parts) == decode(ids) == text
    assert "\ufffd" not in "".join(parts)


def test_a_study_folder_is_read_as_far_as_it_exists(tmp_path):
    root = tmp_path / "studies"
    (root / "empty").mkdir(parents=True)
    s = root / "staleness"
    (s / "plots").mkdir(parents=True)
    rows = ["arm,seed,step,eval_reward"] + [f"{arm},{seed},{step},{base + seed * 0.1 + step * 0.01}"
                                            for arm, base in (("ppo", 0.2), ("decoupled", 0.5))
                                            for seed in range(3) for step in (10, 20)]
    (s / "results.csv").write_text("\n".join(rows) + "\n")
    (s / "decisions.jsonl").write_text('{"time": 1, "kind": "ask", "arm": "ppo"}\nnot json\n{"time": 2, "kind": "prune"}\n')
    (s / "report.md").write_text("# Study\n\nverdict: supported\n")
    (s / "plots" / "curves.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    listed = {x["name"]: x["files"] for x in studies.studies(root)}
    assert listed == {"empty": [], "staleness": ["results", "decisions", "report"]}
    got = studies.study(root, "staleness")
    res = got["results"]
    assert res["arm_column"] == "arm" and len(res["rows"]) == 12 and list(res["arms"]) == ["eval_reward"]
    ppo = res["arms"]["eval_reward"]["ppo"]  # 6 runs: 0.2 + seed {0, .1, .2} + step {.1, .2}: mean 0.45
    assert ppo["n"] == 6 and ppo["mean"] == pytest.approx(0.45) and ppo["lo"] < 0.45 < ppo["hi"]
    one_step = res["curves"]["eval_reward"]["decoupled"][0]  # step 10: 0.6, 0.7, 0.8; t(2) = 4.303
    assert one_step["step"] == 10 and one_step["mean"] == pytest.approx(0.7)
    assert one_step["hi"] - one_step["mean"] == pytest.approx(4.303 * 0.1 / 3 ** 0.5, rel=1e-3)
    assert [d["kind"] for d in got["decisions"]] == ["ask", "prune"] and "supported" in got["report"]
    assert got["plots"] == ["plots/curves.png"]
    assert studies.file_in(root, "staleness", "plots/curves.png") is not None
    for bad in ("../staleness/report.md", "/etc/passwd", "plots/../../x", ".hidden"):
        assert studies.file_in(root, "staleness", bad) is None
    assert studies.study(root, "..") is None and studies.study(root, "missing") is None
    assert studies.study(root, "empty") == {"name": "empty", "files": [], "plots": []}


@pytest.mark.anyio
async def test_heartbeats_list_workers_alive_then_gone(redis_url, keys):
    r = await connect(redis_url)
    try:
        await registry.beat(r, keys, "h-infer-tiny-0", "infer", every_s=0.4, model="tiny", weight_version=2,
                            code_version=None)
        await registry.beat(r, keys, "h-env-guess-0", "env", code_version="abc")
        got = {w["name"]: w for w in await registry.workers(r, keys)}
        infer = got["h-infer-tiny-0"]
        assert infer["alive"] and infer["role"] == "infer" and infer["weight_version"] == 2
        assert "code_version" not in infer and infer["pid"] > 0 and infer["started"] <= infer["beat"]
        with anyio.fail_after(10):
            while (await registry.workers(r, keys))[1]["alive"]:  # sorted by name: the infer worker
                await anyio.sleep(0.2)  # its hash expires after a few missed beats
        gone = {w["name"]: w for w in await registry.workers(r, keys)}["h-infer-tiny-0"]
        assert not gone["alive"] and gone["last_beat"] == pytest.approx(infer["beat"])
        async with anyio.create_task_group() as tg:  # the loop keeps it alive, with fields read at each beat
            version = [5]
            tg.start_soon(lambda: registry.heartbeat(r, keys, "h-infer-tiny-0", "infer",
                                                     lambda: {"weight_version": version[0]}, every_s=0.1))
            with anyio.fail_after(5):
                while not (w := {x["name"]: x for x in await registry.workers(r, keys)}["h-infer-tiny-0"])["alive"] \
                        or w["weight_version"] != 5:
                    await anyio.sleep(0.05)
                version[0] = 6
                while {x["name"]: x for x in await registry.workers(r, keys)}["h-infer-tiny-0"]["weight_version"] != 6:
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
    finally:
        await r.aclose()
