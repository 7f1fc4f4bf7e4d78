"""The trainer's main loop (`jet train`): read trajectories, take optimiser steps, publish, checkpoint.

It reads top to bottom like nanochat's chat_rl.py: set-up and resume, then
one iteration per optimiser step: (1) rank 0 gathers `batch_groups`
trainable GRPO groups from `traj:<model>` in the tasks' mixing ratio
(`jet.trainer.intake`, `jet.trainer.mix`), computes
advantages and loss weights and packs micro-batches by the token budget;
(2) every rank runs forward/backward on its share and the optimiser steps;
(3) every `publish_every` steps the weights are written, made durable (the
step's checkpoint, or else a resume point), then announced; (4) rank 0 logs
metrics; (5) every `checkpoint_every` steps, a checkpoint, then the acks.
With the torch backend there is one rank; with deepspeed, rank 0 alone talks
to Redis and broadcasts each step (`jet.trainer.dist`).

Exactly once, with acks. A trajectory's entry is acked only after the
checkpoint holding its effect is on disk:
- the trainer holds every entry it reads (pending, under a long lease the link
  renews) until a checkpoint or a resume point records its fate in `consumed`
  (trained at step k, or dropped and why); its folder is written, fsynced and
  renamed, and only THEN are those entries acked with their idempotency
  markers (`jet.trainer.link.Link.ack`);
- a restarted trainer (same consumer name) loads the newest checkpoint or
  resume point and first acks its `consumed` entries (a crash may fall
  between the rename and the acks): they are never trained again. Entries
  read after it are still pending in the trainer's PEL; the consumer re-reads
  them first and they are trained again, which is right: the steps that used
  them died with the process (their metrics lines are dropped too);
- a redelivered entry whose marker exists is acked by the consumer, never
  handed to the loop.
So along the lineage of checkpoints and resume points (the ledger, `jet.trainer.checkpoint`)
every entry is decided exactly once, and every acked entry was decided.

Resume points (`trainer.resume: published`, the default; torch backend): a
restart loses nothing trained since the last checkpoint. At every publish,
after the weights are written and before they are announced, a resume point
(`jet.trainer.checkpoint`: state.json alone, naming the version's folder and
sha256) records the step, the version, the counts and the ledger of the
entries decided since, and they are acked. A restart from it loads the newest
checkpoint's optimiser and RNG state, then the published version's weights
over the model (`jet.trainer.weights.load_version`): the version the inference
workers serve is the trainer's own again, so the work generated before and
during the crash is as fresh as it was, and no version is lost to republish.
The optimiser's moments are those of the checkpoint (at most
`checkpoint_every` steps older); a bfloat16 publish rounds the float32
master weights once. Why and what it saves: docs/design.md, "Restarts".

Weight versions stay monotonic across restarts: if `weights:<model>` already
announces a version newer than the checkpoint's (steps lost in a crash were
published), the restored weights are published at once as the next version,
so inference workers leave the lost lineage; a version written but not
announced when the process died is announced at once. Staleness is not counted in
those version numbers but along the lineage (`jet.trainer.lineage`): the
republished weights are as old as the checkpoint's version, so the backlog
generated before the crash keeps its age instead of jumping by the lost
steps (docs/design.md, "Weight versions and staleness").

Poison never stops training: every trajectory is screened on intake, and one
the trainer can never train is dead-lettered alone with its reason; an
overlong one is truncated or dead-lettered (`trainer.overlong`); a step that
still fails on some trajectory drops that one and retries (`jet.trainer.screen`,
`jet.trainer.guard`).

A stop (SIGTERM) during a step abandons it before its next micro-batch (one-process
backends; `jet.trainer.step`): nothing of it is applied or acked, the trajectories it
held stay pending and a restart trains them, and the stop checkpoints what earlier
steps decided, so `jet up`'s drain never has to kill a trainer in a long step. The
heartbeat carries the longest micro-batch so far (`micro_batch_s`), from which
`jet up` sizes its drain deadline.

`max_staleness: 0` is the synchronous baseline: after publishing version v
the trainer accepts only trajectories generated entirely at v, waiting for
them (a barrier) and dropping older ones (counted as `stale`).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from jet import adapters
from jet.config import AdapterConfig, JetConfig, TrainerConfig, write_resolved
from jet.runs import RunDir
from jet.trainer.batch import mean_reward
from jet.trainer.checkpoint import Checkpoints, die_at
from jet.trainer.dist import Comm, Plan
from jet.trainer.groups import Assembler, no_signal
from jet.trainer.guard import guarded, guarded_step, prepare
from jet.trainer.intake import Intake
from jet.trainer.lineage import Lineage
from jet.trainer.link import Link
from jet.trainer.metrics import Metrics
from jet.trainer.optim import lr_at
from jet.trainer.screen import Limits
from jet.trainer.step import StepAbandoned
from jet.trainer.weights import load_version, prune_weights, weights_dir, write_version
from jet.wire import WeightVersion

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TrainState:
    step: int = 0  # optimiser steps taken
    version: int = 0  # newest weight version published (0 = the model directory's weights)
    counts: dict[str, int] = field(default_factory=dict)  # outcomes and group counters (jet.trainer.groups)
    lineage: Lineage = field(default_factory=Lineage)  # version -> position along the lineage (rank 0's)


@dataclass(slots=True)
class Clock:
    """Where the trainer's time goes since the loop started (seconds)."""

    start: float = field(default_factory=time.monotonic)
    busy: float = 0.0  # forward/backward, optimiser, publishing
    wait: float = 0.0  # waiting for trainable groups
    steps: int = 0
    tokens: float = 0.0  # tokens forwarded
    micro_batch_s: float = 0.0  # the longest micro-batch so far: how long a stop may wait (jet up's drain)


