"""Jet's configuration schema: one YAML file per experiment, loaded into frozen pydantic models.

`load_file(path, overrides=["trainer.lr=1e-5"])` reads the file, applies `--set`
overrides, validates every key, type and range (errors name the path:
`trainer.lr: expected float, got 'fast'`) and resolves relative file paths
against the config file's folder. `write_resolved` stores the result in the
run folder so a run can be reproduced. Each section is a `configlib.Section`
(frozen, unknown keys forbidden, strict types); the line under each field says
what it does and its unit, and is the field's description.

The default config ships in the package (`default_config_path()`), so `jet up`
works in any folder. A config inside the package has no folder of its own (and
the package is no place for models): its relative paths resolve against the
folder `jet` runs in, where `runs_dir` and `.jet/` are, so the default's model
is `./.jet/models/tiny`.

What is not here: secrets. The Redis URL (and its password) comes from the
environment (`JET_REDIS_URL`) or the CLI; a config file that names one is refused.
"""

from __future__ import annotations

import importlib.resources
import os
import re
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal

from pydantic import (
    AfterValidator,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from jet import configlib, rows
from jet.configlib import Section, hint, invalid, problem
from jet.errors import ConfigError
from jet.keys import STREAM_KINDS as KEY_STREAM_KINDS
from jet.keys import check_name
from jet.runs import RunDir
from jet.sources import hub_id, is_builtin, pinned, resolve_model

__all__ = ["JetConfig", "QueueConfig", "ModelConfig", "TaskConfig", "EvalConfig", "RuntimeConfig", "TrainerConfig",
           "load", "load_file", "dump", "write_resolved", "redis_url", "check_models", "pins", "default_config_path",
           "REDIS_URL_ENV"]

REDIS_URL_ENV = "JET_REDIS_URL"

# Streams whose length `queues.maxlen` may bound (the kinds of `jet.keys.Keys`).
STREAM_KINDS = KEY_STREAM_KINDS  # the kinds of `jet.keys.Keys` streams `queues.maxlen` may bound
# Bounds of the busy streams and of `dead`; a kind left out of the file keeps its default.
DEFAULT_MAXLEN = {"tasks": 100_000, "gen": 10_000, "traj": 10_000, "dead": 2_000}

_FUNCTION = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def _named(kind: str):
    """A str that `jet.keys.check_name` accepts as a `kind` name (it goes into Redis keys)."""
    return Annotated[str, AfterValidator(lambda v: check_name(kind, v))]


def _function(value: str | None) -> str | None:
    if value is not None and not _FUNCTION.match(value):
        raise ValueError(f"expected 'module:function' (e.g. 'jet.tasks.guess:workflow'), got {value!r}")
    return value


def is_dataset_path(dataset: str) -> bool:
    """A dataset is read by jet.rows (a file, a folder or a Hub dataset) unless it is a built-in name."""
    return rows.kind(dataset) != "builtin"


def _dataset(value: str) -> str:
    return value if is_dataset_path(value) else check_name("dataset", value)  # kind() raises on a bad '?' query


NonEmpty = Annotated[str, Field(min_length=1)]
Function = Annotated[str, AfterValidator(_function)]
RunName, ModelName, TaskName = _named("run"), _named("model"), _named("task")


class QueueConfig(Section):
    lease_ms: PositiveInt = 30_000
    """Lease on a read message (ms): past it, the reaper may hand the message to another consumer."""
    max_deliveries: PositiveInt = 5
    """Deliveries (first read + reclaims) before a message goes to the dead-letter stream."""
    block_ms: PositiveInt = 1_000
    """Blocking read timeout (ms) of XREADGROUP: a drain waits up to this for a read in progress."""
    batch: PositiveInt = 64
    """Entries fetched per read (count)."""
    maxlen: dict[str, PositiveInt] = Field(default_factory=lambda: dict(DEFAULT_MAXLEN))
    """Max length (entries) per stream kind: producers and commits wait while tasks/gen/traj are full, `dead`
    and `shadow` keep their newest entries (dropped dead letters are counted); kinds not given keep
    DEFAULT_MAXLEN or are unbounded."""
    marker_ttl_s: PositiveInt | None = None
    """Lifetime (s) of the idempotency markers; None: 2 x (max_deliveries + 1) x the lease, at least 300 s
    (a copy of a message can arrive that long; ~90 B a marker, so rate x TTL x 90 B of memory)."""
    max_entry_bytes: PositiveInt = 16 * 1024 * 1024
    """Largest encoded entry accepted by the codec (bytes)."""

    @field_validator("maxlen")
    @classmethod
    def _kinds(cls, maxlen: dict[str, int]) -> dict[str, int]:
        for kind in maxlen:
            if kind not in STREAM_KINDS:
                raise problem(kind, "unknown stream kind" + (hint(kind, STREAM_KINDS) or
                                                             f"; one of {', '.join(STREAM_KINDS)}"))
        return {**DEFAULT_MAXLEN, **maxlen}

    @model_validator(mode="after")
    def _block_below_lease(self) -> QueueConfig:
        if self.block_ms >= self.lease_ms:
            raise problem("block_ms", f"must be below lease_ms ({self.lease_ms}), got {self.block_ms}")
        return self


class AdapterConfig(Section):
    r: PositiveInt = 16
    """LoRA rank: the inner dimension of each low-rank update B @ A (parameters per adapted layer: r x (in + out))."""
    alpha: PositiveFloat = 32.0
    """LoRA alpha: the update is scaled by alpha / r (unitless)."""
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    """Dropout on the adapter's input while training (probability). Above 0 the trainer's logprobs are no
    longer the sampler's (the sampler runs without dropout), so the on-policy ratio is not exactly 1."""
    target_modules: list[NonEmpty] | Literal["all-linear"] = "all-linear"
    """Which layers get an adapter: module names (suffixes, e.g. [q_proj, v_proj]) or 'all-linear' (every
    linear layer but the output head: for Llama-like models the 7 attention and MLP projections)."""
    publish: Literal["adapter", "merged"] = "adapter"
    """What a weight version holds: 'adapter' (the adapter alone, ~1/28 of SmolLM2-135M at r 16 on every
    projection; hf inference workers merge it into their copy of the base, vllm ones load it as a LoRA at run
    time) or 'merged' (the full weights with the adapter merged in, as full training publishes)."""
    share_base: bool = True
    """Served by one inference worker together with the other models of this config that train an adapter of
    the same base (same `path`, `backend`, `device`, `dtype`, `publish: adapter`): one copy of the base,
    each model's adapter added to its own rows (`serving_groups`); false: a worker of its own."""
    via_redis_mb: NonNegativeFloat = 64.0
    """An adapter version at most this size also travels through Redis (chunked, checksummed, the newest
    `trainer.keep_weights` versions kept), so an inference worker that shares no folder with the trainer
    serves it (MiB); 0 = the run folder only. Full weights always go through the run folder."""


class ModelConfig(Section):
    name: ModelName
    """Model name: key namespace of its gen/traj/weights streams, referenced by tasks[].model."""
    path: NonEmpty
    """HF model folder (config + safetensors weights + tokenizer; relative paths are against the config file's
    folder), or a Hugging Face Hub id `owner/name[@revision]` fetched into the HF cache (a folder wins)."""
    backend: Literal["hf", "vllm"] = "hf"
    """Inference backend: 'hf' (transformers, CPU or GPU) or 'vllm' (GPU)."""
    trainable: bool = True
    """Whether the trainer updates this model; False serves it frozen (a judge, an opponent)."""
    device: NonEmpty = "cpu"
    """Torch device of the inference worker ('cpu', 'cuda', 'cuda:1')."""
    max_batch: PositiveInt = 16
    """Unused since the inference worker serves per request (max_inflight); accepted for old configs."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Inference dtype; float32 gives the logprobs a float32 trainer recomputes (bfloat16 is faster on GPUs)."""
    max_inflight: PositiveInt = 64
    """Generation requests one inference worker decodes at once, each answered as it completes (requests)."""
    prefix_cache_mb: NonNegativeInt = 1024
    """Memory for the keys and values of prefixes already computed (MiB): prompts that start with one (a
    group's shared prompt, an episode's previous turns) prefill only the rest; least recently used first
    out; 0 = off. hf backend; the vllm backend turns on vLLM's automatic prefix caching instead."""
    threads: PositiveInt | None = None
    """CPU threads of this model's inference worker on device 'cpu' (torch intra-op threads); None: `jet up`
    gives it its share of the cores (jet.cli.up.thread_shares), a worker started alone keeps torch's default."""
    request_timeout_s: PositiveFloat = 300.0
    """Longest wait of one generation call of this model, queueing and decoding included (s): then the call
    raises GenerationTimeout, and a worker that had not started the request drops it (jet.llm)."""
    weights_roots: list[str] = Field(default_factory=list)
    """Folders weight announcements may point into besides <runs_dir>/<run>/weights/<model> (paths)."""
    trainer: dict[str, Any] = Field(default_factory=dict)
    """This model's trainer settings over the top-level `trainer` section (e.g. {lr: 1e-4, seed: 1})."""
    adapter: AdapterConfig | None = None
    """Train a LoRA adapter (peft) instead of every parameter: only its parameters get gradients and optimiser
    state, checkpoints and published versions hold the adapter alone (see `publish`). None: full training."""


class RuntimeConfig(Section):
    python: str | None = None
    """Python interpreter running the workflow (a path or a command on PATH); None = the env worker's own."""
    cwd: str | None = None
    """Working directory of the workflow; relative to the config file's folder; None = the worker's own."""


class EvalConfig(Section):
    dataset: NonEmpty | None = None
    """Held-out rows: a built-in dataset's held-out split by its name (`add`, `tally`: rows no training row
    shares), a .jsonl, .parquet or .csv file (relative to the config file's folder), or a Hub dataset with its
    split (`owner/name?split=test`); None: the held-out split of the task's own built-in dataset."""
    n: PositiveInt = 100
    """Held-out rows evaluated for each version: the first n of the dataset (rows)."""
    every: PositiveInt = 10
    """Evaluate every N-th published version (versions); the base weights (version 0) and the run's final
    version are evaluated too. An evaluator that falls behind skips to the newest version due."""
    base: bool = True
    """Also evaluate the base weights (version 0) when the evaluator starts: the curve's first point."""
    greedy: bool = True
    """Decode every call of an evaluation episode greedily (temperature 0), whatever the workflow asks; false:
    sample as the workflow asks."""
    concurrency: PositiveInt = 16
    """Evaluation episodes run at once by the evaluator (their calls are decoded together)."""
    seed: NonNegativeInt = 0
    """Which rows of a built-in held-out split, in which order (integer)."""

    @field_validator("dataset")
    @classmethod
    def _eval_dataset(cls, value: str | None) -> str | None:
        return None if value is None else _dataset(value)


class TaskConfig(Section):
    name: TaskName
    """Task name: key namespace of its tasks stream, and the name in metrics."""
    workflow: Function
    """Episode function as 'module:function'; it talks to the model and returns the episode."""
    dataset: Annotated[NonEmpty, AfterValidator(_dataset)]
    """Dataset rows: a built-in dataset name; a .jsonl, .parquet or .csv file (relative to the config file's
    folder); or a Hub dataset id or dataset folder for `datasets.load_dataset`, as `owner/name` with an
    optional `?config=<name>&split=<split>&revision=<rev>` (split: train). See jet/rows.py."""
    reward: Function | None = None
    """Reward function as 'module:function'; None when the workflow returns the reward itself."""
    group_size: PositiveInt = 4
    """Episodes per dataset row; advantages are computed within a group (episodes)."""
    weight: NonNegativeFloat = 1.0
    """Mixing ratio of this task's rows among all tasks (relative weight, >= 0)."""
    episode_timeout_s: PositiveFloat = 120.0
    """Wall-clock limit of one episode (s); past it the episode fails and may be retried."""
    max_retries: NonNegativeInt = 2
    """Retries of a failed episode before the group is trained without it (count)."""
    concurrency: PositiveInt = 8
    """Episodes run at once by one env worker process (episodes)."""
    merge: Literal["exact", "tree", "none"] = "exact"
    """Turn merging of multi-turn episodes: 'exact' prefix match, 'tree' shared prefixes, 'none' one sample per turn."""
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    """Process the workflow runs in (interpreter, working directory)."""
    model: str | None = None
    """Name of the model the workflow talks to; None = the only configured model."""
    eval: EvalConfig | None = None
    """Held-out evaluation during training: an evaluator (`jet worker eval`, a role of `jet up`) plays these
    rows with this task's workflow and reward on published versions, off the training path, and logs
    `eval/<task>/reward_mean` with the version, its step and wall time (`<run>/trainer/<model>/eval.jsonl`).
    None: no evaluation."""


class TrainerConfig(Section):
    lr: PositiveFloat = 1e-5
    """Peak learning rate of AdamW (per step)."""
    batch_groups: PositiveInt = 8
    """Groups (dataset rows x group_size episodes) per optimiser step."""
    micro_batch_tokens: PositiveInt = 8192
    """Token budget of one forward/backward micro-batch (tokens, padding included)."""
    max_staleness: NonNegativeInt = 1
    """Oldest policy version a trajectory may lag the current one by (versions); 1: one step off (docs/studies.md)."""
    admission: Literal["staleness", "off"] = "staleness"
    """How `jet up` / `jet feed` start episodes of this model: 'staleness' admits one only while the trajectories
    admitted and not yet trained or dropped stay within (max_staleness + 1) x batch_groups groups, so no sample
    is generated only to arrive stale (AReaL's rule); 'off' keeps the task streams topped up however far behind."""
    publish_every: PositiveInt = 1
    """Publish new weights to the inference workers every N optimiser steps (steps)."""
    checkpoint_every: NonNegativeInt = 50
    """Save a checkpoint to the run folder every N steps; 0 = only at the end (steps)."""
    resume: Literal["published", "checkpoint"] = "published"
    """Where a restarted trainer goes on from: 'published', its newest published weights (every publish
    is a resume point: the weights, the ledger, the counts; the optimiser state of the newest checkpoint),
    so nothing trained or generated since the checkpoint is lost; 'checkpoint', its newest checkpoint
    (the steps since are trained again). The deepspeed backend and `adapter.publish: merged` always
    resume from the checkpoint."""
    clip_eps: PositiveFloat = 0.2
    """PPO ratio clipping range (dimensionless, ratio in [1 - eps, 1 + eps])."""
    kl_coef: NonNegativeFloat = 0.0
    """Weight of the KL penalty against the reference model; 0 = no reference model (dimensionless)."""
    objective: Literal["ppo", "decoupled"] = "decoupled"
    """'decoupled' clips the ratio against the current (proximal) policy and corrects staleness with an importance
    weight current/behaviour, as `rollout_correction` says (AReaL, arXiv:2505.24298); 'ppo' clips against the
    behaviour policy, which loses reward at equal steps on stale batches (`jet bench staleness`). Equal on fresh."""
    rollout_correction: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"] = \
        "token_truncate"
    """The decoupled objective's weight of each token from rho = current/behaviour (jet.trainer.losses):
    'token_truncate' min(rho, is_cap) (TIS), 'token_mask' rho inside [is_floor, is_cap] else 0 (masked IS),
    'sequence_truncate' min(rho_s, is_cap) and 'sequence_mask' rho where rho_s is inside the band else 0,
    with rho_s the geometric mean of rho over the episode's trained tokens; 'none' 1. Objective 'ppo'
    takes no weight ('token_truncate' or 'none' only)."""
    is_cap: PositiveFloat = 2.0
    """Upper bound of the rollout correction's band: the truncation or mask threshold of current/behaviour
    (dimensionless, >= 1)."""
    is_floor: NonNegativeFloat | None = None
    """Lower bound of the band of 'token_mask' and 'sequence_mask'; None: 1 / is_cap; 0: no lower bound
    (dimensionless, <= 1)."""
    advantage: Literal["grpo", "rloo", "no_std"] = "grpo"
    """Advantage estimator: 'grpo' (mean/std in group), 'rloo' (leave-one-out), 'no_std' (mean only, Dr. GRPO)."""
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    """Loss aggregation: 'token_mean' over all tokens of the batch, 'seq_mean' per sequence then mean."""
    prefix_trees: bool = True
    """Merge the samples of a step that share a prefix (a group's prompt, a shared history) into prefix
    trees, so each shared token is forwarded and backpropagated once (jet.timeline.share); false: every
    sample on its own (for comparison; the loss and gradients are the same)."""
    grad_clip: NonNegativeFloat = 1.0
    """Max global gradient norm; 0 = no clipping (L2 norm)."""
    warmup_steps: NonNegativeInt = 0
    """Linear learning-rate warmup (steps)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate after warmup: 'constant', or decayed to 0 at `steps` ('linear', 'cosine')."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW decoupled weight decay (fraction of the weight per unit of lr)."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's decay rates of the first and second moment estimates (each in [0, 1))."""
    adam_eps: PositiveFloat = 1e-8
    """AdamW's epsilon, added to the second moment's root (dimensionless)."""
    steps: PositiveInt = 100
    """Optimiser steps of the run (steps)."""
    min_group_size: PositiveInt = 2
    """Fewest finished episodes a group needs to be trained on after group_timeout_s (episodes)."""
    group_timeout_s: PositiveFloat = 300.0
    """Wait for a group's missing episodes before training on what arrived (s)."""
    skip_no_signal: bool = False
    """Drop groups whose rewards are all equal (no gradient) and wait for others: dynamic sampling (bool)."""
    backend: Literal["torch", "deepspeed"] = "torch"
    """Optimiser backend: 'torch' (one process) or 'deepspeed' (ZeRO, multi-GPU)."""
    zero_stage: Literal[0, 1, 2, 3] = 2
    """DeepSpeed ZeRO stage, used when backend is 'deepspeed' (0-3)."""
    nproc: PositiveInt = 1
    """Trainer processes (data-parallel ranks) when backend is 'deepspeed' (processes)."""
    device: NonEmpty = "cpu"
    """Torch device of the trainer ('cpu', 'cuda'); deepspeed ranks on 'cuda' use cuda:<local rank>."""
    threads: PositiveInt | None = None
    """CPU threads of this trainer on device 'cpu' (torch intra-op threads); None: `jet up` gives it its
    share of the cores (jet.cli.up.thread_shares), a trainer started alone keeps torch's default."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of forward/backward: 'bfloat16' autocasts over float32 master weights (torch backend,
    CPU or CUDA) or runs DeepSpeed's bf16 mode (its optimiser keeps float32 master weights); logprobs stay
    float32; published weights are written in this dtype (checkpoints keep float32)."""
    lease_s: PositiveFloat = 600.0
    """Lease on consumed trajectories, held (and renewed) until a checkpoint makes their step durable (s)."""
    keep_checkpoints: PositiveInt = 2
    """Checkpoints kept in the run folder; older ones are deleted once a newer one is whole (count)."""
    keep_weights: PositiveInt = 3
    """Published weight versions kept in runs/<run>/weights/<model>; an older one is deleted only when no
    live inference worker serves it or anything older (versions)."""
    seed: NonNegativeInt = 0
    """Seed of torch, numpy and the dataset order (integer)."""
    mix_wait_s: NonNegativeFloat = 30.0
    """Longest wait for a task with no ready group before a step is filled with other tasks' groups (s)."""
    loggers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["jsonl", "tensorboard"])
    """Metric sinks of rank 0: jsonl (metrics.jsonl, read by `jet dash` and `jet plot`), tensorboard (when
    installed), wandb ($WANDB_PROJECT, $WANDB_MODE, ...), mlflow ($MLFLOW_TRACKING_URI, else a local store)."""
    overlong: Literal["truncate", "dead_letter"] = "truncate"
    """A trajectory with a token whose context exceeds micro_batch_tokens: 'truncate' trains the tokens whose
    context fits and drops the rest (counted), 'dead_letter' sends the whole trajectory to `dead`."""

    @field_validator("loggers")
    @classmethod
    def _distinct(cls, loggers: list[str]) -> list[str]:
        if len(set(loggers)) != len(loggers):
            raise ValueError(f"duplicate logger in {loggers}")
        return loggers

    @field_validator("adam_betas")
    @classmethod
    def _betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"each beta must be in [0, 1), got {list(betas)}")
        return betas

    @model_validator(mode="after")
    def _correction(self) -> TrainerConfig:
        # the band must hold 1, so fresh tokens (current == behaviour) keep weight 1 in every mode
        if self.is_cap < 1:
            raise problem("is_cap", f"must be >= 1, got {self.is_cap}")
        if self.is_floor is not None and self.is_floor > 1:
            raise problem("is_floor", f"must be <= 1, got {self.is_floor}")
        if self.objective == "ppo" and self.rollout_correction not in ("token_truncate", "none"):
            raise problem("rollout_correction", f"{self.rollout_correction!r} weights the decoupled objective's "
                          "behaviour gap; objective 'ppo' clips against the behaviour policy and takes no weight "
                          "(use objective 'decoupled', or rollout_correction 'token_truncate' or 'none')")
        if self.rollout_correction.startswith("sequence") and self.backend == "deepspeed" and self.nproc > 1:
            raise problem("rollout_correction", f"{self.rollout_correction!r} needs each token's episode on every "
                          "rank, which only rank 0 has: use one trainer process or a token mode")
        return self


