"""Training an adapter (`models[].adapter`): the policy wrapped with peft, and what the trainer keeps and publishes.

What it is: `wrap(model, cfg)` puts a LoRA adapter on the policy (peft's `get_peft_model`: every base
parameter frozen; each adapted layer computes W x + (alpha / r) B A x with B zero at first, so the
wrapped model computes exactly what the base does until the first step); `trainable(model)`, the
parameters the optimiser holds; `adapter_tensors` / `load_adapter_tensors`, the adapter's own tensors
(peft's names) that a checkpoint holds instead of the whole model (`ADAPTER_CHECKPOINT_FILE`); and
what a version publishes: `AdapterOnly(model)`, the adapter alone (`publish: adapter`, the default:
the files of `jet.adapters`, which inference workers serve, `jet.workers.inference.served_adapters`),
or `Merged(model)`, the base with each layer's update B A (alpha / r) added, under the base model's own
parameter names (`publish: merged`, which every inference backend loads as full training's).

Merging is computed into copies (`merged_state`): the live base weights are never merged in and
taken out again, which would leave float rounding in them after every publish.

What it is not: the version's file format or merge math (`jet.adapters`), nor an optimiser backend (the
torch and deepspeed backends both wrap the policy with it before they build their optimiser).
"""

from __future__ import annotations

import torch

from jet.config import AdapterConfig

ADAPTER_CHECKPOINT_FILE = "adapter.safetensors"  # in a checkpoint, instead of model.safetensors


def lora_config(cfg: AdapterConfig):
    from peft import LoraConfig

    return LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none",
                      target_modules=cfg.target_modules, task_type="CAUSAL_LM")


def wrap(model: torch.nn.Module, cfg: AdapterConfig) -> torch.nn.Module:
    """`model` with a fresh LoRA adapter (A drawn from torch's generator: the backends seed it with trainer.seed
    first); base parameters frozen. Eval mode as the policy is (no dropout),
    except the adapter's own dropout when `cfg.dropout` > 0."""
    from peft import get_peft_model

    wrapped = get_peft_model(model, lora_config(cfg)).eval()
    if cfg.dropout > 0:
        for name, module in wrapped.named_modules():
            if name.endswith("lora_dropout") or ".lora_dropout." in name:
                module.train()
    return wrapped


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors as standalone contiguous CPU tensors (peft's names, no adapter name)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Set the adapter's tensors; a checkpoint of another adapter shape (r, targets) is refused."""
    from peft import set_peft_model_state_dict

    want = adapter_tensors(model)
    if set(want) != set(tensors) or any(want[k].shape != tensors[k].shape for k in want):
        diff = sorted(set(want) ^ set(tensors)) or [k for k in want if want[k].shape != tensors[k].shape]
        raise ValueError(f"the checkpoint's adapter does not match models[].adapter (first differences: {diff[:3]})")
    result = set_peft_model_state_dict(model, tensors)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"the checkpoint's adapter has tensors the model lacks: {result.unexpected_keys[:3]}")


@torch.no_grad()
def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapted layer's weight replaced by W + its LoRA update
    (new tensors); other tensors are the live ones (tied weights stay tied)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                delta = module.get_delta_weight(adapter)
                deltas[name] = deltas[name] + delta if name in deltas else delta
    out = {}
    for key, tensor in base.state_dict().items():
        if ".lora_" in key:
            continue
        layer, sep, rest = key.partition(".base_layer.")
        if sep:
            key = f"{layer}.{rest}"
            if rest == "weight" and layer in deltas:
                tensor = tensor + deltas[layer].to(tensor.dtype)
        out[key] = tensor
    return out


class Merged:
    """What `jet.trainer.weights.write_weights` publishes of an adapter model: `state_dict()` is
    `merged_state`, `config` the base model's."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.config = model.get_base_model().config

    def state_dict(self) -> dict[str, torch.Tensor]:
        return merged_state(self.model)


class AdapterOnly:
    """What `jet.trainer.weights.write_version` publishes of an adapter model with `publish: adapter`: the
    adapter's tensors and its peft config (`jet.adapters`)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def tensors(self) -> dict[str, torch.Tensor]:
        return adapter_tensors(self.model)

    def config(self) -> dict:
        """peft's adapter_config.json of it (sets as sorted lists, so it is JSON)."""
        raw = self.model.peft_config["default"].to_dict()
        return {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in raw.items()}
