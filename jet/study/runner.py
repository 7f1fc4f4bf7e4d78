"""The study runner (`jet study run`): plans arms, launches runs, prunes, judges, confirms, reports.

It reads top to bottom like a trainer loop: set-up (lease, spec, state rebuilt
from durable storage), then one iteration per second:
1. read new results and progress from the study's streams;
2. record failed arms (bad config) and cancel their other runs; prune arms
   clearly behind at a rung (jet.study.prune) and stop their runs;
3. tell Optuna about arms whose screening runs are all settled;
4. launch runs into free slots (at most `max_concurrent_runs` in flight),
   refusing, with the reason logged, anything past the budget;
5. when a stage is settled: judge the hypotheses (jet.study.analysis); an
   inconclusive one with budget left starts a confirmation stage (the
   leading arms on new seeds), otherwise the study ends;
and the report (jet.study.report) is rewritten as it goes.

Nothing is lost or run twice, across SIGKILLs of anything:
- every arm is an Optuna trial in the study folder's journal: a resumed
  runner reads the arms back and never asks one twice (an enqueued but
  unasked arm is asked, not enqueued again);
- every run is launched through the ledger (HSETNX + XADD in one Lua call,
  `jet.study.ledger.launch`) under a deterministic name (<study>-t<arm>-s<seed>),
  so launching again is a no-op; results, progress, stop requests, pruned
  and failed arms and the stage plans are in Redis (AOF), so the runner's
  state is rebuilt, not remembered;
- one runner per study at a time (an expiring lease); a SIGKILLed runner's
  lease expires and `jet study resume` takes over; its local workers drain
  (they watch it) and their runs resume from checkpoints.

Decisions (every ask, prune, failure, refusal, stage change, planner
rationale) go to decisions.jsonl, each once (keyed), with their time.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import anyio
import orjson

from jet.study import analysis, ledger
from jet.study.messages import RunRequest
from jet.study.plan import Arm
from jet.study.spec import Study
from jet.study.state import StudyState, run_name

log = logging.getLogger(__name__)

TICK_S = 1.0
REPORT_EVERY_S = 30.0
LOCKED = ("base", "set", "seed_set", "space", "arms", "seeds", "metric", "hypotheses")  # fixed once started




def check_arm(study: Study, params: dict) -> tuple[str | None, int, str | None]:
    """(error, trainer.steps, model) of an arm's config, checked without touching the disk's paths."""
    from jet.config import load_file
    from jet.errors import ConfigError
    from jet.study.execution import fill
    from jet.study.messages import RunRequest as R

    probe = R(study.name, "probe", 0, study.seeds[0], 0, params, study.base, [], "", None, 1, 1.0, 0, 1.0)
    where = Path("/nonexistent-study-dir")
    overrides = [fill(o, probe, where / "runs" / "probe", where) for o in overrides_of(study, params)]
    try:
        cfg = load_file(study.base, overrides)
    except ConfigError as e:
        return str(e), 0, None
    trained = [m.name for m in cfg.models if m.trainable]
    model = study.metric.model or (trained[0] if trained else None)
    if model not in trained:
        return f"metric.model: {model!r} is not a trainable model of the config", 0, None
    return None, cfg.trainer_of(model).steps, model


def overrides_of(study: Study, params: dict) -> list[str]:
    return list(study.set) + list(study.seed_set) + [f"{k}={json.dumps(v)}" for k, v in params.items()]


class Runner(StudyState):
    def __init__(self, study: Study, url: str, folder: Path, llm=None):
        super().__init__(study, url, folder)
        self.llm = llm
        self._checked: dict[int, tuple[str | None, int, str | None]] = {}
        self._exhausted = False

    # -- set-up

    async def open(self, lease_wait_s: float = 30.0) -> None:
        from jet.errors import ConfigError
        from jet.queues.connect import connect

        self.r = await connect(self.url)
        self.lease = ledger.Lease(self.r, self.url, self.keys.study_runner, 10.0)
        deadline = time.monotonic() + lease_wait_s
        while not await self.lease.take():
            if time.monotonic() > deadline:
                raise ConfigError(f"another runner holds study {self.study.name!r} (lease {self.keys.study_runner})")
            await anyio.sleep(0.5)
        spec = self.study.model_dump(mode="json", by_alias=True)
        fixed = orjson.dumps({k: spec[k] for k in LOCKED}, option=orjson.OPT_SORT_KEYS).decode()
        first = await ledger.set_field(self.r, self.url, self.keys, "locked", fixed, only_new=True)
        if first != fixed:
            old = orjson.loads(first)
            changed = [k for k in LOCKED if old.get(k) != spec[k]]
            raise ConfigError(f"study {self.study.name!r} started with another {', '.join(changed)}; "
                              "resume it with its own study file, or give the new one another name")
        await ledger.set_field(self.r, self.url, self.keys, "spec", orjson.dumps(spec).decode())
        await ledger.del_field(self.r, self.url, self.keys, "paused")
        self.started = await ledger.first_start(self.r, self.url, self.keys, "study")
        error, _, _ = check_arm(self.study, {})  # the base config with the study's own overrides
        if error:
            raise ConfigError(f"base config: {error}")
        await self.refresh()
        self.arms = {a.number: a for a in self.plan.arms()}
        for params in self.plan.waiting():  # enqueued before a crash, never asked
            self._asked(self.plan.ask(params), "resumed")
        if self.study.planner.kind == "grid":
            for params in self.forced() + (self.study.grid() or []):
                if params not in [a.params for a in self.arms.values()]:
                    self._asked(self.plan.ask(params), "grid")

    def _asked(self, arm: Arm | None, how: str, rationale: str = "") -> Arm | None:
        if arm is None:
            return None
        self.arms[arm.number] = arm
        self.decisions.log(f"ask:{arm.number}", "ask", arm=arm.number, params=arm.params, how=how,
                           rationale=rationale, why=f"arm {arm.number} ({how}): {arm.params}")
        return arm

    async def mark(self, name: str, value) -> bool:
        text = value if isinstance(value, str) else orjson.dumps(value).decode()
        fresh = (await ledger.set_field(self.r, self.url, self.keys, name, text, only_new=True)) == text
        self.marks[name] = self.marks.get(name, text)
        return fresh

    # -- one iteration

    async def step(self) -> str | None:
        """One pass of the loop; returns why the study ended, or None."""
        await self.refresh()
        await self.lease.renew()
        if await ledger.get_field(self.r, self.url, self.keys, "paused"):
            return "paused: jet study stop"
        await self.failures()
        await self.prune()
        self.tell()
        over = self.wall_over()
        if over:
            for run in self.in_flight():
                await ledger.request_stop(self.r, self.url, self.keys, run, f"budget: {over}")
            await self.refuse(over)
            return over if not self.in_flight() or time.time() - self.started > self._wall() + 600 else None
        await self.launch()
        if not self.in_flight() and not self.pending():
            return await self.next_stage()
        return None

    def _wall(self) -> float:
        return self.study.budget.max_wall_hours * 3600

    def wall_over(self) -> str | None:
        used = time.time() - self.started
        if used >= self._wall():
            return f"max_wall_hours: {used / 3600:.2f} h of {self.study.budget.max_wall_hours} h used"
        return None

    async def refuse(self, why: str) -> None:
        kind = why.split(":", 1)[0]
        if await self.mark(f"refused:{kind}", why):
            self.decisions.log(f"refuse:{kind}", "refuse", why=f"refused to launch more runs: {why}")

    async def failures(self) -> None:
        """An arm with a bad config fails, with the reason; its other runs are cancelled."""
        for res in self.results.values():
            if res.status == "bad_config" and not self.gone(res.trial):
                await self.fail_arm(res.trial, res.reason)

    async def fail_arm(self, arm: int, reason: str) -> None:
        await self.mark(f"failed:{arm}", reason)
        self.decisions.log(f"fail:{arm}", "arm_failed", arm=arm, why=f"arm {arm} failed: {reason}")
        for run, req in self.launched.items():
            if req.trial == arm and run not in self.results:
                await ledger.request_stop(self.r, self.url, self.keys, run, f"cancel: arm {arm} failed: {reason}")

    async def prune(self) -> None:
        from jet.study.prune import Rule, decide

        p, m = self.study.pruner, self.study.metric
        if p.kind != "halving" or self.stage() > 0:
            return
        curves: dict[int, dict[int, list]] = {}
        for run, req in self.launched.items():
            if req.stage == 0:
                curves.setdefault(req.trial, {})[req.seed] = self.curve(run)
        open_arms = {a for a in self.arms if not self.gone(a) and not self.settled(a)}
        protected = {n for n, a in self.arms.items() if a.params in self.forced()}
        rule = Rule(p.rungs, p.eta, p.min_seeds, p.min_gap, m.summary, m.window, m.mode)
        pruned = {a for a in self.arms if f"pruned:{a}" in self.marks}
        for d in decide(curves, open_arms, protected, pruned, rule):
            await self.mark(f"pruned:{d.arm}", d.reason)
            self.decisions.log(f"prune:{d.arm}", "prune", arm=d.arm, rung=d.rung, value=d.value, leader=d.leader,
                               leader_value=d.leader_value, why=f"pruned arm {d.arm}: {d.reason}")
            for run, req in self.launched.items():
                if req.trial == d.arm and run not in self.results:
                    await ledger.request_stop(self.r, self.url, self.keys, run, f"prune: {d.reason}")

    def tell(self) -> None:
        """Optuna learns each screening arm's end: its mean summary, or pruned / failed."""
        sums = analysis.summaries(self.study, list(self.arms.values()), list(self.results.values()))
        for n, arm in list(self.arms.items()):
            if arm.state != "running":
                continue
            state, value = None, None
            if f"failed:{n}" in self.marks:
                state = "failed"
            elif f"pruned:{n}" in self.marks and not any(self.launched[r].trial == n for r in self.in_flight()):
                state = "pruned"
            elif self.settled(n):
                value = sums[n].mean(0)
                state = "complete" if value is not None else "failed"
            if state:
                self.plan.tell(n, state, value)
                self.arms[n] = Arm(n, arm.params, state)

    # -- launching

    def candidate(self, k: int) -> tuple[int, int, int] | None:
        """The next run of stage `k` to launch: (arm, seed, runs of its pair group not launched yet)."""
        plan = self.stage_plan(k)
        arms = [a for a in plan["arms"] if a in self.arms and not self.gone(a)]
        todo = lambda a, s: run_name(self.study.name, a, s) not in self.launched  # noqa: E731
        if k == 0 and self.study.planner.kind != "grid":  # sequential planners: one arm's seeds after another
            for a in arms:
                for s in plan["seeds"]:
                    if todo(a, s):
                        return a, s, 1
            return None
        for s in plan["seeds"]:  # seed-major: every arm gets a seed before the next seed (pairs first)
            group = [a for a in arms if todo(a, s)]
            if group:
                return group[0], s, len(group)
        return None

    def want_arm(self) -> bool:
        if self.stage() > 0 or self.study.planner.kind == "grid":
            return False
        asked = len(self.arms)
        return asked < max(self.study.planner.trials or 0, len(self.forced())) and not self._exhausted

    def pending(self) -> bool:
        c = self.candidate(self.stage())
        if c is None:
            return self.want_arm() and self.runs_left() > 0
        return self.runs_left() >= c[2]

    async def launch(self) -> None:
        k = self.stage()
        while len(self.in_flight()) < self.study.budget.max_concurrent_runs:
            c = self.candidate(k)
            if c is None:
                if self.want_arm() and self.runs_left() > 0 and await self.ask():
                    continue
                return
            arm, seed, group = c
            if self.runs_left() < group:
                await self.refuse(f"max_runs: {len(self.launched)} of {self.study.budget.max_runs} runs launched; "
                                  f"the next needs {group}")
                return
            if arm not in self._checked:
                self._checked[arm] = check_arm(self.study, self.arms[arm].params)
            error, steps, model = self._checked[arm]
            if error:
                await self.fail_arm(arm, f"bad config: {error}")
                continue
            req = self.request(self.arms[arm], seed, k, steps, model)
            await ledger.launch(self.r, self.url, self.keys, req)
            self.launched[req.run] = req

    def request(self, arm: Arm, seed: int, stage: int, steps: int, model: str | None) -> RunRequest:
        s, b = self.study, self.study.budget
        return RunRequest(study=s.name, run=run_name(s.name, arm.number, seed), trial=arm.number, seed=seed,
                          stage=stage, params=arm.params, base=s.base, overrides=overrides_of(s, arm.params),
                          metric=s.metric.name, model=model, steps=steps, timeout_s=b.run_timeout_s,
                          max_retries=b.max_retries, stop_grace_s=s.worker.stop_grace_s, env=dict(s.worker.env),
                          keep_files=s.worker.keep_files)

    async def ask(self) -> bool:
        """Add one screening arm: a hypothesis arm first, then the LLM's proposal or the sampler's."""
        taken = [a.params for a in self.arms.values()]
        forced = next((p for p in self.forced() if p not in taken), None)
        if forced is not None:
            return self._asked(self.plan.ask(forced), "hypothesis") is not None
        if self.llm is not None:
            for params, rationale in await self.llm.propose(self, 1):
                arm = self._asked(self.plan.ask(params), "llm", rationale)
                if arm is not None:
                    return True
        arm = self._asked(self.plan.ask(), self.plan.kind)
        if arm is None:
            self._exhausted = True
            self.decisions.log("exhausted", "exhausted", why="the sampler found no new arm (space exhausted)")
        return arm is not None

    # -- stages

    async def next_stage(self) -> str | None:
        """The current stage is settled: end the study, or start a confirmation round."""
        k = self.stage()
        if not self.study.hypotheses:
            return "screening done (no hypotheses to judge)"
        sums = self.summaries()
        verdicts = analysis.assess(self.study, sums, self.best())
        undecided = [v.name for v in verdicts if v.verdict == "inconclusive"]
        if not undecided:
            return "every hypothesis is decided"
        if k >= self.study.confirm.max_rounds:
            return f"inconclusive after {k} confirmation round(s) (confirm.max_rounds): {', '.join(undecided)}"
        arms, best = analysis.confirmation_arms(self.study, sums, verdicts, self.best())
        if not arms:
            return f"inconclusive, and no arm left to confirm: {', '.join(undecided)}"
        if self.runs_left() < len(arms):
            await self.refuse(f"max_runs: a confirmation seed needs {len(arms)} runs, {self.runs_left()} left")
            return f"out of budget (max_runs) with {', '.join(undecided)} inconclusive"
        start = max(self.used_seeds()) + 1
        seeds = list(range(start, start + self.study.confirm_seeds()))
        why = (f"stage {k + 1} (confirmation): {', '.join(undecided)} inconclusive; arms {arms} rerun on new "
               f"seeds {seeds}")
        await self.mark(f"stage:{k + 1}", {"arms": arms, "seeds": seeds, "best": best, "why": why})
        self.decisions.log(f"stage:{k + 1}", "stage", stage=k + 1, arms=arms, seeds=seeds, best=best, why=why,
                           verdicts={v.name: v.verdict for v in verdicts})
        return None

    # -- the loop

    async def run(self, stop: anyio.Event, say=lambda text: None, on_tick=None) -> str:
        from jet.study import report

        try:
            await self.open()
            self.decisions.log(f"start:{len(self.decisions.keys)}", "start", why=f"runner started (pid {os.getpid()})")
            last = 0.0
            while not stop.is_set():
                if on_tick:
                    on_tick()
                end = await self.step()
                if end:
                    self.ended = end
                    break
                if time.monotonic() - last > REPORT_EVERY_S:
                    last = time.monotonic()
                    await anyio.to_thread.run_sync(report.write, self, False)
                    say(report.progress_line(self))
                with anyio.move_on_after(TICK_S):
                    await stop.wait()
            self.ended = self.ended or "stopped by a signal (resume with `jet study resume`)"
            await self.refresh()
            self.tell()
            if not self.ended.startswith(("paused", "stopped by")):
                self.decisions.log("end", "end", why=self.ended)
                self.ended_at = time.time()
            await anyio.to_thread.run_sync(report.write, self, True)
            return self.ended
        finally:
            with anyio.CancelScope(shield=True):
                if self.r is not None:
                    if hasattr(self, "lease"):
                        await self.lease.release()
                    await self.r.aclose()
