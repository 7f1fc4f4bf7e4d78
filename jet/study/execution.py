"""One study run on a study worker: its config, its `jet up` (under a keeper), its metrics, its outcome.

What it is: `execute(req, ...)` turns a `RunRequest` into an outcome:
1. compose the run's config: the base file with the request's overrides
   (templates {seed} {run} {run_dir} {study_dir} filled in), `run` = the run
   name and `runs_dir` = `<study folder>/runs`, so the run has its own Redis
   namespace and folder, and a second attempt of it resumes there;
2. check it (schema and paths); a bad one is a result, `bad_config`, with the reason;
3. start `python -m jet.study.keeper ... -- python -m jet.cli up --config ...`
   (an ordinary Jet run, no training code of its own) and, while it lives,
   stream each new value of the metric back as `Progress` (from the trainer's
   metrics.jsonl, or for an `eval/...` metric the evaluator's eval.jsonl: held-out
   results of the evaluated versions, at their steps),
   stop it on request (pruned, out of budget, cancelled), at its timeout, or
   when this worker drains;
4. classify how it ended (`classify`, pure).

The outcome is `Finished(result)` (commit the result with the request's ack)
or `Retry(why)` (give the request back: this worker is draining, or an
infrastructure crash with retries left; the next attempt resumes from the
run's last checkpoint).

Timeouts count from the run's first start (kept in Redis), so retries and
reclaims never extend a run's budget.

A finished run's outcome is also kept in its folder (`study-result.json`,
`record`) before the worker tidies the folder (`tidy`: the checkpoints, and
weight versions, that a finished run no longer needs, per `worker.keep_files`).
A request delivered again after that (its worker died before the commit)
commits the kept outcome instead of running again from a folder without
checkpoints.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import orjson

from jet.errors import CodecError
from jet.runs import MetricsFile, RunDir, read_metrics
from jet.study import ledger
from jet.study.keeper import EXIT_NO_LEASE
from jet.study.messages import Progress, RunRequest, RunResult
from jet.supervisor import python_module

log = logging.getLogger(__name__)

POLL_S = 0.5
RESULT_FILE = "study-result.json"  # in the run's folder: the outcome committed for it
FATAL = "stopped with an error that restarting cannot fix"  # jet.supervisor's words for a fatal exit
_RESUMED = re.compile(r"resumed \S+ from .* \(step (\d+)")


@dataclass(frozen=True)
class Finished:
    result: RunResult


@dataclass(frozen=True)
class Retry:
    why: str


@dataclass(frozen=True)
class RunFiles:
    config: str
    overrides: list[str]
    run_dir: Path
    log: Path  # jet up's own output (all attempts)


def fill(text: str, req: RunRequest, run_dir: Path, study_dir: Path) -> str:
    values = {"seed": str(req.seed), "run": req.run, "run_dir": str(run_dir), "study_dir": str(study_dir)}
    return re.sub(r"\{(seed|run|run_dir|study_dir)\}", lambda m: values[m.group(1)], text)


def compose(req: RunRequest, study_dir: Path) -> RunFiles:
    study_dir = study_dir.resolve()
    run_dir = RunDir(study_dir / "runs", req.run).root
    overrides = [fill(o, req, run_dir, study_dir) for o in req.overrides]
    overrides += [f"run={req.run}", f"runs_dir={study_dir / 'runs'}"]
    return RunFiles(req.base, overrides, run_dir, study_dir / "logs" / f"{req.run}.log")


def check(files: RunFiles):
    """The run's JetConfig, or the reason it is not a valid one (str)."""
    from jet.config import load_file
    from jet.errors import ConfigError

    try:
        cfg = load_file(files.config, files.overrides)
    except ConfigError as e:
        return str(e)
    from jet.sources import is_local

    for i, m in enumerate(cfg.models):  # what `jet up` would refuse: a missing model it cannot build
        if is_local(m.path) and not (Path(m.path) / "config.json").is_file() and ".jet/models" not in m.path:
            return f"models[{i}].path: no model directory at {m.path!r}"
    if not any(m.trainable for m in cfg.models):
        return "no trainable model: a study run needs a trainer's metrics"
    return cfg


def metrics_path(cfg, model: str | None) -> Path:
    return RunDir.of(cfg).metrics(_trained(cfg, model))