class JetConfig(Section):
    run: RunName = "default"
    """Run name: the Redis key namespace jet:{<run>}: and the folder <runs_dir>/<run>."""
    runs_dir: NonEmpty = "runs"
    """Folder holding one subfolder per run (relative to the current directory)."""
    queues: QueueConfig = Field(default_factory=QueueConfig)
    """Redis Streams settings shared by every role."""
    models: list[ModelConfig] = Field(default_factory=list)
    """Models served for inference and, when trainable, trained."""
    tasks: list[TaskConfig] = Field(default_factory=list)
    """Tasks: a workflow, a reward and a dataset each."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Optimisation settings."""

    @field_validator("models", "tasks")
    @classmethod
    def _unique(cls, items: list, info: ValidationInfo) -> list:
        names = [x.name for x in items]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise problem(f"[{i}].name", f"duplicate name {name!r} (also {info.field_name}[{names.index(name)}])")
        return items

    @field_validator("tasks")
    @classmethod
    def _task_models(cls, tasks: list[TaskConfig], info: ValidationInfo) -> list[TaskConfig]:
        if "models" not in info.data:  # the models failed; that error is reported
            return tasks
        names = [m.name for m in info.data["models"]]
        out = []
        for i, task in enumerate(tasks):
            if task.model is None:
                if len(names) != 1:
                    raise problem(f"[{i}].model", f"required unless exactly one model is configured ({len(names)} are)")
                task = task.model_copy(update={"model": names[0]})
            if task.model not in names:
                raise problem(f"[{i}].model", f"unknown model {task.model!r}; configured: "
                                              f"{', '.join(map(repr, names)) or 'none'}")
            out.append(task)
        if out and sum(t.weight for t in out) <= 0:
            raise problem("", "at least one task needs weight > 0")
        return out

    @model_validator(mode="after")
    def _cross_checks(self) -> JetConfig:
        for i, m in enumerate(self.models):
            tc = self._merged_trainer(m, f"models[{i}].trainer")  # validates the override's keys, types and ranges
        for i, task in enumerate(self.tasks):
            if task.group_size < self.trainer.min_group_size:
                raise problem(f"tasks[{i}].group_size",
                              f"{task.group_size} is below trainer.min_group_size ({self.trainer.min_group_size})")
        return self

    @property
    def run_dir(self) -> Path:
        """The folder of this run: `<runs_dir>/<run>`."""
        return Path(self.runs_dir) / self.run

    def model(self, name: str) -> ModelConfig:
        """The model called `name` (KeyError if none)."""
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def trainer_of(self, name: str) -> TrainerConfig:
        """The trainer settings of model `name`: its `trainer` override merged over the top-level section."""
        return self._merged_trainer(self.model(name), "")

    def _merged_trainer(self, m: ModelConfig, path: str) -> TrainerConfig:
        if not m.trainer:
            return self.trainer
        for key in m.trainer:
            if key not in TrainerConfig.model_fields:
                raise problem(f"{path}.{key}", "unknown trainer setting" + hint(str(key), TrainerConfig.model_fields))
        try:
            return TrainerConfig.model_validate({**dump(self.trainer), **m.trainer})
        except ValidationError as err:
            e = configlib.translate(err, TrainerConfig, path)
            raise problem(e.key, e.reason) from None

    def serving_groups(self) -> list[list[str]]:
        """The models each inference worker serves, in config order: models that train an adapter of one base
        (same path, backend, device and dtype; `adapter.publish: adapter`; `adapter.share_base`) together,
        every other model alone."""
        groups: dict[object, list[str]] = {}
        for m in self.models:
            a = m.adapter
            shared = a is not None and a.share_base and a.publish == "adapter"
            key = ("base", m.path, m.backend, m.device, m.dtype) if shared else ("alone", m.name)
            groups.setdefault(key, []).append(m.name)
        return list(groups.values())

    def task(self, name: str) -> TaskConfig:
        """The task called `name` (KeyError if none)."""
        for t in self.tasks:
            if t.name == name:
                return t
        raise KeyError(name)


