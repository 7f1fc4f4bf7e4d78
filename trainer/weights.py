"""Writing published weights: `runs/<run>/weights/<model>/v<N>/` as safetensors, durable before announced.

What it is: `write_weights(module, folder)` saves the module's tensors
(copied out, one name per tied tensor, as `jet.workers.hf_backend.load_weights`
accepts; DeepSpeed's parameters are views into flat buffers, which
`safetensors.torch.save_model` refuses) to a temporary file, fsyncs
it, renames it to `model.safetensors`, fsyncs the folder, writes
`config.json` and returns the file's sha256. Only then does the trainer
announce a `WeightVersion` (`jet.trainer.link.Link.publish`), so an
inference worker never sees an announcement of a file that is not all there.
`prune_weights` deletes old versions, keeping the newest `keep`.

What it is not: a loader (inference workers load, checking the hash), and
weights never go through Redis.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from jet.wire import WEIGHTS_FILE, file_sha256



def weights_dir(run_dir: Path, model: str, version: int) -> Path:
    return Path(run_dir) / "weights" / model / f"v{version}"


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory's entry table."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def state_tensors(module) -> dict:
    """The module's state as standalone contiguous CPU tensors; tied tensors under their first name."""
    out, seen = {}, set()
    for name, t in module.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().to("cpu", copy=True).contiguous()
    return out


def write_weights(module, folder: Path) -> str:
    """Write `module`'s weights (and config) to `folder` durably; return the file's sha256."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    final, tmp = folder / WEIGHTS_FILE, folder / (WEIGHTS_FILE + ".tmp")
    save_file(state_tensors(module), str(tmp), metadata={"format": "pt"})
    fsync_path(tmp)
    os.replace(tmp, final)
    config = getattr(module, "config", None)
    if config is not None:
        config.to_json_file(str(folder / "config.json.tmp"))
        fsync_path(folder / "config.json.tmp")
        os.replace(folder / "config.json.tmp", folder / "config.json")
    fsync_path(folder)
    return file_sha256(final)


def prune_weights(run_dir: Path, model: str, newest: int, keep: int) -> None:
    """Delete `v<N>` folders with N <= newest - keep (a worker still loading one retries the next)."""
    root = Path(run_dir) / "weights" / model
    for d in root.glob("v*"):
        n = d.name[1:]
        if n.isdigit() and int(n) <= newest - keep:
            shutil.rmtree(d, ignore_errors=True)