def source_path(cfg, model: str | None, metric: str) -> Path:
    """The file that holds `metric`: the evaluator's (`eval/...`: held-out results per evaluated version,
    `tasks[].eval`), else the trainer's metrics."""
    return RunDir.of(cfg).evals(_trained(cfg, model)) if metric.startswith("eval/") else metrics_path(cfg, model)


def _trained(cfg, model: str | None) -> str:
    return model or next(m.name for m in cfg.models if m.trainable)


def curve_of(rows: list[dict], metric: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[metric])) for r in rows if metric in r and "step" in r]


def classify(code: int | None, rows: list[dict], req: RunRequest, stop: str | None, timed_out: bool,
             log_tail: str, measured: list[dict] | None = None) -> tuple[str, str]:
    """(status, reason) of a run attempt that ended; status 'retry' = an infrastructure crash. `rows`: the
    trainer's metrics; `measured`: the lines of the file holding the metric, when it is another (the
    evaluator's, for an `eval/...` metric)."""
    measured = rows if measured is None else measured
    last = int(rows[-1]["step"]) if rows else 0
    if stop and not (code == 0 and last >= req.steps):  # a stop that came after the last step changes nothing
        kind = stop.split(":", 1)[0]
        return {"prune": "pruned", "budget": "stopped", "cancel": "cancelled"}.get(kind, "stopped"), stop
    if timed_out:
        return "timeout", f"stopped at its timeout of {req.timeout_s:.0f} s (step {last} of {req.steps})"
    if code == 0 and last >= req.steps:
        if not any(req.metric in r for r in measured):
            seen = sorted({k for r in measured for k in r} - {"step", "time"})
            where = "the evaluator's results (tasks[].eval)" if measured is not rows else "the trainer's metrics"
            return "bad_config", f"metric {req.metric!r} is not in {where} (it has {', '.join(seen[:12]) or 'none'})"
        bad = next((r["step"] for r in rows if "train/loss" not in r), None)
        if bad is not None:  # the trainer's metrics drop non-finite values: a missing loss is a NaN/inf one
            return "diverged", f"the loss was not finite at step {bad}"
        return "completed", ""
    lines = log_tail.splitlines()
    error = next((ln for ln in reversed(lines) if ln.startswith("Error: ")), None)
    if code not in (0, None) and error and not rows:
        return "bad_config", f"jet up refused the config: {error[7:]}"
    fatal = next((ln for ln in reversed(lines) if ln.startswith("jet up: ") and FATAL in ln), None)
    if code not in (0, None) and fatal:  # a role stopped with an error restarting cannot fix (its config)
        return "bad_config", fatal[len("jet up: "):]
    if code == 0:
        return "retry", f"jet up ended at step {last} of {req.steps}"
    return "retry", f"jet up exited with code {code} at step {last} of {req.steps}"


def _tail(path: Path, n: int = 4000) -> str:
    if not path.is_file():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - n))
        return f.read().decode("utf-8", "replace")


def resumed_step(run_dir: Path) -> int:
    """The step the trainer of the latest attempt resumed from, read from its log (0: it started fresh)."""
    steps = [int(m.group(1)) for f in sorted(RunDir.at(run_dir).logs.glob("train-*.log"))
             for m in _RESUMED.finditer(f.read_text(errors="replace"))]
    return steps[-1] if steps else 0


def record(run_dir: Path, req: RunRequest, result: RunResult) -> None:
    """Keep a finished run's request and outcome in its folder (whole or not at all), before `tidy`
    deletes anything."""
    from jet.trainer.checkpoint import write_json

    if run_dir.is_dir():  # a run stopped before it ever started has no folder: nothing to tidy either
        write_json(run_dir / RESULT_FILE, {"request": req.meta(), "result": result.to_meta()})


def recorded(run_dir: Path, req: RunRequest) -> RunResult | None:
    """The outcome `record` kept for this very request (the same run, arm, seed, config and overrides),
    if any; a damaged file counts as none (the run runs again)."""
    try:
        kept = orjson.loads((run_dir / RESULT_FILE).read_bytes())
        result = RunResult.from_meta(kept["result"])
        same = kept["request"] == orjson.loads(orjson.dumps(req.meta()))
    except FileNotFoundError:
        return None
    except (OSError, orjson.JSONDecodeError, CodecError, KeyError, TypeError, ValueError, AttributeError) as e:
        log.warning("run %s: ignoring its damaged %s (%s)", req.run, RESULT_FILE, e)
        return None
    return result if same and result.run == req.run else None


