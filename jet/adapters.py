"""Adapter versions: the files, and merging one into its base, without peft (no torch at import).

The adapter concept lives in three rooms, each module named for it: here, what a version IS (its files,
their checks, the merge math); `jet.trainer.adapter`, training one (the policy wrapped with peft, what
a checkpoint keeps and a version publishes); `jet.workers.inference.served_adapters`, serving versions on
the hf backend (merged into the one model's weights, or added row by row to several models on one
base; the vllm backend hands them to vLLM's LoRA support). An adapter is a LoRA adapter: the update of
each adapted layer is (alpha / r) B A.

What it is: the format of an adapter version as the trainer publishes it (`models[].adapter` with
`publish: adapter`): a folder holding `adapter_model.safetensors` (the LoRA A and B matrices under
peft's names, `base_model.model.<layer>.lora_A.weight`) and `adapter_config.json` (peft's LoraConfig
fields: `r`, `lora_alpha`, `target_modules`, ...), so `peft.PeftModel.from_pretrained(base, folder)`
loads it too. `read(folder)` checks and loads one (`AdapterError` with the reason otherwise); `pairs`
gives each adapted layer's A and B; `updates` checks them against a model's weight shapes, before
anything is computed; `merged_weight` is one weight plus its update, and `merge_into` every merged
weight. `jet model merge` writes a base with an adapter merged in as a plain Hugging Face folder
(`merge_folder`: transformers and vLLM load it).

What it is not: a trainer nor a server (the two other rooms), and no pickle: safetensors and JSON only.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path


ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
FILES = (CONFIG_FILE, ADAPTER_FILE)  # what a version folder holds
PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter version that cannot be applied; the message says why."""


def is_adapter(folder: str | Path) -> bool:
    return Path(folder).is_dir() and (Path(folder) / ADAPTER_FILE).is_file()


@dataclass
class Adapter:
    tensors: dict  # peft name -> tensor
    config: dict  # adapter_config.json

    @property
    def scale(self) -> float:
        return float(self.config["lora_alpha"]) / int(self.config["r"])


def read(folder: str | Path) -> Adapter:
    """The adapter version in `folder` (its safetensors and config checked for form)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{folder / CONFIG_FILE}: unreadable adapter config: {e}") from e
    if config.get("peft_type", "LORA") != "LORA" or not isinstance(config.get("r"), int) or config["r"] < 1 \
            or not isinstance(config.get("lora_alpha"), (int, float)):
        raise AdapterError(f"{folder / CONFIG_FILE}: not a LoRA config with integer r >= 1 and a lora_alpha")
    if config.get("use_rslora") or config.get("use_dora") or config.get("fan_in_fan_out"):
        raise AdapterError(f"{folder / CONFIG_FILE}: rsLoRA, DoRA and fan_in_fan_out adapters are not supported")
    try:
        tensors = load_file(str(folder / ADAPTER_FILE), device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types
        raise AdapterError(f"{folder / ADAPTER_FILE} is not a readable safetensors file: {type(e).__name__}: {e}") from e
    return Adapter(tensors, config)


def pairs(adapter: Adapter) -> dict:
    """Adapted layer (module name, e.g. `model.layers.0.self_attn.q_proj`) -> its (A [r, in], B [out, r])."""
    found: dict[str, dict] = {}
    for name, tensor in adapter.tensors.items():
        layer, sep, rest = name.removeprefix(PREFIX).rpartition(".lora_")
        if not sep or rest not in ("A.weight", "B.weight"):
            raise AdapterError(f"unexpected adapter tensor {name!r} (expected <layer>.lora_A.weight / lora_B.weight)")
        found.setdefault(layer, {})[rest[0]] = tensor
    out = {}
    for layer, ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter layer {layer!r} lacks its lora_{'A' if 'B' in ab else 'B'} matrix")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise AdapterError(f"adapter layer {layer!r}: A {tuple(a.shape)} and B {tuple(b.shape)} do not compose")
        out[layer] = (a, b)
    return out


def updates(adapter: Adapter, shapes: dict) -> list:
    """(base weight name, A, B) of each adapted layer, checked against the model's weight shapes (`shapes`:
    name -> shape); AdapterError naming the first that does not fit. Nothing is computed yet."""
    out = []
    for layer, (a, b) in pairs(adapter).items():
        name = f"{layer}.weight"
        if name not in shapes:
            raise AdapterError(f"the adapter updates {name!r}, which the model does not have")
        if (b.shape[0], a.shape[1]) != tuple(shapes[name]):
            raise AdapterError(f"the adapter's update of {name!r} is {(b.shape[0], a.shape[1])}, "
                               f"the model's weight {tuple(shapes[name])}")
        out.append((name, a, b))
    return out


def merged_weight(base, a, b, scale: float):
    """`base` + (alpha / r) B A, computed in float32, in `base`'s dtype (a new tensor)."""
    return (base.float() + (b.float() @ a.float()).to(base.device) * scale).to(base.dtype)


def merge_into(base: dict, adapter: Adapter) -> dict:
    """The weights of `base` (name -> tensor, unchanged) that `adapter` updates, merged (base's dtype)."""
    return {name: merged_weight(base[name], a, b, adapter.scale)
            for name, a, b in updates(adapter, {k: v.shape for k, v in base.items()})}


def merge_folder(base_path: str | Path, adapter_folder: str | Path, out: str | Path) -> Path:
    """Write `base_path` (a Hugging Face model folder) with the adapter version in `adapter_folder` merged in,
    as a Hugging Face folder at `out` (config, safetensors weights, the base's tokenizer files)."""
    import torch
    from transformers import AutoModelForCausalLM

    adapter = read(adapter_folder)
    model = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    live = model.state_dict()
    merged = merge_into(live, adapter)
    with torch.no_grad():
        for name, tensor in merged.items():
            live[name].copy_(tensor)
    out = Path(out)
    model.save_pretrained(str(out))
    for f in Path(base_path).iterdir():  # tokenizer, chat template, generation config: what the model lacks
        if f.is_file() and not (out / f.name).exists() and not f.name.endswith((".safetensors", ".bin")) \
                and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)
    return out