# ---- loading


def default_config_path() -> Path:
    """The default config, shipped in the package: what `--config` reads when it is not given."""
    return Path(str(importlib.resources.files("jet").joinpath("configs", "default.yaml")))


def _packaged(path: Path) -> bool:
    return path.resolve().is_relative_to(Path(str(importlib.resources.files("jet"))).resolve())


def load(data: dict, path: str = "") -> JetConfig:
    """A JetConfig from a dict (as YAML gives it), validated. No file paths are resolved."""
    return configlib.validate(JetConfig, data, path)


def load_file(path: str | os.PathLike, overrides: Iterable[str] = (), *, check_paths: bool = False) -> JetConfig:
    """Read, override (`["trainer.lr=1e-5", "tasks.0.weight=2"]`), validate and resolve a config file.

    Relative model, dataset and runtime paths are resolved against the file's
    folder (against the working folder for a config inside the package); with
    `check_paths` they must exist. Every error names the file.
    """
    path = Path(path)
    data = configlib.read_yaml(path)
    try:
        configlib.apply_overrides(JetConfig, data, overrides)
        cfg = _resolve_paths(load(data), Path.cwd() if _packaged(path) else path.parent.resolve())
        if check_paths:
            _check_paths(cfg)
    except ConfigError as err:
        raise invalid(err.key, err.reason, str(path)) from None
    return cfg


