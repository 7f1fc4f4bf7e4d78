"""The study file: what a study asks, over which space, with which seeds, budget, planner and pruner.

A study file is YAML, validated on load like a run config (its sections are
`jet.configlib.Section`s: pydantic v2, unknown keys refused, no silent
coercion), with errors that name the path
(`budget.max_runs: expected int, got 'x'`) and `--set` overrides
(`--set budget.max_runs=8`); reading the file is `jet.study.studyfile`.

What it is not: a check of the base Jet config. Whether every arm's config
loads is checked by the runner (`jet.study.runner.check_arms`), which names
the arm and the key.

Invariants: hypotheses are stated before any run and name arms of the space
(a `best` treatment is chosen on screening seeds and judged only on
confirmation seeds); every arm runs the same seed list (paired comparisons);
`run` and `runs_dir` belong to the study workers and cannot be set.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from jet.configlib import Section, problem
from jet.study.messages import KEEP_FILES

__all__ = ["Study", "Param", "Metric", "Hypothesis", "Budget", "Planner", "Pruner", "Confirm", "arm_label",
           "RESERVED"]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
RESERVED = ("run", "runs_dir")  # set by the study worker for each run
TEMPLATE_FIELDS = ("seed", "run", "run_dir", "study_dir")


class _Strict(Section):
    """A study file section: Jet's config sections' rules (frozen, unknown keys refused, strict types)."""


class Param(_Strict):
    """One dimension of the space: `choices`, or a range `low`..`high` (`log`, `step`; ints if both are ints)."""

    choices: list[Any] | None = None  # categorical values (any YAML scalars)
    low: float | None = None  # lower end of a range (inclusive)
    high: float | None = None  # upper end of a range (inclusive)
    log: bool = False  # sample the range on a log scale
    step: float | None = None  # grid step of the range (ints: default 1)
    int_: bool = Field(False, alias="int")  # integer range (implied when low and high are written as ints)

    @model_validator(mode="before")
    @classmethod
    def _ints(cls, data: Any) -> Any:
        if isinstance(data, dict) and "int" not in data and "low" in data and "high" in data:
            if all(isinstance(data[k], int) and not isinstance(data[k], bool) for k in ("low", "high")):
                data = {**data, "int": True}
        return data

    @model_validator(mode="after")
    def _shape(self) -> "Param":
        ranged = self.low is not None or self.high is not None
        if (self.choices is None) == (not ranged):
            raise ValueError("give either choices: [...] or low: and high:")
        if self.choices is not None:
            if not self.choices:
                raise ValueError("choices: must not be empty")
            if any(isinstance(c, (dict, list)) for c in self.choices):
                raise ValueError("choices: must be scalars")
            if self.log or self.step is not None:
                raise ValueError("log and step apply to ranges, not choices")
            return self
        if self.low is None or self.high is None:
            raise ValueError("a range needs both low: and high:")
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"a log range needs low > 0, got {self.low}")
        if self.step is not None and self.step <= 0:
            raise ValueError(f"step must be > 0, got {self.step}")
        return self

    @property
    def categorical(self) -> bool:
        return self.choices is not None

    def contains(self, value: Any) -> bool:
        """Whether `value` is a point of this dimension (type included: True is not 1)."""
        if self.choices is not None:
            return any(value == c and type(value) is type(c) for c in self.choices)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.int_ and not (isinstance(value, int) or float(value).is_integer()):
            return False
        return self.low - 1e-12 <= value <= self.high + 1e-12 and math.isfinite(value)

    def grid(self) -> list[Any] | None:
        """Every point, when the dimension is finite (choices, or a range with a step / of ints)."""
        if self.choices is not None:
            return list(self.choices)
        step = self.step or (1 if self.int_ else None)
        if step is None or self.log:
            return None
        n = int(math.floor((self.high - self.low) / step + 1e-9)) + 1
        points = [self.low + i * step for i in range(n)]
        return [int(round(p)) for p in points] if self.int_ else points


class Metric(_Strict):
    # Metric compared across arms: a name of the trainer's metrics.jsonl (e.g. rollout/reward_mean), or an
    # evaluator's held-out result (eval/<task>/reward_mean: tasks[].eval, one point per evaluated version).
    name: str = "rollout/reward_mean"
    # Trained model whose metrics count; None = the config's first trainable model.
    model: str | None = None
    # 'max' if larger is better, 'min' if smaller is.
    mode: Literal["max", "min"] = "max"
    # How a run's curve becomes one number: mean of the last `window` steps, area under the curve
    # (the mean over all steps), or the best moving average of `window` steps.
    summary: Literal["final", "auc", "best"] = "final"
    # Steps averaged by 'final' and 'best' (steps).
    window: int = Field(5, gt=0)
    # A finished run whose summary ends up below this value (above it with mode 'min') is recorded as
    # 'collapsed' (still a result); None = never.
    collapse_below: float | None = None


class Hypothesis(_Strict):
    # Short name, used in the report and results.
    name: str
    # The claim in words, as stated before any run.
    statement: str
    # The arm expected to win: an assignment of every space parameter, or 'best' (the leading arm of the
    # screening stage, judged on confirmation seeds only).
    treatment: dict[str, Any] | Literal["best"]
    # The arm it is compared with: an assignment of every space parameter.
    control: dict[str, Any]
    # 'better': the treatment beats the control (by more than `margin`); 'no_worse': it loses less than
    # `margin` (non-inferiority).
    claim: Literal["better", "no_worse"] = "better"
    # In metric units: the smallest effect that counts ('better'), or the largest loss tolerated ('no_worse').
    margin: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _margin(self) -> "Hypothesis":
        if self.claim == "no_worse" and self.margin <= 0:
            raise ValueError("claim 'no_worse' needs margin > 0 (the largest loss that still counts as no worse)")
        return self


class Budget(_Strict):
    # Runs (arm x seed) launched at most, confirmation included (runs).
    max_runs: int = Field(100, gt=0)
    # Runs in flight at once; more study workers than this stay idle (runs).
    max_concurrent_runs: int = Field(2, gt=0)
    # Wall-clock limit of the whole study, from its first start, resumes included (hours).
    max_wall_hours: float = Field(24.0, gt=0)
    # Wall-clock limit of one run from its first start; past it the run is stopped, recorded 'timeout' (s).
    run_timeout_s: float = Field(3600.0, gt=0)
    # Tokens (prompt + completion) the LLM planner may spend; 0 = never call it (tokens).
    max_planner_tokens: int = Field(0, ge=0)
    # Infrastructure crashes of one run retried before it is recorded 'crashed' (retries).
    max_retries: int = Field(2, ge=0)


class LLM(_Strict):
    # Model name sent to the endpoint.
    model: str = "gpt-4o-mini"
    # Environment variables holding the OpenAI-compatible base URL and API key (never the file).
    base_url_env: str = "JET_STUDY_LLM_BASE_URL"
    api_key_env: str = "JET_STUDY_LLM_API_KEY"
    # Completion tokens asked per call (tokens).
    max_tokens: int = Field(512, gt=0)
    # Arms asked for per call (arms).
    arms_per_call: int = Field(2, gt=0)
    # Wait for one answer (s).
    timeout_s: float = Field(60.0, gt=0)


class Planner(_Strict):
    # 'grid' (every point of a finite space, for ablations), 'tpe' / 'gp' (Optuna's Bayesian samplers for
    # numeric spaces), 'random', or 'llm' (an OpenAI-compatible model proposes arms; `fallback` otherwise).
    kind: Literal["grid", "tpe", "gp", "random", "llm"] = "grid"
    # Arms of the screening stage; None = the whole grid (required for non-grid planners) (arms).
    trials: int | None = Field(None, gt=0)
    # Seed of the sampler, so a study's sequence of arms is reproducible.
    seed: int = 0
    # Sampler used when the LLM planner's proposal is refused or its budget is spent.
    fallback: Literal["tpe", "gp", "random", "grid"] = "tpe"
    llm: LLM = LLM()


class Pruner(_Strict):
    # 'halving': successive halving over the paired-seed summary at each rung; 'none'.
    kind: Literal["none", "halving"] = "none"
    # Trainer steps at which arms are compared (steps).
    rungs: list[int] = []
    # At a rung, arms outside the best 1/eta are candidates for pruning (dimensionless, > 1).
    eta: float = Field(2.0, gt=1)
    # Seeds an arm shares with the leader at a rung before it can be pruned (seeds).
    min_seeds: int = Field(2, gt=0)
    # Pruned only if behind the leader by more than this on every shared seed (metric units).
    min_gap: float = Field(0.0, ge=0)

    @field_validator("rungs")
    @classmethod
    def _rungs(cls, v: list[int]) -> list[int]:
        if any(r <= 0 for r in v) or v != sorted(set(v)):
            raise ValueError("rungs must be increasing positive trainer steps")
        return v


class Confirm(_Strict):
    # Confirmation rounds run when a verdict is inconclusive and budget is left; 0 = none (rounds).
    max_rounds: int = Field(2, ge=0)
    # New seeds per round; None = as many as the screening seeds (seeds).
    seeds: int | None = Field(None, gt=0)
    # Leading arms rerun for a 'best' hypothesis (arms).
    top: int = Field(1, gt=0)


class Worker(_Strict):
    # Lease of a study worker on its run; a SIGKILLed worker's run is reclaimed after it (s).
    lease_s: float = Field(60.0, gt=0)
    # Environment of each run's processes (one thread each keeps concurrent runs from fighting).
    env: dict[str, str] = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    # How long a stopped run may take to drain (checkpoint) before it is killed (s).
    stop_grace_s: float = Field(120.0, gt=0)
    # What a finished run's folder keeps: 'final_weights' (metrics, evaluations, logs and each model's
    # newest published weights; checkpoints and older versions are deleted), 'metrics' (no weights
    # either) or 'all' (nothing deleted). The report reads only metrics and evaluations.
    keep_files: Literal[KEEP_FILES] = "final_weights"


class Study(_Strict):
    # Study name: Redis namespace jet:{study.<name>}: and folder <studies_dir>/<name>.
    name: str
    # The question, in words, for the report and the LLM planner.
    question: str
    # Base Jet config every run starts from (relative to the study file).
    base: str
    # Overrides of every run (KEY=VALUE); values may use {seed}, {run}, {run_dir} and {study_dir}.
    set: list[str] = []
    # Overrides that carry the seed into a run.
    seed_set: list[str] = ["trainer.seed={seed}"]
    # The search space: config path -> Param. Empty when `arms` lists the arms.
    space: dict[str, Param] = {}
    # Explicit arms (config path -> value, all with the same paths) instead of a product space.
    arms: list[dict[str, Any]] | None = None
    # Seeds every arm runs in screening (paired across arms).
    seeds: list[int]
    metric: Metric = Metric()
    hypotheses: list[Hypothesis] = []
    # Family-wise error rate of the verdicts (Holm-corrected over hypotheses).
    alpha: float = Field(0.05, gt=0, lt=1)
    # Confidence level of the bootstrap intervals.
    confidence: float = Field(0.95, gt=0, lt=1)
    budget: Budget = Budget()
    planner: Planner = Planner()
    pruner: Pruner = Pruner()
    confirm: Confirm = Confirm()
    worker: Worker = Worker()
    # Folder of the study folders (relative to the current directory).
    studies_dir: str = "studies"

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"study name {v!r} must match [A-Za-z0-9_.-]+")
        return v

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: list[int]) -> list[int]:
        if not v or len(set(v)) != len(v) or min(v) < 0:
            raise ValueError("seeds must be a non-empty list of distinct non-negative integers")
        return v

    @field_validator("set", "seed_set")
    @classmethod
    def _sets(cls, v: list[str]) -> list[str]:
        for text in v:
            key, sep, _ = text.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"{text!r}: expected KEY=VALUE")
            if key.strip() in RESERVED:
                raise ValueError(f"{key.strip()!r} is set by the study worker for each run")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "Study":
        if self.arms is not None:
            if self.space:
                raise problem("arms", "give either space: or arms:, not both")
            if not self.arms or len({tuple(sorted(a)) for a in self.arms}) != 1 or not self.arms[0]:
                raise problem("arms", "every arm must set the same (non-empty) config paths")
        elif not self.space:
            raise problem("space", "space: or arms: is required")
        if self.planner.kind == "grid" and self.arms is None and any(p.grid() is None for p in self.space.values()):
            raise problem("planner.kind", "'grid' needs a finite space (choices, or ranges with a step)")
        if self.planner.kind != "grid" and self.arms is not None:
            raise problem("planner.kind", "explicit arms: are run by planner 'grid'")
        if self.planner.kind != "grid" and self.planner.trials is None:
            raise problem("planner.trials", f"planner '{self.planner.kind}' needs planner.trials (arms to screen)")
        for i, h in enumerate(self.hypotheses):
            for side in ("treatment", "control"):
                value = getattr(h, side)
                if value != "best":
                    self._check_arm(value, f"hypotheses[{i}].{side}")
        names = [h.name for h in self.hypotheses]
        if len(set(names)) != len(names):
            raise problem("hypotheses", "names must be unique")
        return self

    def _check_arm(self, params: dict[str, Any], where: str) -> None:
        keys = self.params
        if set(params) != set(keys):
            raise problem(where, f"must set exactly {', '.join(keys)} (got {', '.join(params) or 'nothing'})")
        if self.arms is not None:
            if params not in self.arms:
                raise problem(where, f"{params} is not one of the arms")
            return
        for k, v in params.items():
            if not self.space[k].contains(v):
                raise problem(f"{where}.{k}", f"{v!r} is outside the space")

    @property
    def params(self) -> list[str]:
        """The config paths an arm assigns."""
        return list(self.arms[0]) if self.arms is not None else list(self.space)

    def grid(self) -> list[dict[str, Any]] | None:
        """Every arm of a finite space, in a fixed order (None for continuous spaces)."""
        if self.arms is not None:
            return [dict(a) for a in self.arms]
        axes = [p.grid() for p in self.space.values()]
        if any(a is None for a in axes):
            return None
        return [dict(zip(self.space, combo)) for combo in itertools.product(*axes)]

    def contains(self, params: dict[str, Any]) -> bool:
        try:
            self._check_arm(params, "arm")
        except ValueError:
            return False
        return True

    def confirm_seeds(self) -> int:
        return self.confirm.seeds or len(self.seeds)

    def folder(self) -> Path:
        return Path(self.studies_dir) / self.name


def arm_label(params: dict[str, Any]) -> str:
    """`{"trainer.objective": "ppo", "trainer.lr": 0.001}` -> `objective=ppo lr=0.001` (last path part)."""
    def show(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    return " ".join(f"{k.rsplit('.', 1)[-1]}={show(v)}" for k, v in params.items())
