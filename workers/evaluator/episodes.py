"""Held-out episodes played with a task's own workflow and reward, on a backend in this process.

What it is: `LocalClient` is the LLM client agent code gets (`jet.llm.LLMClient`'s sessions, the
embedded OpenAI-compatible gateway of `jet.workers.gateway.app`), but its calls are decoded by a backend
in this process instead of going through `gen:<model>`: an evaluation never queues behind, or slows,
the inference workers that generate training data. With `greedy` (the default) every call is decoded
at temperature 0 whatever the workflow asks, so a version's result does not depend on sampling noise.
`play_rows` runs every row's episode exactly as an env worker runs it (`jet.workers.rollout.episode.play`:
the workflow and the reward function under the task's episode timeout, multi-turn agents included),
`concurrency` at a time, so their calls are decoded together (the backend's continuous batching).
`held_out_rows` reads the rows a task's `eval` section names.

An episode's result is its reward (a dict reward, one per agent: their mean); a failed episode (the
agent raised, timed out, a generation failed) scores 0 and is counted, never raised: one bad row does
not stop an evaluation.

What it is not: a trainer's data source (nothing is merged or published) or a Redis client.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import anyio

from jet import rows as datasets
from jet import sampling
from jet.config import JetConfig, TaskConfig
from jet.errors import ConfigError, GenerationError
from jet.keys import Keys
from jet.llm import LLMClient, Tokenizers
from jet.wire import GenRequest, GenResult, Task
from jet.workers.gateway.app import KEY_GRACE_S, episode_gateway
from jet.workers.inference.backend import SamplingParams
from jet.workers.rollout.episode import load_function, play

log = logging.getLogger(__name__)


class LocalClient(LLMClient):
    """An LLM client whose calls a backend in this process decodes (no Redis: nothing is sent or read)."""

    def __init__(self, backend: Any, tokenizers: Tokenizers, *, greedy: bool = True):
        super().__init__("", Keys("evaluator"), tokenizers, cid="evaluator")
        self.backend, self.greedy = backend, greedy

    async def generate(self, request: GenRequest, timeout_s: float | None = None) -> GenResult:
        greedy = self.greedy or request.temperature == 0
        sp = SamplingParams(**(sampling.GREEDY if greedy else sampling.settings_of(request)),
                            max_tokens=request.max_tokens, stop_token_ids=request.stop_token_ids, seed=request.seed)
        out = await self.backend.agenerate_one(list(request.prompt_ids), sp)
        if out.finish_reason == "error":
            raise GenerationError(f"{request.model}: {out.error}")
        return GenResult(request_id=request.msg_id, model=request.model, token_ids=out.token_ids,
                         logprobs=out.logprobs, finish_reason=out.finish_reason, version=out.version,
                         error=out.error, worker=self.id)


def held_out_rows(task: TaskConfig) -> list[dict]:
    """The first `eval.n` rows `tasks[].eval` names (see `jet.config.EvalConfig.dataset`)."""
    from jet.tasks import HELD_OUT, held_out

    ev = task.eval
    if ev is None:
        raise ConfigError(f"tasks.{task.name}.eval: not set")
    dataset = ev.dataset or task.dataset
    if datasets.kind(dataset) == "builtin":
        if dataset not in HELD_OUT:
            key = "eval.dataset" if ev.dataset else "dataset"
            raise ConfigError(f"tasks.{task.name}.{key}: {dataset!r} has no built-in held-out split (built-in ones: "
                              f"{', '.join(sorted(HELD_OUT))}); name a file of held-out rows in tasks.{task.name}"
                              f".eval.dataset")
        return held_out(dataset, ev.n, ev.seed)
    found = datasets.read(dataset)[: ev.n]
    if not found:
        raise ConfigError(f"tasks.{task.name}.eval.dataset: {dataset!r} has no rows")
    return found


@dataclass(frozen=True, slots=True)
class Played:
    """The results of one evaluation: one per row, in row order."""

    results: list[float]
    failed: int  # episodes that failed (scored 0)
    seconds: float

    @property
    def mean(self) -> float:
        return sum(self.results) / len(self.results) if self.results else 0.0


def score(reward: float | dict[str, float] | None) -> float:
    """An episode's result: its reward; a dict reward (one per agent) counts as the mean of its values."""
    if reward is None:
        return 0.0
    if isinstance(reward, dict):
        return sum(reward.values()) / len(reward) if reward else 0.0
    return float(reward)


async def play_rows(cfg: JetConfig, task: TaskConfig, rows: list[dict], client: LocalClient) -> Played:
    """Play every row's episode with the task's workflow and reward (`concurrency` at a time)."""
    workflow = load_function(task.workflow)
    reward = load_function(task.reward) if task.reward else None
    results: list[float] = [0.0] * len(rows)
    failed: list[str] = []
    limit = anyio.CapacityLimiter(task.eval.concurrency if task.eval else 16)
    t0 = time.monotonic()

    async def one(i: int, row: dict, gateway) -> None:
        async with limit:
            t = Task(task=task.name, row=row, group_id=f"eval-{i}", index=0, group_size=1)
            session = client.session(t.msg_id, task.model)
            session.deadline = time.time() + task.episode_timeout_s
            try:
                await gateway.open(session, ttl_s=task.episode_timeout_s + KEY_GRACE_S, task=task.name)
                out = await play(t, session, workflow, reward, timeout_s=task.episode_timeout_s, merge_mode="none",
                                 trained=set())
            finally:
                client.close_session(t.msg_id)
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    await gateway.close(session)
            if out.failed:
                failed.append(out.error or "?")
            results[i] = 0.0 if out.failed else score(out.reward)

    async with episode_gateway(cfg, "", client) as gateway, anyio.create_task_group() as tg:
        for i, row in enumerate(rows):
            tg.start_soon(one, i, row, gateway)
    if failed:
        log.warning("task %s: %d of %d evaluation episodes failed (scored 0); the first: %s", task.name,
                    len(failed), len(rows), failed[0])
    return Played(results, len(failed), time.monotonic() - t0)
