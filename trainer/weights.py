"""Writing published weights: `runs/<run>/weights/<model>/v<N>/` as safetensors, durable before announced.

What it is: `write_weights(module, folder)` saves the module's tensors
(copied out, one name per tied tensor, as `jet.workers.inference.hf.load_weights`
accepts; DeepSpeed's parameters are views into flat buffers, which
`safetensors.torch.save_model` refuses) to a temporary file, fsyncs
it, renames it to `model.safetensors`, fsyncs the folder, writes
`config.json` and returns the file's sha256. Only then does the trainer
announce a `WeightVersion` (`jet.trainer.link.Link.publish`), so an
inference worker never sees an announcement of a file that is not all there.
The file holds the tensors in the trainer's compute dtype (`trainer.dtype`:
bfloat16 halves the folder; inference backends cast into their own dtype).

Retention (`prune_weights`, after each publish): a version's folder is deleted
only when it is older than the newest `keep` AND older than the oldest version
an inference worker reports serving in its heartbeat (`jet.queues.registry`):
every version at or past the oldest served one stays, which also covers a
worker loading a newer one (it still reports the old). Deletion renames the
folder to `.old-v<N>` first, so a published name is there whole or not at all;
a follower that finds an announced folder gone skips to the newest
(`jet.workers.inference.weights`). Leftover `.old-*` folders go at the next prune.

A LoRA adapter model (`models[].adapter`, `publish: adapter`) publishes the adapter
alone (`write_adapter`: `jet.adapters`' adapter_model.safetensors and
adapter_config.json, the same durable order, the hash of the safetensors file);
`write_version` picks by what the backend's `full_module()` gives.

Resuming from a version (`load_version`, `trainer.resume: published`): a
restarted trainer copies the newest published version's tensors back into its
model (or adapter), after checking the file's sha256 against the one its
resume point recorded (`jet.trainer.checkpoint`).

What it is not: the inference workers' loader (they load, checking the hash),
and weights never go through Redis.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from jet.runs import RunDir
from jet.wire import WEIGHTS_FILE, file_sha256

log = logging.getLogger(__name__)


def weights_dir(run_dir: Path, model: str, version: int) -> Path:
    return RunDir.at(run_dir).weight_version(model, version)


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory's entry table."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def state_tensors(module) -> dict:
    """The module's state as standalone contiguous CPU tensors; tied tensors under their first name. A CPU
    tensor that is the whole of its own storage is taken as it is, since the writer runs while nothing
    trains (a publish of SmolLM2-135M's 540 MB takes 1.19 s without the copy against 1.72 s with it:
    `scripts/trainer-step-bench.py --part publish`); others (a view into DeepSpeed's flat buffer, which
    safetensors refuses to save beside its siblings, or a device tensor) are copied out."""
    out, seen = {}, set()
    for name, t in module.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach() if whole_storage(t) else t.detach().to("cpu", copy=True).contiguous()
    return out


def whole_storage(t) -> bool:
    """A contiguous CPU tensor that is all of its storage, from its start: nothing else can share it."""
    return (t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def write_weights(module, folder: Path, dtype: str = "float32") -> str:
    """Write `module`'s weights (and config) to `folder` durably, floating tensors as `dtype`
    ('float32', 'bfloat16'); return the file's sha256."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    final, tmp = folder / WEIGHTS_FILE, folder / (WEIGHTS_FILE + ".tmp")
    want = getattr(torch, dtype)
    tensors = {k: t.to(want) if t.is_floating_point() else t for k, t in state_tensors(module).items()}
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    fsync_path(tmp)
    os.replace(tmp, final)
    config = getattr(module, "config", None)
    if config is not None:
        config.to_json_file(str(folder / "config.json.tmp"))
        fsync_path(folder / "config.json.tmp")
        os.replace(folder / "config.json.tmp", folder / "config.json")
    fsync_path(folder)
    return file_sha256(final)