def run(cfg: JetConfig, model: str, url: str | None, stop: Callable[[], bool], *,
        backend: str | None = None, device: str | None = None) -> TrainState:
    """Train `model` until `trainer.steps` or `stop()`; returns the final state."""
    tc = cfg.trainer_of(model)  # the top-level trainer section under the model's own `trainer` overrides
    root = RunDir.of(cfg).trainer(model)

    # -- set-up: threads, ranks, seeds, the backend, the checkpoint to resume from
    if (device or tc.device) == "cpu":
        from jet.supervisor import check_threads

        if tc.threads:
            torch.set_num_threads(tc.threads)
        check_threads(f"jet train --model {model}", torch.get_num_threads())  # warns on an oversubscribed host
    comm, engine = make_backend(backend or tc.backend, cfg.model(model).path, tc, device, cfg.model(model).adapter)
    torch.manual_seed(tc.seed + comm.rank)
    random.seed(tc.seed + comm.rank)
    ckpts = Checkpoints(root, tc.keep_checkpoints, comm.barrier, comm.rank)
    adapter = cfg.model(model).adapter
    points = (tc.resume == "published" and (backend or tc.backend) == "torch"  # every publish is a resume point
              and (adapter is None or adapter.publish == "adapter"))
    state, resumed = TrainState(), ckpts.resume()
    if resumed:
        source = restore(engine, ckpts, *resumed)
        state = TrainState(resumed[1]["step"], resumed[1]["version"], resumed[1].get("counts", {}),
                           Lineage.from_json(resumed[1].get("lineage")))
        log.info("resumed %s from %s (step %d, version %d)", model, source, state.step, state.version)

    with contextlib.ExitStack() as stack:
        intake = metrics = None
        if comm.leader:
            write_resolved(cfg, cfg.run_dir)
            link = stack.enter_context(Link.for_trainer(cfg, model, url, stop))
            asm = Assembler(min_size=tc.min_group_size, timeout_s=tc.group_timeout_s, max_staleness=tc.max_staleness,
                            position=state.lineage.ordinal, skip_no_signal=tc.skip_no_signal)
            asm.counts.update(state.counts)
            intake = Intake(link, asm, weights={t.name: t.weight for t in cfg.tasks}, mix_wait_s=tc.mix_wait_s,
                            expected=[t.name for t in cfg.tasks if t.model == model and t.weight > 0],
                            limits=limits_of(engine.model, tc))
            metrics = stack.enter_context(contextlib.closing(Metrics.for_trainer(cfg, model, resume_step=state.step)))
            if resumed:  # a crash may have come between the checkpoint and its acks
                link.ack([(c["entry"], c["msg"]) for c in resumed[1]["consumed"]])

        def durable(folder: Path, sha: str, full: bool) -> None:
            """Before a version is announced: a checkpoint (`full`) or a resume point makes it durable."""
            if full:
                checkpoint(ckpts, engine, comm, intake, state)
            elif points:
                checkpoint(ckpts, engine, comm, intake, state, point={"weights": str(folder.resolve()), "sha256": sha})

        # -- versions stay monotonic: republish restored weights past any lost lineage's announcements
        #    (or announce a resume point's version the crash kept from being announced)
        plan = comm.share_plan(first_plan(intake, state) if comm.leader else None)
        if plan.publish:
            state.version = plan.version
            publish(engine, comm, intake, cfg.run_dir, model, state, tc, lambda f, sha: durable(f, sha, False))

        clock, last_checkpoint = Clock(), max((s for s, _ in ckpts.whole()), default=0)
        while True:
            # 1. rank 0: the next batch of trainable groups, and what this step does
            plan = groups = rows = inputs = None
            if comm.leader:
                t0 = time.monotonic()
                batch = None if state.step >= tc.steps else next_batch(intake, tc, state, stop)
                clock.wait += time.monotonic() - t0
                if batch is None:
                    dirty = state.step > last_checkpoint or bool(intake.consumed)
                    plan = Plan(stop=True, checkpoint=dirty, step=state.step, version=state.version)
                else:
                    groups, inputs, rows = batch
                    n = state.step + 1
                    publish_now = n % tc.publish_every == 0
                    checkpoint_now = bool(tc.checkpoint_every) and n % tc.checkpoint_every == 0
                    plan = Plan(publish=publish_now, checkpoint=checkpoint_now, step=state.step,
                                version=state.version + publish_now, lr=lr_at(state.step, tc))
            plan = comm.share_plan(plan)
            if plan.stop:
                if plan.checkpoint:
                    checkpoint(ckpts, engine, comm, intake, state)
                break

            # 2. forward/backward on this rank's micro-batches, one optimiser step (one process: a step
            #    that fails on some trajectory dead-letters it and trains the rest, jet.trainer.guard)
            t0 = time.monotonic()
            rows, inputs = comm.share(rows, inputs)
            if getattr(engine, "retryable", False):
                try:
                    groups, inputs, rows, stats = guarded_step(engine, intake, tc, groups, inputs, rows, plan.lr,
                                                               state.step, stop)
                except StepAbandoned as e:  # a stop during a long step: its trajectories stay unacked
                    log.info("stop during step %d (%s): abandoned; its %d groups are trained after a restart",
                             state.step + 1, e, len(groups))
                    if state.step > last_checkpoint or intake.consumed:
                        checkpoint(ckpts, engine, comm, intake, state)
                    break
                if stats is None:  # every member was dead-lettered: no step
                    continue
            else:
                stats = engine.train_step(comm.mine(rows), inputs, plan.lr, pad_row=rows[0])
            trained_at, state.step = state.version, state.step + 1
            staleness = intake.trained(groups, state.step, state.lineage.ordinal(trained_at)) if comm.leader else []

            # 3. publish the new weights every publish_every steps; before they are announced, the
            #    step's checkpoint, or else a resume point, makes them and what the step decided durable
            if plan.publish:
                state.version = plan.version
                publish(engine, comm, intake, cfg.run_dir, model, state, tc,
                        lambda f, sha, full=plan.checkpoint: durable(f, sha, full))
            clock.busy += time.monotonic() - t0
            clock.steps += 1
            clock.tokens += stats.row_tokens

            # 4. rank 0: metrics
            if comm.leader:
                metrics.log(state.step, step_metrics(stats, inputs, staleness, groups, plan.lr, state,
                                                     clock, intake))
                clock.micro_batch_s = max(clock.micro_batch_s, stats.micro_batch_s)
                intake.link.status.update(step=state.step, weight_version=state.version,  # its heartbeat
                                          micro_batch_s=round(clock.micro_batch_s, 3))
                intake.report()  # what the feeder's admission subtracts

            # 5. checkpoint (if the publish did not), then ack what it made durable
            if plan.checkpoint:
                if not plan.publish:
                    checkpoint(ckpts, engine, comm, intake, state)
                last_checkpoint = state.step
    comm.close()
    log.info("trainer of %s stopped at step %d (version %d)", model, state.step, state.version)
    return state


