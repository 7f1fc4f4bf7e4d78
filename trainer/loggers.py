"""Where the trainer's metrics go besides metrics.jsonl: TensorBoard, Weights & Biases, MLflow.

What it is: one small sink per `trainer.loggers` entry, each with `log(step,
values)` and `close()`, opened by `open_sinks` for `jet.trainer.metrics.Metrics`:
- tensorboard: a SummaryWriter in `<trainer folder>/tensorboard`; a resume
  passes purge_step, so TensorBoard hides the lost steps as the JSONL drops
  them. Skipped with a warning when the tensorboard package is missing (it is
  in the defaults);
- wandb: `wandb.init` with project $WANDB_PROJECT (default "jet"), group = the
  run, name = run/model, the resolved config, files under the trainer folder;
  every other W&B setting ($WANDB_MODE=offline, $WANDB_ENTITY, $WANDB_API_KEY)
  is W&B's own. Values are logged against the metric `trainer/step`, not W&B's
  internal step, so steps redone after a resume are recorded, not refused;
- mlflow: an MlflowClient on $MLFLOW_TRACKING_URI, else a file store in
  `<trainer folder>/mlruns` (MLflow 3 keeps file stores in maintenance mode and
  wants MLFLOW_ALLOW_FILE_STORE=true, which is then set for this process);
  experiment $MLFLOW_EXPERIMENT_NAME or the run's name, run name run/model;
  metric names keep their namespace slash, deeper slashes become dots (`MLflow.key`).

Resumption: the W&B id and the MLflow run id are written to
`<trainer folder>/loggers.json` before the first value is logged, and a
restarted trainer (resumed or not) continues those runs: one Jet trainer folder
is one W&B run and one MLflow run. W&B's service buffers its writes, so a
SIGKILLed trainer's last steps may never reach W&B; the resumed trainer logs
again the checkpointed steps after the last clean close (`WandB._backfill`).

What it is not: rank-aware. Only rank 0 builds a Metrics, hence sinks.
A requested wandb or mlflow that is not installed is an error naming the extra.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path
from typing import Iterable

import orjson

from jet.errors import ConfigError
from jet.runs import TrainerFiles, read_metrics

log = logging.getLogger(__name__)

IDS = "loggers.json"


def _ids(folder: Path) -> dict:
    try:
        return orjson.loads((folder / IDS).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}


def _save_id(folder: Path, key: str, value: str) -> None:
    ids = {**_ids(folder), key: value}
    tmp = folder / f".{IDS}.tmp"
    tmp.write_bytes(orjson.dumps(ids, option=orjson.OPT_INDENT_2))
    os.replace(tmp, folder / IDS)


class TensorBoard:
    def __init__(self, folder: Path, purge_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(str(TrainerFiles(folder).tensorboard), purge_step=purge_step)

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.w.add_scalar(k, v, step)

    def close(self) -> None:
        self.w.close()


class WandB:
    STEP = "trainer/step"

    def __init__(self, folder: Path, name: str, group: str, config: dict | None, resume_step: int | None,
                 lines: Path):
        try:
            import wandb
        except ImportError:
            raise ConfigError("trainer.loggers: 'wandb' needs the wandb package (pip install 'jet-rl[wandb]')") from None
        ids = _ids(folder)
        run_id = ids.get("wandb")
        if not run_id:
            run_id = uuid.uuid4().hex[:16]  # W&B ids: letters and digits
            _save_id(folder, "wandb", run_id)
        self.folder, self.last = folder, ids.get("wandb_closed", 0)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "jet"), id=run_id, resume="allow", name=name,
                              group=group, dir=str(folder), config=config or {})
        self.run.define_metric(self.STEP)
        self.run.define_metric("*", step_metric=self.STEP)
        self._backfill(lines, resume_step)

    def _backfill(self, lines: Path, resume_step: int | None) -> None:
        """Log again the kept steps after the last clean close: W&B's service buffers what it writes
        and loses it when the trainer is SIGKILLed (measured offline: a log of 4 steps held nothing),
        so the steps a checkpoint kept would be a hole in the run. Steps that did reach W&B (online,
        or a buffer that filled) are then recorded twice, like steps redone after a resume."""
        if not resume_step or resume_step <= self.last or not lines.is_file():
            return
        for row in read_metrics(lines):
            if self.last < row.get("step", 0) <= resume_step:
                self.log(int(row["step"]), {k: v for k, v in row.items() if k not in ("step", "time")
                                            and isinstance(v, (int, float)) and not isinstance(v, bool)})

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({self.STEP: step, **values})
        self.last = step

    def close(self) -> None:
        self.run.finish()
        _save_id(self.folder, "wandb_closed", self.last)  # everything up to here is in W&B


class MLflow:
    def __init__(self, folder: Path, name: str, experiment: str, config: dict | None):
        try:
            from mlflow.entities import Metric, RunStatus
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError("trainer.loggers: 'mlflow' needs MLflow (pip install 'jet-rl[mlflow]')") from None
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (folder / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.Metric, self.client = Metric, MlflowClient(tracking_uri=uri)
        run_id = _ids(folder).get("mlflow")
        if run_id:
            try:
                self.client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            except MlflowException as e:  # the store was moved or wiped: start a new run, say so
                log.warning("MLflow run %s not found in %s (%s): starting a new one", run_id, uri, e)
                run_id = None
        if not run_id:
            exp = self.client.get_experiment_by_name(os.environ.get("MLFLOW_EXPERIMENT_NAME") or experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(
                os.environ.get("MLFLOW_EXPERIMENT_NAME") or experiment)
            run_id = self.client.create_run(exp_id, run_name=name).info.run_id
            _save_id(folder, "mlflow", run_id)
            if config is not None:
                self.client.log_dict(run_id, config, "config.resolved.json")
        self.run_id = run_id

    @staticmethod
    def key(name: str) -> str:
        """`counts/groups_trained/guess` -> `counts/groups_trained.guess`: the namespace keeps its
        slash, deeper ones become dots, because MLflow's file store keeps a metric as a file named by
        its path and so cannot hold both `counts/groups_trained` and `counts/groups_trained/guess`."""
        head, _, rest = name.partition("/")
        return f"{head}/{rest.replace('/', '.')}" if rest else head

    def log(self, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.Metric(self.key(k), v, now, step) for k, v in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_sinks(names: Iterable[str], folder: Path, *, resume_step: int | None, name: str,
               config: dict | None = None, lines: Path | None = None) -> list:
    """The sinks for `names` other than jsonl (Metrics writes that itself), in order; `lines` is the
    metrics.jsonl already truncated to the resumed lineage (a W&B backfill reads it)."""
    lines = lines or TrainerFiles(folder).metrics
    group = name.split("/", 1)[0]
    sinks = []
    for n in names:
        if n == "tensorboard":
            try:
                sinks.append(TensorBoard(folder, None if resume_step is None else resume_step + 1))
            except ImportError:  # torch.utils.tensorboard needs the tensorboard package
                log.info("trainer.loggers: tensorboard is not installed; not logging to TensorBoard")
        elif n == "wandb":
            sinks.append(WandB(folder, name, group, config, resume_step, lines))
        elif n == "mlflow":
            sinks.append(MLflow(folder, name, group, config))
        elif n != "jsonl":
            raise ConfigError(f"trainer.loggers: unknown logger {n!r}")
    return sinks
