"""The arms of a study: Optuna's ask/tell over the study's space, in durable storage that never pickles.

What it is: `Plan(study, folder)` opens (or creates) the Optuna study in
Optuna's file journal `<study folder>/optuna.jsonl` (JSON lines, fsynced per
append; the file backend has no pickled snapshots, unlike Optuna's Redis
journal backend). `ask(params=None)` adds one arm: forced params (hypothesis
arms, the next grid point, an LLM proposal) are enqueued and then asked, so
they are recorded exactly like sampled ones; otherwise the sampler proposes
(TPE or GP for numeric spaces, random; each seeded). `tell` records an arm's
paired-seed summary, or that it was pruned or failed.

Why the file journal: the runner is the only process that talks to Optuna
(study workers never do), so its state belongs in the study folder beside
decisions.jsonl; the run ledger that must survive any crash is in Redis.
A torn last line (a SIGKILL during an append) is cut off on open: that
append was never acknowledged.

Grids are planned by enqueueing every point in a fixed order (Optuna's
GridSampler would pick enqueued points again); a sampled arm equal to an
existing one is told PRUNED as a duplicate and asked again.

What it is not: the statistics (jet.stats) or the run ledger (jet.study.ledger).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jet.study.spec import Param, Study

log = logging.getLogger(__name__)

JOURNAL = "optuna.jsonl"
MAX_DUPLICATES = 20  # sampled duplicates in a row before the space counts as exhausted


@dataclass(frozen=True)
class Arm:
    number: int  # the Optuna trial number: the arm's id in run names (t<number>)
    params: dict[str, Any]
    state: str  # running | complete | pruned | failed | waiting


def repair_journal(path: Path) -> None:
    """Cut a torn last line (no newline) left by a process killed mid-append."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])
        log.warning("cut a torn last line from %s", path)


def distribution(p: Param):
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if p.categorical:
        return CategoricalDistribution(p.choices)
    if p.int_:
        return IntDistribution(int(p.low), int(p.high), log=p.log, step=int(p.step or 1))
    return FloatDistribution(p.low, p.high, log=p.log, step=p.step)


def _sampler(kind: str, seed: int):
    import optuna

    if kind == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=4)
    if kind == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=4)
    return optuna.samplers.RandomSampler(seed=seed)


class Plan:
    def __init__(self, study: Study, folder: Path, sampler: str | None = None):
        import optuna
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.study = study
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / JOURNAL
        repair_journal(path)
        kind = sampler or (study.planner.fallback if study.planner.kind == "llm" else study.planner.kind)
        self.kind = "grid" if study.planner.kind == "grid" else kind
        self.dists = self._distributions()
        self.optuna = optuna.create_study(
            study_name=study.name, storage=JournalStorage(JournalFileBackend(str(path))),
            sampler=_sampler(self.kind, study.planner.seed), load_if_exists=True,
            direction="maximize" if study.metric.mode == "max" else "minimize")

    def _distributions(self) -> dict[str, Any]:
        from optuna.distributions import CategoricalDistribution

        if self.study.arms is not None:  # explicit arms: each path is categorical over the values used
            out = {}
            for k in self.study.params:
                values = []
                for a in self.study.arms:
                    if a[k] not in values:
                        values.append(a[k])
                out[k] = CategoricalDistribution(values)
            return out
        return {k: distribution(p) for k, p in self.study.space.items()}

    # -- reading

    def arms(self) -> list[Arm]:
        """Every arm asked so far (duplicates left out), by number."""
        out = []
        for t in self.optuna.get_trials(deepcopy=False):
            if t.user_attrs.get("duplicate_of") is not None or t.state.name == "WAITING":
                continue
            state = {"RUNNING": "running", "COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed"}[t.state.name]
            out.append(Arm(t.number, dict(t.params), state))
        return out

    def waiting(self) -> list[dict[str, Any]]:
        """Params enqueued but not asked yet (a crash came between the two)."""
        return [dict(t.params) for t in self.optuna.get_trials(deepcopy=False) if t.state.name == "WAITING"]

    def next_grid_point(self, taken: list[dict[str, Any]]) -> dict[str, Any] | None:
        grid = self.study.grid() or []
        return next((g for g in grid if g not in taken), None)

    # -- asking and telling

    def ask(self, params: dict[str, Any] | None = None) -> Arm | None:
        """A new arm: `params` if given (forced), else the sampler's; None when the space is exhausted."""
        for _ in range(MAX_DUPLICATES):
            if params is not None and params not in self.waiting():
                self.optuna.enqueue_trial(params, skip_if_exists=False)
            trial = self.optuna.ask()
            values = {k: trial.suggest_categorical(k, d.choices) if hasattr(d, "choices") else
                      self._suggest(trial, k, d) for k, d in self.dists.items()}
            known = [a for a in self.arms() if a.number != trial.number and a.params == values]
            if not known:
                return Arm(trial.number, values, "running")
            trial.set_user_attr("duplicate_of", known[0].number)
            self.optuna.tell(trial, state=_state("pruned"))
            if params is not None:
                return None  # a forced arm that exists already
        return None

    @staticmethod
    def _suggest(trial, name: str, d) -> Any:
        if type(d).__name__ == "IntDistribution":
            return trial.suggest_int(name, d.low, d.high, step=d.step, log=d.log)
        return trial.suggest_float(name, d.low, d.high, step=d.step, log=d.log)

    def tell(self, number: int, state: str, value: float | None = None) -> None:
        """Record an arm's end: 'complete' with its value, 'pruned' or 'failed' (why goes to decisions.jsonl)."""
        trial = next(t for t in self.optuna.get_trials(deepcopy=False) if t.number == number)
        if trial.state.name != "RUNNING":
            return  # told before a crash of the runner: telling is idempotent
        if state == "complete":
            self.optuna.tell(number, value)
        else:
            self.optuna.tell(number, state=_state(state))


def _state(name: str):
    from optuna.trial import TrialState

    return {"pruned": TrialState.PRUNED, "failed": TrialState.FAIL, "complete": TrialState.COMPLETE}[name]
