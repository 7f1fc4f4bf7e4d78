"""The messages on a study's own streams: run requests, run results, per-step progress.

Each is a frozen dataclass with a kind, encoded with `jet.queues.codec`
(schema version, orjson metadata, no pickle) by `to_fields()` and decoded by
`from_payload()`, which validates and raises `CodecError` only. They live
here, not in `jet.wire`, because they never cross a run's streams: only the
study's (`Keys.for_study(name).study_*`).

- `RunRequest`: one run (arm x seed) as the runner asks for it. It is
  self-contained: a study worker needs nothing else (no study file) to run it.
  Its message id is the run name, so a request is launched at most once.
- `RunResult`: how a run ended (`status`), with its metric curve; its message
  id is the run name too, so it lands exactly once (added with the request's ack).
- `Progress`: one trainer step's metric value of a running run.

Statuses: completed | diverged | collapsed (results that count) and pruned |
stopped | timeout | crashed | bad_config | cancelled (runs that do not count
towards a verdict; pruned, stopped and timeout keep their partial curves).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from jet.errors import CodecError
from jet.queues import codec

REQUEST, RESULT, PROGRESS = "study_run", "study_result", "study_step"
COUNTED = ("completed", "diverged", "collapsed")  # statuses whose summary enters the statistics
STATUSES = COUNTED + ("pruned", "stopped", "timeout", "crashed", "bad_config", "cancelled")


def _get(meta: dict, key: str, typ: type | tuple[type, ...], kind: str) -> Any:
    value = meta.get(key)
    if not isinstance(value, typ) or (isinstance(value, bool) and typ in (int, float, (int, float))):
        raise CodecError(f"{kind}: field {key!r} must be {getattr(typ, '__name__', typ)}, got {value!r}")
    return value


KEEP_FILES = ("final_weights", "metrics", "all")  # `worker.keep_files` of a study file


def _keep(value: Any) -> str:
    if value not in KEEP_FILES:
        raise CodecError(f"{REQUEST}: field 'keep_files' must be one of {', '.join(KEEP_FILES)}, got {value!r}")
    return value


def _kind(p: codec.Payload, kind: str) -> None:
    if p.kind != kind:
        raise CodecError(f"expected a {kind!r} entry, got {p.kind!r}")


@dataclass(frozen=True, slots=True)
class RunRequest:
    study: str
    run: str  # run name: the Jet run namespace and folder; the message id
    trial: int  # the arm (Optuna trial number)
    seed: int
    stage: int  # 0 = screening, k = confirmation round k
    params: dict[str, Any]  # the arm's assignment, for the results table
    base: str  # absolute path of the base Jet config
    overrides: list[str]  # KEY=VALUE, may hold {seed} {run} {run_dir} {study_dir}
    metric: str  # metrics.jsonl name streamed back as progress
    model: str | None  # trained model whose metrics count (None: the first trainable)
    steps: int  # trainer.steps of the run: reaching it = finished
    timeout_s: float
    max_retries: int
    stop_grace_s: float
    env: dict[str, str] = field(default_factory=dict)
    keep_files: str = "final_weights"  # what the run's folder keeps once it finished (`worker.keep_files`)

    def to_fields(self) -> dict[bytes, bytes]:
        meta = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return codec.encode(REQUEST, meta, msg_id=self.run)

    @classmethod
    def from_payload(cls, p: codec.Payload) -> "RunRequest":
        _kind(p, REQUEST)
        m, k = p.meta, REQUEST
        return cls(study=_get(m, "study", str, k), run=_get(m, "run", str, k), trial=_get(m, "trial", int, k),
                   seed=_get(m, "seed", int, k), stage=_get(m, "stage", int, k), params=_get(m, "params", dict, k),
                   base=_get(m, "base", str, k), overrides=_get(m, "overrides", list, k),
                   metric=_get(m, "metric", str, k), model=m.get("model") if isinstance(m.get("model"), str) else None,
                   steps=_get(m, "steps", int, k), timeout_s=float(_get(m, "timeout_s", (int, float), k)),
                   max_retries=_get(m, "max_retries", int, k),
                   stop_grace_s=float(_get(m, "stop_grace_s", (int, float), k)), env=_get(m, "env", dict, k),
                   keep_files=_keep(m.get("keep_files", "final_weights")))

    def meta(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True, slots=True)
class RunResult:
    run: str
    trial: int
    seed: int
    stage: int
    status: str
    reason: str = ""  # why it ended so (empty when completed)
    curve: list[tuple[int, float]] = field(default_factory=list)  # (trainer step, metric value)
    steps: int = 0  # last trainer step reached
    duration_s: float = 0.0  # wall time of the run from its first start
    attempts: int = 1  # deliveries of its request (a reclaimed or retried run has more)
    resumed_from: int = 0  # trainer step the last attempt resumed from (0: started fresh)
    worker: str = ""  # consumer name of the study worker that finished it
    finished_at: float = 0.0  # unix time
    final: dict[str, float] = field(default_factory=dict)  # every metric of the last step

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise CodecError(f"{RESULT}: unknown status {self.status!r}")

    @property
    def counted(self) -> bool:
        return self.status in COUNTED

    def to_fields(self) -> dict[bytes, bytes]:
        meta = {k: getattr(self, k) for k in self.__dataclass_fields__}
        meta["curve"] = [[int(s), float(v)] for s, v in self.curve]
        return codec.encode(RESULT, meta, msg_id=self.run)

    def to_meta(self) -> dict[str, Any]:
        """Its fields as JSON values, as its entry carries them (the run folder's copy: `jet.study.execution`)."""
        return orjson.loads(self.to_fields()[b"m"])

    @classmethod
    def from_meta(cls, meta: Any) -> RunResult:
        """The result `to_meta` gave; CodecError names what is wrong with a damaged one."""
        if not isinstance(meta, dict):
            raise CodecError(f"{RESULT}: not a JSON object")
        return cls.from_payload(codec.Payload(kind=RESULT, msg_id=str(meta.get("run")), meta=meta))

    @classmethod
    def from_payload(cls, p: codec.Payload) -> "RunResult":
        _kind(p, RESULT)
        m, k = p.meta, RESULT
        curve = _get(m, "curve", list, k)
        try:
            points = [(int(s), float(v)) for s, v in curve]
        except (TypeError, ValueError):
            raise CodecError(f"{RESULT}: field 'curve' must be [[step, value], ...]") from None
        return cls(run=_get(m, "run", str, k), trial=_get(m, "trial", int, k), seed=_get(m, "seed", int, k),
                   stage=_get(m, "stage", int, k), status=_get(m, "status", str, k), reason=m.get("reason") or "",
                   curve=points, steps=_get(m, "steps", int, k), duration_s=float(m.get("duration_s") or 0.0),
                   attempts=int(m.get("attempts") or 1), resumed_from=int(m.get("resumed_from") or 0),
                   worker=m.get("worker") or "", finished_at=float(m.get("finished_at") or 0.0),
                   final={str(a): float(b) for a, b in (m.get("final") or {}).items()})


@dataclass(frozen=True, slots=True)
class Progress:
    run: str
    step: int
    value: float
    time: float

    def to_fields(self) -> dict[bytes, bytes]:
        return codec.encode(PROGRESS, {"run": self.run, "step": self.step, "value": self.value, "time": self.time})

    @classmethod
    def from_payload(cls, p: codec.Payload) -> "Progress":
        _kind(p, PROGRESS)
        m = p.meta
        return cls(_get(m, "run", str, PROGRESS), _get(m, "step", int, PROGRESS),
                   float(_get(m, "value", (int, float), PROGRESS)), float(_get(m, "time", (int, float), PROGRESS)))
