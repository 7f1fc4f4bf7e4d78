"""Test helper: a model's weights moved by seeded noise, written where a weight version would be."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from jet.wire import file_sha256


def perturbed_weights(model_dir: Path, dest: Path, *, seed: int, scale: float) -> tuple[Path, str]:
    """dest/model.safetensors = the model's weights + scale * N(0, 1) noise; returns (file, its sha256)."""
    state = load_file(Path(model_dir) / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    state = {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    dest.mkdir(parents=True)
    file = dest / "model.safetensors"
    save_file(state, file, metadata={"format": "pt"})
    return file, file_sha256(file)
