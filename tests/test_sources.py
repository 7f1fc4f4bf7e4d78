"""Hub model ids in `models[].path`: resolved offline against a Hugging Face cache laid out here.

The cache is the real layout huggingface_hub reads (HF_HOME/hub/models--owner--name/ with refs/<branch>,
snapshots/<sha>/<file> linking into blobs/<sha256>), holding the tiny test model; no hub is reachable.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import yaml

from jet.config import check_models, load_file
from jet.errors import ConfigError
from jet.models import init_model
from jet.sources import hub_id, pinned, resolve_model

SHA1, SHA2 = "1" * 40, "2" * 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("tiny") / "m", vocab_size=512, hidden_size=32, layers=1,
                      heads=4, kv_heads=2, max_position=2048)


def cache_model(hf_home: Path, repo: str, sha: str, src: Path, refs: tuple[str, ...] = ("main",),
                skip: tuple[str, ...] = ()) -> Path:
    """Put the files of `src` into the hub cache under HF_HOME as snapshot `sha` of `repo`; refs point at it."""
    root = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snap = root / "snapshots" / sha
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.name in skip:
            continue
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    for ref in refs:
        (root / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(sha)
    return snap


@pytest.fixture
def offline(tmp_path, monkeypatch) -> Path:
    hf_home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hf_home


def config(tmp_path: Path, path: str) -> Path:
    f = tmp_path / "jet.yaml"
    f.write_text(yaml.safe_dump({"models": [{"name": "m", "path": path}],
                                 "tasks": [{"name": "t", "workflow": "jet.tasks.guess:workflow", "dataset": "guess"}]}))
    return f


def test_hub_ids_are_told_from_paths():
    assert hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") == ("HuggingFaceTB/SmolLM2-135M-Instruct", None)
    assert hub_id("Qwen/Qwen3-0.6B@v1.0") == ("Qwen/Qwen3-0.6B", "v1.0")
    for path in ("./a/b", "/a/b", "~/a/b", "a/b/c", "tiny", "../a", "a--b/c", "a/b@", ".jet/models"):
        assert hub_id(path) is None, path


def test_a_hub_id_loads_from_the_cache_offline(tmp_path, offline, tiny):
    snap = cache_model(offline, "org/tiny", SHA1, tiny)
    cfg = load_file(config(tmp_path, "org/tiny"))
    assert cfg.models[0].path == "org/tiny"  # not made a path under the config's folder
    resolved = check_models(cfg)
    assert resolved.models[0].path == str(snap)

    from transformers import AutoModelForCausalLM

    from jet.llm import Tokenizers

    tok = Tokenizers({"m": "org/tiny"}).get("m")  # the env worker's and gateway's way in
    assert tok.decode(tok.encode("hello world")) == "hello world"
    model = AutoModelForCausalLM.from_pretrained(resolved.models[0].path)
    assert model.config.vocab_size == len(tok)


def test_a_revision_picks_its_snapshot(tmp_path, offline, tiny):
    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    cfg_file = other / "config.json"
    cfg_file.write_text(cfg_file.read_text().replace('"num_hidden_layers": 1', '"num_hidden_layers": 3'))
    cache_model(offline, "org/tiny", SHA1, tiny)
    snap2 = cache_model(offline, "org/tiny", SHA2, other, refs=("v2",))
    assert resolve_model("org/tiny@" + SHA2) == str(snap2)
    assert resolve_model("org/tiny@v2") == str(snap2)
    assert Path(resolve_model("org/tiny")).name == SHA1
    assert '"num_hidden_layers": 3' in (Path(resolve_model("org/tiny@v2")) / "config.json").read_text()
    with pytest.raises(ConfigError, match="revision v3"):
        resolve_model("org/tiny@v3", "models[0].path")


def test_pinning_keeps_every_role_on_one_commit(offline, tiny):
    """`jet up` pins what main resolved to; main moving afterwards does not move the roles."""
    cache_model(offline, "org/tiny", SHA1, tiny)
    first = resolve_model("org/tiny")
    pin = pinned("org/tiny", first)
    assert pin == f"org/tiny@{SHA1}"
    cache_model(offline, "org/tiny", SHA2, tiny)  # main moves on
    assert Path(resolve_model("org/tiny")).name == SHA2
    assert resolve_model(pin) == first
    assert pinned(pin, first) is None and pinned(str(tiny), str(tiny)) is None


def test_not_cached_offline_is_one_line_naming_the_key(tmp_path, offline):
    import click

    from jet.options import require_models

    path = config(tmp_path, "org/absent")
    with pytest.raises(click.ClickException) as e:
        require_models(load_file(path), str(path))
    msg = e.value.message
    assert "\n" not in msg
    assert msg.startswith(f"{path}: models[0].path: Hub model 'org/absent'")
    assert "HF_HUB_OFFLINE" in msg and "hf download org/absent" in msg


def test_a_local_folder_wins_over_a_hub_id(tmp_path, offline, tiny):
    cache_model(offline, "org/tiny", SHA1, tiny)
    local = tmp_path / "org" / "tiny"
    shutil.copytree(tiny, local)
    cfg = load_file(config(tmp_path, "org/tiny"))
    assert cfg.models[0].path == str(local.resolve())
    assert check_models(cfg).models[0].path == str(local.resolve())


def test_a_hub_model_without_safetensors_is_refused(offline, tiny):
    cache_model(offline, "org/pickled", SHA1, tiny, skip=("model.safetensors",))
    with pytest.raises(ConfigError, match=r"models\[0\].path: .*no .safetensors weights"):
        resolve_model("org/pickled", "models[0].path")


def test_a_missing_local_folder_still_says_how_to_build_one(tmp_path):
    with pytest.raises(ConfigError, match="no such directory; build a tiny one"):
        check_models(load_file(config(tmp_path, "./models/tiny")))


def test_the_dashboard_decodes_with_a_hub_models_tokenizer(offline, tiny):
    from transformers import AutoTokenizer

    from jet.dash.hub import _load_decoder

    cache_model(offline, "org/tiny", SHA1, tiny)
    ids = AutoTokenizer.from_pretrained(tiny).encode("hello world")
    assert _load_decoder("org/tiny")(ids) == "hello world"


def test_jet_up_pins_a_hub_model_for_all_its_roles(tmp_path, offline, tiny):
    from jet.cli.up import ensure_models, roles_for

    snap = cache_model(offline, "org/tiny", SHA1, tiny)
    path = config(tmp_path, "org/tiny")
    cfg = load_file(path)
    built, resolved, pins = ensure_models(cfg)
    assert built == [] and resolved.models[0].path == str(snap)
    assert pins == (f"models.0.path=org/tiny@{SHA1}",)
    roles = roles_for(cfg, str(path), pins, 1)
    assert {r.name for r in roles} == {"infer-m", "env", "train-m"}
    for role in roles:  # each role loads the config again: the pin is what it resolves
        assert role.argv[-2:] == ["--set", f"models.0.path=org/tiny@{SHA1}"]
    again = load_file(path, pins)
    cache_model(offline, "org/tiny", SHA2, tiny)  # main moves while the roles start
    assert check_models(again).models[0].path == str(snap)


@pytest.mark.slow
def test_jet_up_trains_a_hub_model_offline(tmp_path, offline, tiny):
    import subprocess
    import sys

    from jet.config import default_config_path

    snap = cache_model(offline, "org/tiny", SHA1, tiny)
    cfg = yaml.safe_load(default_config_path().read_text())
    cfg.update(run="hubtest", runs_dir=str(tmp_path / "runs"))
    cfg["models"][0]["path"] = "org/tiny"
    cfg["tasks"][0]["concurrency"] = 4
    cfg["trainer"].update(steps=1, batch_groups=1, checkpoint_every=0)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "JET_REDIS_URL"}
    res = subprocess.run([sys.executable, "-m", "jet.cli", "up", "--config", str(path), "--no-live", "--no-dash",
                          "--run-dir", str(tmp_path / ".jet")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    resolved = yaml.safe_load((tmp_path / "runs" / "hubtest" / "config.resolved.yaml").read_text())
    assert resolved["models"][0]["path"] == str(snap)
    assert not (tmp_path / ".jet" / "models").exists()  # nothing built: the Hub model was used
    assert "tiny: 1 steps" in res.stderr  # the trainer stepped on trajectories the inference worker made


def test_pins_name_only_the_models_resolved(tmp_path, offline, tiny):
    from jet.config import pins

    cache_model(offline, "org/tiny", SHA1, tiny)
    cache_model(offline, "org/other", SHA2, tiny)
    f = tmp_path / "two.yaml"
    f.write_text(yaml.safe_dump({"models": [{"name": "a", "path": "org/tiny"}, {"name": "b", "path": f"org/other@{SHA2}"},
                                            {"name": "c", "path": "org/other"}],
                                 "tasks": [{"name": "t", "workflow": "a:b", "dataset": "guess", "model": "a"}]}))
    cfg = load_file(f)
    assert pins(cfg, check_models(cfg, ["a", "b"])) == (f"models.0.path=org/tiny@{SHA1}",)  # b is pinned already
    assert pins(cfg, check_models(cfg)) == (f"models.0.path=org/tiny@{SHA1}", f"models.2.path=org/other@{SHA2}")
