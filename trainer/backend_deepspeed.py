"""The `deepspeed` training backend: ZeRO (stage 0-3) data parallelism over N processes.

What it is: the `torch` backend's interface (`train_step`, `full_module`,
`save`, `load`) on a DeepSpeed engine wrapping the same policy and the same
AdamW (a client optimiser, hence `zero_allow_untested_optimizer`), running
the same `jet.trainer.step.accumulate` on this rank's share of the rows
(`jet.trainer.dist.Comm.mine`). It runs on GPUs (nccl) and on CPU (gloo),
which is how the tests run it.

How a step maps onto DeepSpeed: `gradient_accumulation_steps` is 1 and the
accumulation boundary is set by hand (False until the step's last
micro-batch), so a step may have any number of micro-batches; `backward` is
told not to divide by the accumulation steps; and since ZeRO averages
gradients over ranks while our loss is a sum over the whole step, each rank
scales its micro-batch losses by the world size. The step's gradient is then
exactly the single-process one. Clipping is DeepSpeed's `gradient_clipping`,
and the reported norm is `get_global_grad_norm()` (before clipping).

Checkpoints are DeepSpeed's own (`save_checkpoint`, one shard per rank, which
pickles: the one exception to "no pickle on disk", confined to the run's
checkpoint folder) plus this rank's RNG state as safetensors.

With `adapter` (`models[].adapter`) the policy is wrapped in a LoRA adapter
before DeepSpeed sees it (`jet.trainer.adapter`, as the torch backend does): the
optimiser, and so ZeRO's partitioned state, holds the adapter's parameters only;
checkpoints leave the frozen base out (`exclude_frozen_parameters`) and record
the adapter's settings (`backend.json`: a checkpoint of another adapter shape,
or of full training, is refused with the reason); `full_module` gives what the
torch backend publishes (the adapter alone, or merged).
"""

from __future__ import annotations

import contextlib
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Iterator, Sequence

import torch

from jet.config import AdapterConfig, TrainerConfig
from jet.trainer import optim
from jet.trainer.adapter import AdapterOnly, Merged, trainable, wrap
from jet.trainer.backend_torch import frozen_copy, load_policy
from jet.trainer.batch import StepInputs
from jet.trainer.dist import Comm
from jet.trainer.packing import Row
from jet.trainer.step import StepStats, accumulate, sequence_level

TAG = "deepspeed"
DIST_TIMEOUT = timedelta(hours=24)  # rank 0 may wait long for trajectories while the others wait on it


def init_distributed(device: str) -> Comm:
    """Join the process group the launcher set up (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)."""
    import deepspeed

    backend = "nccl" if device.startswith("cuda") else "gloo"
    if not torch.distributed.is_initialized():
        if backend == "nccl":  # collectives (and nccl's own set-up) on this rank's GPU
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        deepspeed.init_distributed(dist_backend=backend, timeout=DIST_TIMEOUT)
    return Comm.of_process_group()


def ds_config(cfg: TrainerConfig, world: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 62,
        "wall_clock_breakdown": False,
    }


class DeepSpeedBackend:
    def __init__(self, model_path: str, cfg: TrainerConfig, comm: Comm, device: str | None = None,
                 adapter: AdapterConfig | None = None):
        import deepspeed

        self.cfg, self.comm = cfg, comm
        self.rank, self.world = comm.rank, comm.world
        if sequence_level(cfg) and self.world > 1:  # `jet train --nproc N` overrides what jet.config checked
            raise ValueError(f"trainer.rollout_correction {cfg.rollout_correction!r} needs each token's episode "
                             f"on every rank, which only rank 0 has ({self.world} ranks): use a token mode")
        device = device or cfg.device
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(device)
        self.device = device
        torch.manual_seed(cfg.seed)
        model = load_policy(model_path, device)
        self.ref = frozen_copy(model) if cfg.kl_coef > 0 else None
        self.adapter = adapter
        if adapter is not None:
            torch.manual_seed(cfg.seed)  # the adapter's initial A: the same on every rank, and as the torch backend's
            model = wrap(model, adapter)
        optimizer = optim.make_adamw(trainable(model), cfg)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                                 config=ds_config(cfg, self.world))
        self.engine.eval()  # dropout off, as in the torch backend and on the inference side

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.module

    def train_step(self, rows: Sequence[Row | None], inputs: StepInputs, lr: float, pad_row: Row | None = None
                   ) -> StepStats:
        def backward(loss: torch.Tensor, last: bool) -> None:
            self.engine.set_gradient_accumulation_boundary(last)
            self.engine.backward(loss, scale_wrt_gas=False)

        stats = accumulate(self.engine, rows, inputs, self.cfg, backward, ref_model=self.ref,
                           scale=float(self.world), pad_row=pad_row)
        optim.set_lr(self.optimizer, lr)
        self.engine.step()
        stats.set_from(self.comm.sum(stats.as_tensor()))
        stats.ratio_max = self.comm.max(stats.ratio_max)
        norm = self.engine.get_global_grad_norm()
        stats.grad_norm = float(norm) if norm is not None else 0.0
        return stats

    @contextlib.contextmanager
    def full_module(self) -> Iterator[torch.nn.Module]:
        """The module with whole parameters (gathered on every rank under ZeRO-3)."""
        published = self.model if self.adapter is None else \
            AdapterOnly(self.model) if self.adapter.publish == "adapter" else Merged(self.model)
        if self.cfg.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None):
                yield published
        else:
            yield published

    def _adapter_meta(self) -> dict | None:
        return None if self.adapter is None else self.adapter.model_dump(mode="json")

    def save(self, folder: Path) -> None:
        self.engine.save_checkpoint(str(folder), tag=TAG, save_latest=False,
                                    exclude_frozen_parameters=self.adapter is not None)
        rng, meta = optim.rng_state()
        optim.save_tensors(rng, folder / f"rng-{self.rank}.safetensors")
        (folder / f"rng-{self.rank}.json").write_text(json.dumps(meta))
        if self.rank == 0:
            (folder / "backend.json").write_text(json.dumps({"adapter": self._adapter_meta()}))

    def load(self, folder: Path) -> None:
        meta = json.loads((folder / "backend.json").read_text()) if (folder / "backend.json").is_file() else {}
        if meta.get("adapter") != self._adapter_meta():
            raise ValueError(f"checkpoint {folder} was written with adapter {meta.get('adapter')}, "
                             f"this trainer has {self._adapter_meta()} (models[].adapter)")
        self.engine.load_checkpoint(str(folder), tag=TAG, load_optimizer_states=True,
                                    load_lr_scheduler_states=False, load_module_strict=self.adapter is None)
        rng = folder / f"rng-{self.rank}.safetensors"
        if rng.is_file():
            optim.set_rng_state(optim.load_tensors(rng), json.loads((folder / f"rng-{self.rank}.json").read_text()))