def make_backend(kind: str, path: str, tc: TrainerConfig, device: str | None, adapter: AdapterConfig | None = None):
    if kind == "torch":
        from jet.trainer.backend_torch import TorchBackend

        return Comm(), TorchBackend(path, tc, device, adapter)
    if kind == "deepspeed":
        from jet.trainer.backend_deepspeed import DeepSpeedBackend, init_distributed

        comm = init_distributed(device or tc.device)
        return comm, DeepSpeedBackend(path, tc, comm, device, adapter)
    raise ValueError(f"unknown trainer backend {kind!r}; expected 'torch' or 'deepspeed'")


def limits_of(model, tc: TrainerConfig) -> Limits:
    """What the screen holds trajectories to: the model's vocabulary, a micro-batch's and the model's length."""
    sizes = [model.config.vocab_size, model.get_input_embeddings().num_embeddings]
    out = model.get_output_embeddings()
    if out is not None and hasattr(out, "out_features"):
        sizes.append(out.out_features)
    positions = getattr(model.config, "max_position_embeddings", None) or tc.micro_batch_tokens
    return Limits(min(sizes), min(tc.micro_batch_tokens, positions), tc.overlong)


def restore(engine, ckpts: Checkpoints, folder: Path, saved: dict) -> str:
    """Every rank: load what a resume starts from (a checkpoint's backend files, or a resume point's
    published version over its base checkpoint's optimiser and RNG state); says which."""
    point = saved.get("point")
    if point is None:
        engine.load(folder)
        return f"checkpoint {folder.name}"
    if point["base"]:
        engine.load(ckpts.dir / point["base"])
    with engine.full_module() as module:
        load_version(module, Path(point["weights"]), point["sha256"])
    return f"published version {saved['version']} (optimiser state: {point['base'] or 'fresh'})"


