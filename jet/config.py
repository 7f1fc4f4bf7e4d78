"""Jet's configuration schema: one YAML file per experiment, loaded into frozen dataclasses.

`load_file("configs/default.yaml", overrides=["trainer.lr=1e-5"])` reads the file,
applies `--set` overrides, validates every key, type and range (errors name the
path: `trainer.lr: expected float, got 'fast'`) and resolves relative file
paths against the config file's folder. `write_resolved` stores the result in
the run folder so a run can be reproduced. The machinery is in `jet.configlib`.

What is not here: secrets. The Redis URL (and its password) comes from the
environment (`JET_REDIS_URL`) or the CLI; a config file that names one is refused.
Every field carries a one-line comment: what it does, and its unit.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

from jet import configlib
from jet.configlib import invalid, non_negative, positive, require
from jet.errors import ConfigError
from jet.keys import check_name

__all__ = [
    "JetConfig", "QueueConfig", "ModelConfig", "TaskConfig", "RuntimeConfig", "TrainerConfig",
    "load", "load_file", "dump", "write_resolved", "redis_url", "REDIS_URL_ENV", "RESOLVED_NAME",
]

REDIS_URL_ENV = "JET_REDIS_URL"
RESOLVED_NAME = "config.resolved.yaml"

# Streams whose length `queues.maxlen` may bound (the kinds of `jet.keys.Keys`).
STREAM_KINDS = ("tasks", "gen", "reply", "traj", "weights", "dead", "events")
# Approximate caps (XADD MAXLEN ~) for the busy streams; a kind left out of the file keeps its default.
DEFAULT_MAXLEN = {"tasks": 100_000, "gen": 10_000, "traj": 10_000}

_FUNCTION = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def _name(kind: str, value: str, key: str = "name") -> None:
    """`jet.keys.check_name` with its ValueError turned into a ConfigError naming `key`."""
    try:
        check_name(kind, value)
    except ValueError as err:
        raise invalid(key, str(err)) from None


def _function(value: str | None, key: str) -> None:
    require(value is None or bool(_FUNCTION.match(value)), key,
            f"expected 'module:function' (e.g. 'jet.tasks.guess:workflow'), got {value!r}")


def _is_path(dataset: str) -> bool:
    """A dataset is a JSONL file when it looks like one; otherwise a built-in dataset name."""
    return dataset.endswith(".jsonl") or "/" in dataset or os.sep in dataset


@dataclass(frozen=True, slots=True)
class QueueConfig:
    # Lease on a read message (ms): past it, the reaper may hand the message to another consumer.
    lease_ms: int = 30_000
    # Deliveries (first read + reclaims) before a message goes to the dead-letter stream.
    max_deliveries: int = 5
    # Blocking read timeout (ms) of XREADGROUP; 1-5 s keeps shutdown prompt without busy polling.
    block_ms: int = 2_000
    # Entries fetched per read (count).
    batch: int = 64
    # Approximate max length (entries) per stream kind; kinds not given keep DEFAULT_MAXLEN or are unbounded.
    maxlen: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_MAXLEN))
    # Lifetime (s) of the idempotency markers (done/sent); must outlive any redelivery.
    marker_ttl_s: int = 21_600
    # Largest encoded entry accepted by the codec (bytes).
    max_entry_bytes: int = 16 * 1024 * 1024

    def __post_init__(self):
        positive(self, "lease_ms", "max_deliveries", "block_ms", "batch", "marker_ttl_s", "max_entry_bytes")
        require(self.block_ms < self.lease_ms, "block_ms",
                f"must be below lease_ms ({self.lease_ms}), got {self.block_ms}")
        for kind, length in self.maxlen.items():
            close = difflib.get_close_matches(kind, STREAM_KINDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; one of {', '.join(STREAM_KINDS)}"
            require(kind in STREAM_KINDS, f"maxlen.{kind}", f"unknown stream kind{hint}")
            require(length > 0, f"maxlen.{kind}", f"must be > 0, got {length}")
        object.__setattr__(self, "maxlen", {**DEFAULT_MAXLEN, **self.maxlen})


@dataclass(frozen=True, slots=True)
class ModelConfig:
    # Model name: key namespace of its gen/traj/weights streams, referenced by tasks[].model.
    name: str
    # HF model directory (config + weights + tokenizer); relative paths are against the config file's folder.
    path: str
    # Inference backend: 'hf' (transformers, CPU or GPU) or 'vllm' (GPU).
    backend: Literal["hf", "vllm"] = "hf"
    # Whether the trainer updates this model; False serves it frozen (a judge, an opponent).
    trainable: bool = True
    # Torch device of the inference worker ('cpu', 'cuda', 'cuda:1').
    device: str = "cpu"
    # Unused since the inference worker serves per request (max_inflight); accepted for old configs.
    max_batch: int = 16
    # Inference dtype; float32 gives the logprobs a float32 trainer recomputes (bfloat16 is faster on GPUs).
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Generation requests one inference worker decodes at once, each answered as it completes (requests).
    max_inflight: int = 64
    # Folders weight announcements may point into besides <runs_dir>/<run>/weights/<model> (paths).
    weights_roots: list[str] = field(default_factory=list)
    # This model's trainer settings over the top-level `trainer` section (e.g. {lr: 1e-4, seed: 1}).
    trainer: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        _name("model", self.name)
        require(bool(self.path), "path", "must not be empty")
        require(bool(self.device), "device", "must not be empty")
        positive(self, "max_batch")
        positive(self, "max_inflight")


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    # Python interpreter running the workflow (a path or a command on PATH); None = the env worker's own.
    python: str | None = None
    # Working directory of the workflow; relative to the config file's folder; None = the worker's own.
    cwd: str | None = None


@dataclass(frozen=True, slots=True)
class TaskConfig:
    # Task name: key namespace of its tasks stream, and the name in metrics.
    name: str
    # Episode function as 'module:function'; it talks to the model and returns the episode.
    workflow: str
    # Dataset rows: a built-in dataset name, or a JSONL file (relative to the config file's folder).
    dataset: str
    # Reward function as 'module:function'; None when the workflow returns the reward itself.
    reward: str | None = None
    # Episodes per dataset row; advantages are computed within a group (episodes).
    group_size: int = 4
    # Mixing ratio of this task's rows among all tasks (relative weight, >= 0).
    weight: float = 1.0
    # Wall-clock limit of one episode (s); past it the episode fails and may be retried.
    episode_timeout_s: float = 120.0
    # Retries of a failed episode before the group is trained without it (count).
    max_retries: int = 2
    # Episodes run at once by one env worker process (episodes).
    concurrency: int = 8
    # Turn merging of multi-turn episodes: 'exact' prefix match, 'tree' shared prefixes, 'none' one sample per turn.
    merge: Literal["exact", "tree", "none"] = "exact"
    # Process the workflow runs in (interpreter, working directory).
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    # Name of the model the workflow talks to; None = the only configured model.
    model: str | None = None

    def __post_init__(self):
        _name("task", self.name)
        _function(self.workflow, "workflow")
        _function(self.reward, "reward")
        require(bool(self.dataset), "dataset", "must not be empty")
        if not _is_path(self.dataset):
            _name("dataset", self.dataset, "dataset")
        positive(self, "group_size", "episode_timeout_s", "concurrency")
        non_negative(self, "weight", "max_retries")


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    # Peak learning rate of AdamW (per step).
    lr: float = 1e-5
    # Groups (dataset rows x group_size episodes) per optimiser step.
    batch_groups: int = 8
    # Token budget of one forward/backward micro-batch (tokens, padding included).
    micro_batch_tokens: int = 8192
    # Oldest policy version accepted for a trajectory, counted back from the current one (versions).
    max_staleness: int = 4
    # Publish new weights to the inference workers every N optimiser steps (steps).
    publish_every: int = 1
    # Save a checkpoint to the run folder every N steps; 0 = only at the end (steps).
    checkpoint_every: int = 50
    # PPO ratio clipping range (dimensionless, ratio in [1 - eps, 1 + eps]).
    clip_eps: float = 0.2
    # Weight of the KL penalty against the reference model; 0 = no reference model (dimensionless).
    kl_coef: float = 0.0
    # 'decoupled' clips the ratio against the current (proximal) policy and corrects staleness with a
    # truncated importance weight (AReaL, arXiv:2505.24298); 'ppo' clips against the behaviour policy, which
    # loses reward at equal steps on stale batches (`jet bench staleness`). Equal on fresh batches.
    objective: Literal["ppo", "decoupled"] = "decoupled"
    # Cap of the decoupled objective's importance weight current/behaviour (dimensionless, >= 1).
    is_cap: float = 2.0
    # Advantage estimator: 'grpo' (mean/std in group), 'rloo' (leave-one-out), 'no_std' (mean only, Dr. GRPO).
    advantage: Literal["grpo", "rloo", "no_std"] = "grpo"
    # Loss aggregation: 'token_mean' over all tokens of the batch, 'seq_mean' per sequence then mean.
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    # Max global gradient norm; 0 = no clipping (L2 norm).
    grad_clip: float = 1.0
    # Linear learning-rate warmup (steps).
    warmup_steps: int = 0
    # Learning rate after warmup: 'constant', or decayed to 0 at `steps` ('linear', 'cosine').
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    # AdamW decoupled weight decay (fraction of the weight per unit of lr).
    weight_decay: float = 0.0
    # Optimiser steps of the run (steps).
    steps: int = 100
    # Fewest finished episodes a group needs to be trained on after group_timeout_s (episodes).
    min_group_size: int = 2
    # Wait for a group's missing episodes before training on what arrived (s).
    group_timeout_s: float = 300.0
    # Optimiser backend: 'torch' (one process) or 'deepspeed' (ZeRO, multi-GPU).
    backend: Literal["torch", "deepspeed"] = "torch"
    # DeepSpeed ZeRO stage, used when backend is 'deepspeed' (0-3).
    zero_stage: Literal[0, 1, 2, 3] = 2
    # Trainer processes (data-parallel ranks) when backend is 'deepspeed' (processes).
    nproc: int = 1
    # Torch device of the trainer ('cpu', 'cuda'); deepspeed ranks on 'cuda' use cuda:<local rank>.
    device: str = "cpu"
    # Compute dtype of forward/backward: 'bfloat16' autocasts over float32 master weights (torch backend)
    # or runs DeepSpeed's bf16 mode (its optimiser keeps float32 master weights); logprobs stay float32.
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Lease on consumed trajectories, held (and renewed) until a checkpoint makes their step durable (s).
    lease_s: float = 600.0
    # Checkpoints kept in the run folder; older ones are deleted (count).
    keep_checkpoints: int = 2
    # Seed of torch, numpy and the dataset order (integer).
    seed: int = 0
    # Longest wait for a task with no ready group before a step is filled with other tasks' groups (s).
    mix_wait_s: float = 30.0
    # Metric sinks of rank 0: jsonl (metrics.jsonl, read by `jet dash` and `jet plot`), tensorboard (when
    # installed), wandb ($WANDB_PROJECT, $WANDB_MODE, ...), mlflow ($MLFLOW_TRACKING_URI, else a local store).
    loggers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = field(
        default_factory=lambda: ["jsonl", "tensorboard"])
    # A trajectory with a token whose context exceeds micro_batch_tokens: 'truncate' trains the tokens whose
    # context fits and drops the rest (counted), 'dead_letter' sends the whole trajectory to `dead`.
    overlong: Literal["truncate", "dead_letter"] = "truncate"

    def __post_init__(self):
        positive(self, "lr", "batch_groups", "micro_batch_tokens", "publish_every", "clip_eps", "steps", "is_cap",
                 "min_group_size", "group_timeout_s", "nproc", "lease_s", "keep_checkpoints")
        non_negative(self, "max_staleness", "checkpoint_every", "kl_coef", "grad_clip", "warmup_steps", "seed",
                     "weight_decay", "mix_wait_s")
        require(bool(self.device), "device", "must not be empty")
        require(len(set(self.loggers)) == len(self.loggers), "loggers", f"duplicate logger in {self.loggers}")


@dataclass(frozen=True, slots=True)
class JetConfig:
    # Run name: the Redis key namespace jet:{<run>}: and the folder <runs_dir>/<run>.
    run: str = "default"
    # Folder holding one subfolder per run (relative to the current directory).
    runs_dir: str = "runs"
    # Redis Streams settings shared by every role.
    queues: QueueConfig = field(default_factory=QueueConfig)
    # Models served for inference and, when trainable, trained.
    models: list[ModelConfig] = field(default_factory=list)
    # Tasks: a workflow, a reward and a dataset each.
    tasks: list[TaskConfig] = field(default_factory=list)
    # Optimisation settings.
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self):
        _name("run", self.run, "run")
        require(bool(self.runs_dir), "runs_dir", "must not be empty")
        _unique("models", [m.name for m in self.models])
        _unique("tasks", [t.name for t in self.tasks])
        for i, m in enumerate(self.models):
            self._merged_trainer(m, f"models[{i}].trainer")  # validates the override's keys, types and ranges
        names = [m.name for m in self.models]
        tasks = []
        for i, task in enumerate(self.tasks):
            if task.model is None:
                require(len(names) == 1, f"tasks[{i}].model",
                        f"required unless exactly one model is configured ({len(names)} are)")
                task = dataclasses.replace(task, model=names[0])
            require(task.model in names, f"tasks[{i}].model",
                    f"unknown model {task.model!r}; configured: {', '.join(map(repr, names)) or 'none'}")
            require(task.group_size >= self.trainer.min_group_size, f"tasks[{i}].group_size",
                    f"{task.group_size} is below trainer.min_group_size ({self.trainer.min_group_size})")
            tasks.append(task)
        require(not tasks or sum(t.weight for t in tasks) > 0, "tasks", "at least one task needs weight > 0")
        object.__setattr__(self, "tasks", tasks)

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
        return self._merged_trainer(self.model(name), "trainer")

    def _merged_trainer(self, m: ModelConfig, path: str) -> TrainerConfig:
        if not m.trainer:
            return self.trainer
        for key in m.trainer:
            _check_trainer_key(key, path)
        return configlib.load(TrainerConfig, {**configlib.dump(self.trainer), **m.trainer}, path)

    def task(self, name: str) -> TaskConfig:
        """The task called `name` (KeyError if none)."""
        for t in self.tasks:
            if t.name == name:
                return t
        raise KeyError(name)


def _check_trainer_key(key: Any, path: str) -> None:
    names = [f.name for f in dataclasses.fields(TrainerConfig)]
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    require(key in names, f"{path}.{key}", f"unknown trainer setting{hint}")


def _unique(section: str, names: list[str]) -> None:
    for i, name in enumerate(names):
        require(name not in names[:i], f"{section}[{i}].name",
                f"duplicate name {name!r} (also {section}[{names.index(name)}])")


# ---- loading


def load(data: dict, path: str = "") -> JetConfig:
    """A JetConfig from a dict (as YAML gives it), validated. No file paths are resolved."""
    return configlib.load(JetConfig, data, path)


def load_file(path: str | os.PathLike, overrides: Iterable[str] = (), *, check_paths: bool = False) -> JetConfig:
    """Read, override (`["trainer.lr=1e-5", "tasks.0.weight=2"]`), validate and resolve a config file.

    Relative model, dataset and runtime paths are resolved against the file's
    folder; with `check_paths` they must exist. Every error names the file.
    """
    path = Path(path)
    data = configlib.read_yaml(path)
    try:
        configlib.apply_overrides(JetConfig, data, overrides)
        cfg = _resolve_paths(load(data), path.parent.resolve())
        if check_paths:
            _check_paths(cfg)
    except ConfigError as err:
        raise invalid(err.key, err.reason, str(path)) from None
    return cfg


def _resolve_paths(cfg: JetConfig, base: Path) -> JetConfig:
    def resolve(p: str) -> str:
        return str((base / Path(p).expanduser()).resolve())

    models = [dataclasses.replace(m, path=resolve(m.path)) for m in cfg.models]
    tasks = []
    for t in cfg.tasks:
        python = t.runtime.python
        runtime = dataclasses.replace(
            t.runtime,
            # An interpreter path keeps its symlinks: a virtual env's python links to its base one.
            python=os.path.abspath(base / Path(python).expanduser()) if python and ("/" in python or os.sep in python)
            else python,
            cwd=resolve(t.runtime.cwd) if t.runtime.cwd else None,
        )
        dataset = resolve(t.dataset) if _is_path(t.dataset) else t.dataset
        tasks.append(dataclasses.replace(t, dataset=dataset, runtime=runtime))
    return dataclasses.replace(cfg, models=models, tasks=tasks)


def _check_paths(cfg: JetConfig) -> None:
    for i, m in enumerate(cfg.models):
        require(Path(m.path).is_dir(), f"models[{i}].path", f"no such model directory {m.path!r}"
                " (build the tiny model with `jet model init`)")
    for i, t in enumerate(cfg.tasks):
        if _is_path(t.dataset):
            require(Path(t.dataset).is_file(), f"tasks[{i}].dataset", f"no such file {t.dataset!r}")
        if t.runtime.cwd:
            require(Path(t.runtime.cwd).is_dir(), f"tasks[{i}].runtime.cwd", f"no such directory {t.runtime.cwd!r}")
        python = t.runtime.python
        if python and os.path.isabs(python):
            require(Path(python).is_file(), f"tasks[{i}].runtime.python", f"no such file {python!r}")


def dump(cfg: Any) -> dict:
    """The config (or any section) as plain dicts and lists; `load(dump(cfg)) == cfg`."""
    return configlib.dump(cfg)


def write_resolved(cfg: JetConfig, run_dir: str | os.PathLike) -> Path:
    """Write `<run_dir>/config.resolved.yaml`, every field spelled out, and return its path."""
    header = "# Resolved Jet config of this run: every field, defaults and --set overrides applied.\n"
    return configlib.write_yaml(dump(cfg), Path(run_dir) / RESOLVED_NAME, header)


def redis_url(cli: str | None = None) -> str | None:
    """The Redis URL: the CLI's `--redis-url` if given, else $JET_REDIS_URL, else None (embedded server)."""
    return cli or os.environ.get(REDIS_URL_ENV) or None