def _resolve_paths(cfg: JetConfig, base: Path) -> JetConfig:
    def resolve(p: str) -> str:
        return str((base / Path(p).expanduser()).resolve())

    def model(p: str) -> str:  # a Hub id stays as it is unless a folder of that name is there
        return resolve(p) if (hub_id(p) is None and not is_builtin(p)) or (base / p).exists() else p

    def dataset(d: str) -> str:  # a file or folder resolved, its '?query' kept; a Hub id as it is
        where, _, query = d.partition("?")
        if not is_dataset_path(d) or (rows.kind(d) == "hf" and hub_id(where) and not (base / where).exists()):
            return d
        return resolve(where) + (f"?{query}" if query else "")

    models = [m.model_copy(update={"path": model(m.path)}) for m in cfg.models]
    tasks = []
    for t in cfg.tasks:
        python = t.runtime.python
        if python and ("/" in python or os.sep in python):  # a path, not a command on PATH
            python = os.path.abspath(base / Path(python).expanduser())  # keeps symlinks: a venv's python links
        runtime = t.runtime.model_copy(update={"python": python,
                                               "cwd": resolve(t.runtime.cwd) if t.runtime.cwd else None})
        ev = t.eval and t.eval.model_copy(update={"dataset": t.eval.dataset and dataset(t.eval.dataset)})
        tasks.append(t.model_copy(update={"dataset": dataset(t.dataset), "runtime": runtime, "eval": ev}))
    return cfg.model_copy(update={"models": models, "tasks": tasks})