def first_plan(intake: Intake, state: TrainState) -> Plan:
    """Versions never run backwards: publish the restored weights as the next version past any newer
    announcement (a checkpoint older than what a crashed run published), or as their own version when
    it was never announced (a crash between a resume point or checkpoint and its announcement)."""
    announced = intake.link.latest_weights()
    newer = announced is not None and announced.version > state.version
    unannounced = state.version > (announced.version if announced is not None else 0)
    version = announced.version + 1 if newer else state.version
    if newer:
        log.info("weights:%s announces version %d past the checkpoint's %d: republishing as %d",
                 announced.model, announced.version, state.version, version)
        state.lineage.resumed(state.version, announced.version, version)
    elif unannounced:
        log.info("version %d of %s was written but not announced before the restart: announcing it",
                 state.version, intake.link.model)
    return Plan(publish=newer or unannounced, step=state.step, version=version)


def next_batch(intake: Intake, tc: TrainerConfig, state: TrainState, stop: Callable[[], bool]):
    """(groups, step inputs, packed rows) of the next step, or None when stopping."""
    def probe(traj):
        prepare([[traj]], tc, every_sample=True)

    while True:
        groups = intake.gather(tc.batch_groups, state.lineage.ordinal(state.version), state.step, stop)
        if groups is None:
            return None
        groups, (inputs, rows) = guarded(intake, groups, state.step,
                                         lambda gs: prepare([g.trajectories() for g in gs], tc), probe)
        if rows:
            return groups, inputs, rows
        intake.trained(groups, state.step, state.lineage.ordinal(state.version))  # nothing to step on


def publish(engine, comm: Comm, intake: Intake | None, run_dir: Path, model: str, state: TrainState,
            tc: TrainerConfig, durable: Callable[[Path, str], None]) -> None:
    """Every rank: write the weights as version `state.version` (rank 0), make them durable
    (`durable(folder, sha256)`: a checkpoint or a resume point), announce them, prune old ones
    (`trainer.keep_weights`, never one a live inference worker serves: `jet.trainer.weights`)."""
    folder = weights_dir(Path(run_dir), model, state.version)
    with engine.full_module() as module:
        sha = write_version(module, folder, tc.dtype) if comm.leader else ""
    durable(folder, sha)
    if comm.leader:
        blob, chunks = "", 0
        adapter = getattr(engine, "adapter", None)
        if adapter is not None and adapters.is_adapter(folder):  # small enough: also through Redis
            blob, chunks = intake.link.put_blob(state.version, folder, adapters.FILES, tc.keep_weights,
                                                adapter.via_redis_mb * 2**20)
        intake.link.publish(WeightVersion(model=model, version=state.version, path=str(folder.resolve()),
                                          sha256=sha, step=state.step, blob=blob, blob_chunks=chunks))
        prune_weights(Path(run_dir), model, state.version, tc.keep_weights, intake.link.served_versions())
    comm.barrier()