def tidy(run_dir: Path, keep: str) -> int:
    """Delete what a finished run no longer needs; returns the bytes freed. `keep` (`worker.keep_files`):
    'all' deletes nothing; 'final_weights' deletes the trainers' checkpoints and every published weight
    version but each model's newest; 'metrics' deletes those and the newest too. Metrics, evaluations,
    logs, the config and the ledger stay: the study's report reads only those."""
    if keep == "all":
        return 0
    rd = RunDir.at(run_dir)
    doomed = [rd.trainer_files(m).checkpoints for m in rd.trained_models()]
    weights = rd.root / "weights"
    for model in sorted(p.name for p in weights.iterdir() if p.is_dir()) if weights.is_dir() else []:
        versions = rd.versions(model)
        doomed += [rd.weight_version(model, v) for v in (versions if keep == "metrics" else versions[:-1])]
    freed = 0
    for path in doomed:
        try:  # a file gone meanwhile (another tidy of the same run: `jet study tidy` beside its worker) is fine
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0
            shutil.rmtree(path)
        except FileNotFoundError:
            continue
        freed += size
    return freed


def tidy_finished(study_dir: Path, launched: dict[str, RunRequest], results: dict[str, RunResult],
                  keep: str | None = None) -> dict[str, int]:
    """`jet study tidy`: what a study worker does once a run finishes, for every finished run of a study
    (those that finished before their worker tidied, or to keep less now): keep its outcome in its folder
    (`record`, unless kept already), then `tidy` it by `keep` (default: the run's own `keep_files`). Runs
    without a result are not touched. Returns the bytes freed, by run."""
    freed = {}
    for run, result in sorted(results.items()):
        req = launched.get(run)
        run_dir = compose(req, study_dir).run_dir if req else None
        if run_dir is None or not run_dir.is_dir():  # stopped before it started: nothing was written
            continue
        if recorded(run_dir, req) is None:
            record(run_dir, req, result)
        freed[run] = tidy(run_dir, keep or req.keep_files)
    return freed


def run_env(req: RunRequest) -> dict[str, str]:
    """The run's environment: ours and the study's, minus the markers of our own supervisor (jet up's
    roles would take it for theirs and drain at once)."""
    from jet.supervisor import READY_ENV, SUPERVISOR_ENV

    env = {**os.environ, **req.env}
    for k in (SUPERVISOR_ENV, READY_ENV):
        env.pop(k, None)
    return env


def keeper_argv(req: RunRequest, files: RunFiles, url: str) -> list[str]:
    # --no-dash: runs of a study run side by side (a dashboard each would fight for one port); `jet dash`
    # shows them all from the study folder
    up = [*python_module("jet.cli"), "up", "--config", files.config, "--redis-url", url, "--no-live", "--no-dash"]
    up += [x for o in files.overrides for x in ("--set", o)]
    return [*python_module("jet.study.keeper"), "--redis-url", url, "--study", req.study, "--run", req.run,
            "--log", str(files.log), "--grace-s", str(req.stop_grace_s), "--", *up]


async def execute(req: RunRequest, r, url: str, keys, study_dir: Path, worker: str, deliveries: int,
                  draining: anyio.Event) -> Finished | Retry:
    """Run (or resume) one request to its outcome, then keep the outcome in the run's folder and tidy
    the folder (`record`, `tidy`); see the module docstring."""
    files = compose(req, study_dir)
    kept = await anyio.to_thread.run_sync(recorded, files.run_dir, req)
    if kept is not None:
        log.info("run %s finished here before (%s): committing its kept outcome", req.run, kept.status)
        outcome: Finished | Retry = Finished(kept)
    else:
        outcome = await _execute(req, r, url, keys, files, worker, deliveries, draining)
    if isinstance(outcome, Finished):
        await anyio.to_thread.run_sync(_settle_files, files.run_dir, req, outcome.result, kept is None)
    return outcome


def _settle_files(run_dir: Path, req: RunRequest, result: RunResult, new: bool) -> None:
    if new:
        record(run_dir, req, result)
    try:
        freed = tidy(run_dir, req.keep_files)
    except OSError as e:  # the outcome stands: a folder left untidy costs disk, not the result
        log.warning("run %s: could not tidy its folder (%s); its files stay", req.run, e)
        return
    if freed:
        log.info("run %s: deleted %.1f GB it no longer needs (worker.keep_files: %s)", req.run, freed / 1e9,
                 req.keep_files)