def write_adapter(adapter, folder: Path, dtype: str = "float32") -> str:
    """Write an adapter version (`jet.trainer.adapter.AdapterOnly`) to `folder` durably, its tensors as
    `dtype`; return the sha256 of its safetensors file."""
    import json

    import torch
    from safetensors.torch import save_file

    from jet.adapters import ADAPTER_FILE, CONFIG_FILE

    folder.mkdir(parents=True, exist_ok=True)
    want = getattr(torch, dtype)
    tensors = {k: t.to(want) if t.is_floating_point() else t for k, t in adapter.tensors().items()}
    for name, write in ((CONFIG_FILE, lambda p: p.write_text(json.dumps(adapter.config(), indent=1))),
                        (ADAPTER_FILE, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))):
        tmp = folder / (name + ".tmp")
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, folder / name)  # the config first: a folder with the tensors has its config
    fsync_path(folder)
    return file_sha256(folder / ADAPTER_FILE)


def write_version(module, folder: Path, dtype: str = "float32") -> str:
    """What `full_module()` gave, as a version: an adapter alone (`write_adapter`), else full weights."""
    from jet.trainer.adapter import AdapterOnly

    if isinstance(module, AdapterOnly):
        return write_adapter(module, folder, dtype)
    return write_weights(module, folder, dtype)


def load_version(module, folder: Path, sha256: str) -> None:
    """Copy a published version in `folder` into what `full_module()` gave (the model, or the adapter of
    `AdapterOnly`), in place and in the parameters' own dtype; its file must hash to `sha256`. Every
    tensor of the module must come from the file (tied ones through the name they share storage with)."""
    import torch
    from safetensors.torch import load_file

    from jet.adapters import ADAPTER_FILE
    from jet.trainer.adapter import AdapterOnly, Merged, load_adapter_tensors

    if isinstance(module, Merged):
        raise TypeError(f"cannot resume from {folder}: a merged version cannot be taken apart into base and adapter")
    only_adapter = isinstance(module, AdapterOnly)
    path = folder / (ADAPTER_FILE if only_adapter else WEIGHTS_FILE)
    if not path.is_file() or file_sha256(path) != sha256:
        raise ValueError(f"cannot resume from {folder}: {path.name} is missing or does not hash to {sha256[:12]}")
    tensors = load_file(str(path))
    if only_adapter:
        load_adapter_tensors(module.model, {k: t.float() for k, t in tensors.items()})
        return
    live = module.state_dict()
    unknown = sorted(set(tensors) - set(live))
    covered = {live[k].data_ptr() for k in tensors if k in live}
    missing = sorted(k for k, t in live.items() if k not in tensors and t.data_ptr() not in covered)
    if unknown or missing:
        raise ValueError(f"cannot resume from {folder}: it does not match the model (unknown {unknown[:3]}, "
                         f"missing {missing[:3]})")
    with torch.no_grad():
        for k, t in tensors.items():
            live[k].copy_(t.to(live[k].dtype))


def published_versions(run_dir: Path, model: str) -> list[int]:
    """The versions N with a `v<N>` folder, oldest first."""
    return RunDir.at(run_dir).versions(model)


def prune_weights(run_dir: Path, model: str, newest: int, keep: int,
                  served: dict[str, int] | None) -> list[int]:
    """Delete the `v<N>` folders older than the newest `keep` (N <= newest - keep) and than every
    version in `served` (worker -> version it serves); None (the registry was unreachable) deletes
    nothing. Returns the versions deleted."""
    root = RunDir.at(run_dir).weights(model)
    for old in root.glob(".old-v*"):  # a crash fell between a rename and its rmtree
        shutil.rmtree(old, ignore_errors=True)
    if served is None:
        return []
    floor = min([newest - keep + 1, *served.values()])
    present = published_versions(run_dir, model)
    gone = [n for n in present if n < floor]
    pinned = [n for n in present if floor <= n <= newest - keep]
    if pinned:
        oldest = sorted(w for w, v in served.items() if v == floor)
        log.warning("keeping %d weight versions of %s past trainer.keep_weights=%d: %s still serves version %d",
                    len(pinned), model, keep, ", ".join(oldest), floor)
    for n in gone:
        old = root / f".old-v{n}"
        os.replace(root / f"v{n}", old)
        shutil.rmtree(old, ignore_errors=True)
    if gone:
        fsync_path(root)
    return gone
