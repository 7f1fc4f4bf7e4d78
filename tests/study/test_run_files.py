"""What a finished study run leaves in its folder (`worker.keep_files`), and its kept outcome.

A finished run's checkpoints (3 GB a run on SmolLM2) and older weight versions are deleted once its
outcome is kept in its folder; a request delivered again after that commits the kept outcome instead
of running again from a folder without checkpoints. Real files, no Redis needed: the kept path never
reaches the ledger.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import anyio
import pytest

from jet.errors import CodecError
from jet.queues import codec
from jet.study.execution import RESULT_FILE, Finished, compose, execute, record, recorded, tidy
from jet.study.messages import RunRequest, RunResult


def request(**kw) -> RunRequest:
    req = RunRequest("s", "s-t0-s0", 0, 0, 0, {"trainer.lr": 1e-3}, "/x.yaml", ["trainer.lr=0.001"],
                     "eval/add/reward_mean", None, 16, 60.0, 2, 10.0, {"OMP_NUM_THREADS": "1"})
    return replace(req, **kw)


def outcome(req: RunRequest) -> RunResult:
    return RunResult(run=req.run, trial=req.trial, seed=req.seed, stage=req.stage, status="completed",
                     curve=[(8, 0.5), (16, 0.625)], steps=16, duration_s=301.5, attempts=1, worker="w-0",
                     finished_at=1.7e9, final={"train/loss": 0.25})


def write(path: Path, size: int) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    return size


def a_finished_run(run_dir: Path) -> dict[str, int]:
    """A run folder as a finished SmolLM2 run leaves it (small files): sizes of what tidy may delete."""
    kept = ["config.resolved.yaml", "logs/train-policy.log", "trainer/policy/metrics.jsonl",
            "trainer/policy/eval.jsonl", "trainer/policy/ledger/step-00000016.json"]
    for name in kept:
        write(run_dir / name, 10)
    return {
        "checkpoints": write(run_dir / "trainer/policy/checkpoints/step-00000008/model.safetensors", 300)
        + write(run_dir / "trainer/policy/checkpoints/step-00000016/optimizer.safetensors", 500),
        "old": write(run_dir / "weights/policy/v15/model.safetensors", 70),
        "newest": write(run_dir / "weights/policy/v16/model.safetensors", 90),
    }


def survivors(run_dir: Path) -> set[str]:
    return {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()}


@pytest.mark.parametrize("keep", ["final_weights", "metrics", "all"])
def test_tidy_deletes_only_what_a_finished_run_no_longer_needs(tmp_path, keep):
    run_dir = tmp_path / "runs" / "s-t0-s0"
    sizes = a_finished_run(run_dir)
    before = survivors(run_dir)
    freed = tidy(run_dir, keep)
    left = survivors(run_dir)
    metrics = {f for f in before if "checkpoints" not in f and not f.startswith("weights/")}
    assert metrics <= left  # the report's inputs (metrics, evaluations), logs, config and ledger stay
    if keep == "all":
        assert (freed, left) == (0, before)
        return
    assert not (run_dir / "trainer/policy/checkpoints").exists()
    assert not (run_dir / "weights/policy/v15").exists()
    if keep == "final_weights":
        assert left == metrics | {"weights/policy/v16/model.safetensors"}
        assert freed == sizes["checkpoints"] + sizes["old"]
    else:
        assert left == metrics
        assert freed == sizes["checkpoints"] + sizes["old"] + sizes["newest"]
    assert tidy(run_dir, keep) == 0  # again (a tidy cut short, then redone): nothing more to delete


def test_a_run_delivered_again_after_it_finished_commits_its_kept_outcome(tmp_path):
    req = request()
    run_dir = compose(req, tmp_path).run_dir
    a_finished_run(run_dir)
    record(run_dir, req, outcome(req))
    assert (run_dir / RESULT_FILE).is_file()
    # no Redis, no worker process: the kept path must neither launch the run nor read the study's ledger
    got = anyio.run(execute, req, None, "redis://nowhere:1", None, tmp_path, "w-1", 2, anyio.Event())
    assert isinstance(got, Finished) and got.result == outcome(req)
    assert not (run_dir / "trainer/policy/checkpoints").exists()  # its tidy, cut short before, is done now
    assert sorted(p.name for p in (run_dir / "weights/policy").iterdir()) == ["v16"]


def test_a_kept_outcome_counts_only_for_the_very_same_request(tmp_path):
    req = request()
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    record(run_dir, req, outcome(req))
    assert recorded(run_dir, req) == outcome(req)
    # another config under the same run name (an edited study file): it runs, not the old outcome
    assert recorded(run_dir, replace(req, overrides=["trainer.lr=0.002"])) is None
    assert recorded(run_dir, replace(req, steps=32)) is None
    assert recorded(tmp_path / "elsewhere", req) is None
    # a damaged file is no outcome: the run runs again
    data = (run_dir / RESULT_FILE).read_bytes()
    for damaged in (data[: len(data) // 2], b"[1, 2]", b'{"request": {}, "result": {"run": 3}}'):
        (run_dir / RESULT_FILE).write_bytes(damaged)
        assert recorded(run_dir, req) is None


def test_a_request_carries_its_keep_files_and_refuses_an_unknown_one():
    req = request(keep_files="metrics")
    assert RunRequest.from_payload(codec.decode(req.to_fields())).keep_files == "metrics"
    fields = request(keep_files="everything").to_fields()
    with pytest.raises(CodecError, match="keep_files.*final_weights, metrics, all.*everything"):
        RunRequest.from_payload(codec.decode(fields))


def test_a_tidy_that_fails_leaves_the_outcome_standing(tmp_path):
    req = request()
    run_dir = compose(req, tmp_path).run_dir
    a_finished_run(run_dir)
    record(run_dir, req, outcome(req))
    # checkpoints kept on another disk through a symlink: rmtree refuses a symlink (OSError)
    checkpoints = run_dir / "trainer/policy/checkpoints"
    elsewhere = tmp_path / "other-disk"
    checkpoints.rename(elsewhere)
    checkpoints.symlink_to(elsewhere, target_is_directory=True)
    got = anyio.run(execute, req, None, "redis://nowhere:1", None, tmp_path, "w-1", 2, anyio.Event())
    assert isinstance(got, Finished) and got.result == outcome(req)
    assert checkpoints.is_symlink() and any(elsewhere.rglob("*.safetensors"))  # nothing lost, nothing raised


def test_jet_study_tidy_tidies_the_finished_runs_of_a_study(tmp_path, embedded, tiny_model):
    """A study whose runs finished before their worker tidied (or kept `all`): `jet study tidy` keeps each
    finished run's outcome in its folder and tidies it; a run still running is left as it is."""
    from click.testing import CliRunner

    from jet.keys import Keys
    from jet.queues.connect import connect
    from jet.study import ledger
    from jet.study.cli import study
    from tests.study.conftest import base_config, write_study

    base_config(tmp_path, tiny_model)
    path = write_study(tmp_path, {"name": "old", "space": {"trainer.lr": {"choices": [1e-3]}}, "seeds": [0, 1],
                                  "metric": {"name": "train/lr", "window": 1}})
    study_dir = tmp_path / "studies" / "old"
    done, running = (request(study="old", run=f"old-t0-s{s}", seed=s, keep_files="all") for s in (0, 1))
    folders = {req.run: compose(req, study_dir).run_dir for req in (done, running)}
    for folder in folders.values():
        a_finished_run(folder)
    before = survivors(folders[done.run])

    async def ledger_of_a_finished_and_a_running_run():
        r, keys = await connect(embedded.url), Keys.for_study("old")
        for req in (done, running):
            await ledger.launch(r, embedded.url, keys, req)
        await r.xadd(keys.study_results, outcome(done).to_fields())
        await r.aclose()

    anyio.run(ledger_of_a_finished_and_a_running_run)
    args = ["tidy", str(path), "--redis-url", embedded.url]
    result = CliRunner().invoke(study, args)
    assert result.exit_code == 0, result.output
    assert "1 finished runs tidied (each by the worker.keep_files it ran with)" in result.output
    assert "1 unfinished runs left as they are" in result.output
    assert recorded(folders[done.run], done) == outcome(done)  # kept before anything is deleted
    assert survivors(folders[done.run]) == before | {RESULT_FILE}  # its own keep_files: all
    result = CliRunner().invoke(study, [*args, "--keep", "final_weights"])
    assert result.exit_code == 0 and "old-t0-s0: deleted 0.00 GB" in result.output, result.output
    assert survivors(folders[done.run]) == {f for f in before if "checkpoints" not in f and "v15" not in f} | {
        RESULT_FILE}
    assert survivors(folders[running.run]) == before, "a run without a result is not touched"
    result = CliRunner().invoke(study, [*args, "--keep", "everything"])
    assert result.exit_code == 2 and "everything" in result.output
