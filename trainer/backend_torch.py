"""The `torch` training backend: one process, one device, plain AdamW.

What it is: the policy (a transformers causal LM loaded from the model
directory, float32, eval mode so dropout is off as on the inference side;
`trainer.dtype: bfloat16` autocasts its forward/backward to bfloat16),
an optional frozen reference copy for the KL term, AdamW, and:
`train_step(rows, inputs, lr)` (gradient accumulation over the micro-batches,
global-norm clipping, one optimiser step), `full_module()` (the module with
whole parameters, for publishing weights), and `save` / `load` of a
checkpoint directory: model.safetensors, optimizer.safetensors, rng.safetensors
and state.json. No pickle anywhere.

With `adapter` (`models[].adapter`) the policy is the base wrapped in a LoRA
adapter (`jet.trainer.adapter`): the optimiser holds the adapter's parameters
only, a checkpoint holds adapter.safetensors instead of model.safetensors (the
base is the model folder, unchanged), `full_module()` gives what a version
publishes (the adapter alone, or the base with it merged in), and the KL
reference is the base as loaded.

The `deepspeed` backend (`jet.trainer.backend_deepspeed`) has the same
interface and runs the same `jet.trainer.step.accumulate`.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from jet.config import AdapterConfig, TrainerConfig
from jet.trainer import optim
from jet.trainer.adapter import (ADAPTER_CHECKPOINT_FILE, AdapterOnly, Merged, adapter_tensors,
                                 load_adapter_tensors, trainable, wrap)
from jet.trainer.batch import StepInputs
from jet.trainer.packing import Row
from jet.trainer.step import StepStats, accumulate
from jet.wire import WEIGHTS_FILE



def load_policy(model_path: str, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model.to(device).eval()


def autocast(device: str | torch.device, dtype: str):
    """bfloat16 autocast on `device` when `dtype` is 'bfloat16' (float32 weights and optimiser), else nothing."""
    kind = torch.device(device).type
    return torch.autocast(device_type=kind, dtype=torch.bfloat16, enabled=dtype == "bfloat16")


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


class TorchBackend:
    rank, world = 0, 1
    retryable = True  # a failed train_step leaves nothing behind: the next one zeroes the gradients first

    def __init__(self, model_path: str, cfg: TrainerConfig, device: str | None = None,
                 adapter: AdapterConfig | None = None):
        self.cfg = cfg
        self.device = device or cfg.device
        self.adapter = adapter
        self.model = load_policy(model_path, self.device)
        self.ref = frozen_copy(self.model) if cfg.kl_coef > 0 else None
        if adapter is not None:
            torch.manual_seed(cfg.seed)  # the adapter's initial A: from trainer.seed, as on the deepspeed backend
            self.model = wrap(self.model, adapter)
        self.params = trainable(self.model)
        self.optimizer = optim.make_adamw(self.params, cfg)

    def train_step(self, rows: Sequence[Row | None], inputs: StepInputs, lr: float, pad_row: Row | None = None,
                   stop: Callable[[], bool] | None = None) -> StepStats:
        """One optimiser step over all of `rows` (one process has no padding; `pad_row` is unused); a
        `stop()` during it abandons it (`jet.trainer.step.StepAbandoned`, nothing applied)."""
        self.optimizer.zero_grad(set_to_none=True)
        with autocast(self.device, self.cfg.dtype):
            stats = accumulate(self.model, rows, inputs, self.cfg, lambda loss, _last: loss.backward(),
                               ref_model=self.ref, stop=stop)
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        stats.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        optim.set_lr(self.optimizer, lr)
        self.optimizer.step()
        return stats

    @contextlib.contextmanager
    def full_module(self) -> Iterator[torch.nn.Module]:
        if self.adapter is None:
            yield self.model
        else:
            yield AdapterOnly(self.model) if self.adapter.publish == "adapter" else Merged(self.model)

    def save(self, folder: Path) -> None:
        from safetensors.torch import save_model

        if self.adapter is None:
            save_model(self.model, str(folder / WEIGHTS_FILE))
        else:
            optim.save_tensors(adapter_tensors(self.model), folder / ADAPTER_CHECKPOINT_FILE)
        tensors, groups = optim.optimizer_state(self.optimizer)
        optim.save_tensors(tensors, folder / "optimizer.safetensors")
        rng, rng_meta = optim.rng_state()
        optim.save_tensors(rng, folder / "rng.safetensors")
        adapter = None if self.adapter is None else self.adapter.model_dump(mode="json")
        (folder / "backend.json").write_text(json.dumps({"param_groups": groups, "rng": rng_meta, "adapter": adapter}))

    def load(self, folder: Path) -> None:
        from safetensors.torch import load_model

        meta = json.loads((folder / "backend.json").read_text())
        mine = None if self.adapter is None else self.adapter.model_dump(mode="json")
        if meta.get("adapter") != mine:
            raise ValueError(f"checkpoint {folder} was written with adapter {meta.get('adapter')}, "
                             f"this trainer has {mine} (models[].adapter)")
        if self.adapter is None:
            load_model(self.model, str(folder / WEIGHTS_FILE), device=str(self.device))
        else:
            load_adapter_tensors(self.model, optim.load_tensors(folder / ADAPTER_CHECKPOINT_FILE))
        # load_state_dict moves each state tensor to its parameter's device (the step count stays on CPU)
        optim.load_optimizer_state(self.optimizer, optim.load_tensors(folder / "optimizer.safetensors"),
                                   meta["param_groups"])
        optim.set_rng_state(optim.load_tensors(folder / "rng.safetensors"), meta["rng"])