async def _execute(req: RunRequest, r, url: str, keys, files: RunFiles, worker: str, deliveries: int,
                   draining: anyio.Event) -> Finished | Retry:
    started = await ledger.first_start(r, url, keys, req.run)

    def result(status: str, reason: str, rows: list[dict], measured: list[dict] | None = None) -> Finished:
        curve = curve_of(rows if measured is None else measured, req.metric)
        final = {k: float(v) for k, v in (rows[-1] if rows else {}).items()
                 if isinstance(v, (int, float)) and k not in ("time",) and math.isfinite(v)}
        return Finished(RunResult(
            run=req.run, trial=req.trial, seed=req.seed, stage=req.stage, status=status, reason=reason, curve=curve,
            steps=int(rows[-1]["step"]) if rows else 0, duration_s=round(time.time() - started, 2),
            attempts=deliveries, resumed_from=resumed_step(files.run_dir), worker=worker, finished_at=time.time(),
            final=final))

    early = await ledger.stop_reason(r, url, keys, req.run)
    if early:  # stopped before it ever started here (pruned, cancelled): nothing to run
        return result(*classify(None, [], req, early, False, ""), [])
    cfg = await anyio.to_thread.run_sync(check, files)
    if isinstance(cfg, str):
        return result("bad_config", cfg, [])
    mpath, spath = metrics_path(cfg, req.model), source_path(cfg, req.model, req.metric)
    if time.time() - started >= req.timeout_s:
        rows, measured = read_metrics(mpath), read_metrics(spath)
        return result(*classify(None, rows, req, None, True, "", measured), rows, measured)

    files.log.parent.mkdir(parents=True, exist_ok=True)
    with open(files.log, "ab") as err:  # the keeper's own lines go there too
        proc = subprocess.Popen(keeper_argv(req, files, url), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err, env=run_env(req))
    stop, timed_out, drain, told, sent, source = None, False, False, False, {}, MetricsFile(spath)
    try:
        while proc.poll() is None:
            await _stream(r, url, keys, req, source, sent)
            if not told:  # a paused study (`jet study stop`) drains its runs like a stopping worker
                drain = draining.is_set() or bool(await ledger.get_field(r, url, keys, "paused"))
                if not drain:
                    stop = await ledger.stop_reason(r, url, keys, req.run)
                    timed_out = time.time() - started >= req.timeout_s
                if drain or stop or timed_out:
                    proc.send_signal(signal.SIGTERM)  # the keeper drains jet up: the trainer checkpoints
                    told = True
            with anyio.move_on_after(POLL_S):
                await (anyio.sleep(POLL_S) if told else draining.wait())
    finally:
        if proc.poll() is None:  # cancelled (the drain deadline): the keeper drains jet up by itself
            proc.send_signal(signal.SIGTERM)
    await _stream(r, url, keys, req, source, sent)
    measured = source.rows  # the metric's file as it ends, read as it grew
    rows = measured if spath == mpath else read_metrics(mpath)
    finished = proc.returncode == 0 and bool(rows) and int(rows[-1]["step"]) >= req.steps
    if (drain and not finished) or proc.returncode == EXIT_NO_LEASE:  # a run that finished meanwhile counts
        return Retry("the study worker is draining or the study is paused: the run resumes from its checkpoint "
                     "on the next attempt")
    status, reason = classify(proc.returncode, rows, req, stop, timed_out, _tail(files.log), measured)
    if status == "retry":
        crashes = await ledger.count_crash(r, url, keys, req.run)
        if crashes <= req.max_retries:
            return Retry(f"infrastructure crash {crashes} of at most {req.max_retries + 1}: {reason}")
        return result("crashed", f"{reason} ({crashes} crashes)", rows, measured)
    return result(status, reason, rows, measured)


async def _stream(r, url: str, keys, req: RunRequest, metrics: MetricsFile, sent: dict[int, float]) -> None:
    """Send the metric of each new trainer step as Progress (a resumed trainer's rewritten file is read
    again: a step whose value changed is sent again)."""
    items = []
    for row in metrics.refresh()[1]:
        if req.metric in row and "step" in row and sent.get(int(row["step"])) != row[req.metric]:
            sent[int(row["step"])] = row[req.metric]
            items.append(Progress(req.run, int(row["step"]), float(row[req.metric]), float(row.get("time", 0))))
    await ledger.add_progress(r, url, keys, items)