def check_models(cfg: JetConfig, names: Iterable[str] | None = None) -> JetConfig:
    """The config with each model named (every model when None) at its local folder: a Hub id resolved
    by `jet.sources.resolve_model`; else a ConfigError naming `models[i].path`. A role calls it before
    loading a model, so a wrong path is one line, and loads the folder it returns."""
    wanted = None if names is None else set(names)
    models = [m.model_copy(update={"path": resolve_model(m.path, f"models[{i}].path")})
              if wanted is None or m.name in wanted else m for i, m in enumerate(cfg.models)]
    return cfg.model_copy(update={"models": models})


def pins(cfg: JetConfig, resolved: JetConfig) -> tuple[str, ...]:
    """`--set` overrides pinning each Hub model of `cfg` to the commit `resolved` (check_models) found,
    for the processes a role starts: they load the same weights even when the branch moves meanwhile."""
    return tuple(f"models.{i}.path={pin}" for i, (m, r) in enumerate(zip(cfg.models, resolved.models))
                 if (pin := pinned(m.path, r.path)))


def _check_paths(cfg: JetConfig) -> None:
    check_models(cfg)
    for i, t in enumerate(cfg.tasks):
        named = [(f"tasks[{i}].dataset", t.dataset), (f"tasks[{i}].eval.dataset", t.eval and t.eval.dataset)]
        for key, dataset in named:
            where = (dataset or "").partition("?")[0]
            if dataset and rows.kind(dataset) in rows.FILE_KINDS.values() and not Path(where).is_file():
                raise invalid(key, f"no such file {dataset!r}")
            if dataset and rows.kind(dataset) == "hf" and os.path.isabs(where) and not Path(where).is_dir():
                raise invalid(key, f"no such dataset folder {where!r}")
        if t.runtime.cwd and not Path(t.runtime.cwd).is_dir():
            raise invalid(f"tasks[{i}].runtime.cwd", f"no such directory {t.runtime.cwd!r}")
        python = t.runtime.python
        if python and os.path.isabs(python) and not Path(python).is_file():
            raise invalid(f"tasks[{i}].runtime.python", f"no such file {python!r}")


def dump(cfg: Section) -> dict:
    """The config (or any section) as plain dicts and lists; `load(dump(cfg)) == cfg`."""
    return configlib.dump(cfg)


def write_resolved(cfg: JetConfig, run_dir: str | os.PathLike) -> Path:
    """Write `<run_dir>/config.resolved.yaml`, every field spelled out, and return its path."""
    header = "# Resolved Jet config of this run: every field, defaults and --set overrides applied.\n"
    return configlib.write_yaml(dump(cfg), RunDir.at(run_dir).resolved_config, header)


def redis_url(cli: str | None = None) -> str | None:
    """The Redis URL: the CLI's `--redis-url` if given, else $JET_REDIS_URL, else None (embedded server)."""
    return cli or os.environ.get(REDIS_URL_ENV) or None