def checkpoint(ckpts: Checkpoints, engine, comm: Comm, intake: Intake | None, state: TrainState,
               point: dict | None = None) -> None:
    """Every rank: write the checkpoint (with `point`, a resume point of the version just written:
    one process); rank 0 then acks the entries it made durable."""
    consumed = intake.take_consumed() if comm.leader else []
    state.counts = dict(intake.asm.counts) if comm.leader else {}
    kind = "checkpoint" if point is None else "point"
    ckpts.write(state.step, {"version": state.version, "counts": state.counts, "consumed": consumed,
                             "lineage": state.lineage.to_json(), "time": time.time()},
                engine.save if point is None else None, point=point)
    if comm.leader:
        die_at(f"{kind}:written")
        intake.link.ack([(c["entry"], c["msg"]) for c in consumed])
        die_at(f"{kind}:acked")
        (log.info if point is None else log.debug)("%s at step %d; acked %d trajectories", kind, state.step,
                                                   len(consumed))


def step_metrics(stats, inputs, staleness: list[int], groups, lr: float, state: TrainState,
                 clock: Clock, intake: Intake) -> dict[str, float]:
    elapsed = max(1e-9, time.monotonic() - clock.start)
    rewards = torch.tensor(inputs.rewards or [0.0], dtype=torch.float64)
    lag = intake.link.lag()
    out = {
        "train/loss": stats.loss, "train/pg_loss": stats.pg, "train/kl": stats.kl,
        "train/clip_frac": stats.clipped / max(1.0, stats.tokens), "train/grad_norm": stats.grad_norm,
        "train/lr": lr, "train/ratio_max": stats.ratio_max, "train/tokens": inputs.n_tokens,
        "train/forward_tokens": stats.forward_tokens, "train/entropy": stats.nll / max(1.0, stats.tokens),
        "train/micro_batches": stats.rows,
        "rollout/reward_mean": float(rewards.mean()), "rollout/reward_std": float(rewards.std(unbiased=False)),
        "rollout/groups": len(groups), "rollout/trajectories": len(inputs.rewards),
        "rollout/no_signal_frac": sum(no_signal([t.reward for t in g.trajectories()]) for g in groups)
        / max(1, len(groups)),
        "policy/version": state.version, "policy/is_masked_frac": stats.masked / max(1.0, stats.tokens),
        "policy/is_truncated_frac": stats.truncated / max(1.0, stats.tokens),
        "policy/staleness": sum(staleness) / max(1, len(staleness)), "policy/staleness_max": max(staleness, default=0),
        "queue/lag": lag.get("lag"), "queue/pending": lag.get("pending"), "queue/held": intake.asm.waiting,
        "perf/busy_fraction": clock.busy / elapsed, "perf/busy_s": clock.busy, "perf/wait_s": clock.wait,
        "perf/steps_per_min": clock.steps / elapsed * 60, "perf/tokens_per_s": clock.tokens / elapsed,
    }
    out.update({f"counts/{k}": v for k, v in intake.asm.counts.items()})
    out.update({f"train/{task}/groups": n for task, n in intake.trained_per_task().items()})
    out.update({f"rollout/{task}/reward_mean": r for task, r in task_rewards(groups).items()})
    return out


def task_rewards(groups) -> dict[str, float]:
    """Mean member reward (a dict reward: its mean over agents) per task of a step's groups."""
    per_task: dict[str, list[float]] = {}
    for g in groups:
        per_task.setdefault(g.task, []).extend(mean_reward(t) for t in g.trajectories())
    return {task: sum(r) / len(r) for task, r in per_task.items() if r}
