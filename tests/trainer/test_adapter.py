"""LoRA adapters in the trainer (models[].adapter): a fresh adapter computes what the base does; a step
moves the adapter alone; the published merged weights compute what the adapter model does; a checkpoint
holds the adapter and its optimiser state and round-trips them; mismatched checkpoints and configs are
refused with the key."""

from __future__ import annotations

import pytest
import torch

from jet.config import AdapterConfig, TrainerConfig, load
from jet.errors import ConfigError
from jet.trainer.adapter import ADAPTER_CHECKPOINT_FILE
from jet.trainer.backend_torch import TorchBackend
from jet.trainer.batch import build_step
from jet.trainer.packing import pack, row_logprobs
from tests.trainer.test_step import small_batch

ADAPTER = AdapterConfig(r=4, alpha=8.0)


def step_inputs():
    inputs = build_step(small_batch(), advantage="grpo", loss_agg="token_mean", prefix_trees=False)
    return inputs, pack(inputs.samples, 64)


def test_a_fresh_adapter_computes_the_base_and_a_step_moves_the_adapter_alone(tiny_model):
    cfg = TrainerConfig(lr=1e-2, kl_coef=0.1)
    full = TorchBackend(str(tiny_model), cfg)
    b = TorchBackend(str(tiny_model), cfg, adapter=ADAPTER)
    inputs, rows = step_inputs()
    with torch.no_grad():
        assert torch.equal(row_logprobs(b.model, rows[0]), row_logprobs(full.model, rows[0])), "B = 0 at first"
    base = {n: p.detach().clone() for n, p in b.model.named_parameters() if not p.requires_grad}
    mine = {n: p.detach().clone() for n, p in b.model.named_parameters() if p.requires_grad}
    assert mine and all(".lora_" in n for n in mine), "only the adapter's parameters train"
    # 'all-linear' on a Llama: the 7 projections of each of the 2 layers, an A and a B each
    assert len(mine) == 2 * 7 * 2
    stats = b.train_step(rows, inputs, lr=cfg.lr)
    assert stats.tokens == 7 and stats.grad_norm > 0
    still = [n for n, p in b.model.named_parameters() if n in mine and torch.equal(p, mine[n])]
    assert sorted(still) == sorted(n for n in mine if ".lora_A." in n), "with B = 0 the first step moves B alone"
    b.train_step(rows, inputs, lr=cfg.lr)
    assert all(torch.equal(p, base[n]) for n, p in b.model.named_parameters() if n in base), "the base is frozen"
    assert [n for n, p in b.model.named_parameters() if n in mine and torch.equal(p, mine[n])] == []
    held = [p for group in b.optimizer.param_groups for p in group["params"]]
    assert len(held) == len(mine) and len(b.optimizer.state) == len(mine), "optimiser state for the adapter only"
    with torch.no_grad():
        assert not torch.equal(row_logprobs(b.model, rows[0]), row_logprobs(full.model, rows[0]))
        assert torch.equal(row_logprobs(b.ref, rows[0]), row_logprobs(full.model, rows[0])), "KL against the base"


@pytest.mark.parametrize("publish", ["adapter", "merged"])
def test_a_published_version_serves_what_the_adapter_model_computes(tiny_model, tmp_path, publish):
    from safetensors.torch import load_file

    from jet import adapters
    from jet.trainer.weights import write_version, write_weights
    from jet.workers.inference.hf import HFBackend

    cfg = TrainerConfig(lr=1e-2)
    b = TorchBackend(str(tiny_model), cfg, adapter=ADAPTER.model_copy(update={"publish": publish}))
    inputs, rows = step_inputs()
    worker = HFBackend(tiny_model)  # an inference worker following the versions
    for version in (1, 2):
        for _ in range(2):
            b.train_step(rows, inputs, lr=cfg.lr)
        before = {n: p.detach().clone() for n, p in b.model.named_parameters()}
        with b.full_module() as module:
            sha = write_version(module, tmp_path / f"v{version}")
        assert all(torch.equal(p, before[n]) for n, p in b.model.named_parameters()), "publishing changes nothing"
        worker.load_weights(tmp_path / f"v{version}", sha, version)
        with torch.no_grad():
            served, trained = row_logprobs(worker.model, rows[0]), row_logprobs(b.model, rows[0])
        assert torch.allclose(served, trained, atol=1e-5, rtol=0), (version, (served - trained).abs().max())
    base_file = tiny_model / "model.safetensors"
    if publish == "adapter":
        assert adapters.is_adapter(tmp_path / "v2") and not (tmp_path / "v2" / "model.safetensors").exists()
        assert (tmp_path / "v2" / adapters.ADAPTER_FILE).stat().st_size < base_file.stat().st_size / 2
        # the worker's base is kept aside, not drifted: a zero adapter gives back the base exactly
        zero = tmp_path / "v3"
        zero.mkdir()
        (zero / adapters.CONFIG_FILE).write_text((tmp_path / "v2" / adapters.CONFIG_FILE).read_text())
        from safetensors.torch import save_file
        save_file({k: torch.zeros_like(t) for k, t in load_file(tmp_path / "v2" / adapters.ADAPTER_FILE).items()},
                  str(zero / adapters.ADAPTER_FILE))
        worker.load_weights(zero, None, 3)
        fresh = HFBackend(tiny_model)
        assert all(torch.equal(t, fresh.model.state_dict()[n]) for n, t in worker.model.state_dict().items())
    else:
        plain = write_weights(TorchBackend(str(tiny_model), cfg).model, tmp_path / "base")
        assert set(load_file(tmp_path / "v2" / "model.safetensors")) == set(load_file(tmp_path / "base" / "model.safetensors"))
        assert sha != plain


def test_a_bad_adapter_version_is_refused_with_its_reason_and_the_old_one_keeps_serving(tiny_model, tmp_path):
    from jet import adapters
    from jet.errors import WeightsError
    from jet.trainer.weights import write_version
    from jet.workers.inference.hf import HFBackend

    cfg = TrainerConfig(lr=1e-2)
    b = TorchBackend(str(tiny_model), cfg, adapter=ADAPTER)
    inputs, rows = step_inputs()
    b.train_step(rows, inputs, lr=cfg.lr)
    with b.full_module() as module:
        sha = write_version(module, tmp_path / "v1")
    worker = HFBackend(tiny_model)
    worker.load_weights(tmp_path / "v1", sha, 1)
    serving = {n: t.clone() for n, t in worker.model.state_dict().items()}
    file = tmp_path / "v1" / adapters.ADAPTER_FILE
    data = file.read_bytes()

    file.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(WeightsError, match="sha256 mismatch"):
        worker.load_weights(tmp_path / "v1", sha, 2)
    with pytest.raises(WeightsError, match="not a readable safetensors"):
        worker.load_weights(tmp_path / "v1", None, 2)
    file.write_bytes(data)
    cfg_file = tmp_path / "v1" / adapters.CONFIG_FILE
    cfg_file.write_text(cfg_file.read_text().replace('"r": 4', '"r": 0'))
    with pytest.raises(WeightsError, match="LoRA config"):
        worker.load_weights(tmp_path / "v1", sha, 2)
    cfg_file.write_text(cfg_file.read_text().replace('"r": 0', '"r": 4'))
    from safetensors.torch import load_file, save_file
    tensors = load_file(file)
    renamed = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}  # a layer the model lacks
    save_file(renamed, str(file))
    with pytest.raises(WeightsError, match="does not have"):
        worker.load_weights(tmp_path / "v1", None, 2)
    wide = {k: torch.cat([v, v], dim=1) if ".lora_A." in k else v for k, v in tensors.items()}  # another model's
    save_file(wide, str(file))
    with pytest.raises(WeightsError, match="the model's weight"):
        worker.load_weights(tmp_path / "v1", None, 2)
    assert worker.version == 1
    assert all(torch.equal(t, serving[n]) for n, t in worker.model.state_dict().items()), "the old version serves"


def test_jet_model_merge_writes_a_folder_transformers_loads(tiny_model, tmp_path):
    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM

    from jet.cli.model import cli
    from jet.trainer.weights import write_version

    cfg = TrainerConfig(lr=1e-2)
    b = TorchBackend(str(tiny_model), cfg, adapter=ADAPTER)
    inputs, rows = step_inputs()
    b.train_step(rows, inputs, lr=cfg.lr)
    with b.full_module() as module:
        write_version(module, tmp_path / "v1")
    result = CliRunner().invoke(cli, ["merge", "--base", str(tiny_model), "--adapter", str(tmp_path / "v1"),
                                      "--out", str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    with torch.no_grad():
        got, want = row_logprobs(merged, rows[0]), row_logprobs(b.model, rows[0])
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    again = CliRunner().invoke(cli, ["merge", "--base", str(tiny_model), "--adapter", str(tiny_model),
                                     "--out", str(tmp_path / "x")])
    assert again.exit_code != 0 and "adapter_config.json" in again.output


def test_a_checkpoint_holds_the_adapter_and_round_trips_it(tiny_model, tmp_path):
    cfg = TrainerConfig(lr=1e-2)
    inputs, rows = step_inputs()
    a = TorchBackend(str(tiny_model), cfg, adapter=ADAPTER)
    a.train_step(rows, inputs, lr=cfg.lr)
    a.save(tmp_path)
    assert (tmp_path / ADAPTER_CHECKPOINT_FILE).is_file() and not (tmp_path / "model.safetensors").exists()
    expected_rand = torch.rand(3)
    after_a = a.train_step(rows, inputs, lr=cfg.lr)
    b = TorchBackend(str(tiny_model), cfg, adapter=ADAPTER)
    b.load(tmp_path)
    assert torch.equal(torch.rand(3), expected_rand)
    after_b = b.train_step(rows, inputs, lr=cfg.lr)
    assert after_b.loss == after_a.loss
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n

    with pytest.raises(ValueError, match="adapter"):  # another rank
        TorchBackend(str(tiny_model), cfg, adapter=AdapterConfig(r=2)).load(tmp_path)
    with pytest.raises(ValueError, match="adapter"):  # a full-training trainer on an adapter checkpoint
        TorchBackend(str(tiny_model), cfg).load(tmp_path)
    full = tmp_path / "full"
    full.mkdir()
    TorchBackend(str(tiny_model), cfg).save(full)
    with pytest.raises(ValueError, match="adapter"):  # and the other way round
        TorchBackend(str(tiny_model), cfg, adapter=ADAPTER).load(full)


def test_adapter_settings_are_checked_with_their_key():
    model = {"name": "m", "path": "p", "adapter": {"r": 8, "target_modules": ["q_proj", "v_proj"]}}
    cfg = load({"models": [model]})
    assert cfg.models[0].adapter == AdapterConfig(r=8, target_modules=["q_proj", "v_proj"])
    assert load({"models": [{"name": "m", "path": "p"}]}).models[0].adapter is None, "full training by default"
    with pytest.raises(ConfigError, match=r"models\[0\]\.adapter\.rank"):
        load({"models": [{"name": "m", "path": "p", "adapter": {"rank": 8}}]})
    with pytest.raises(ConfigError, match=r"models\[0\]\.adapter\.dropout"):
        load({"models": [{"name": "m", "path": "p", "adapter": {"dropout": 1.0}}]})
    ds = load({"models": [{**model, "trainer": {"backend": "deepspeed"}}]})  # tests/trainer/test_deepspeed.py
    assert ds.trainer_of("m").backend == "deepspeed" and ds.models[0].adapter.r == 8


def test_a_bfloat16_step_trains_the_adapter_alone_and_publishes_it_in_bfloat16(tiny_model, tmp_path):
    from safetensors.torch import load_file

    from jet import adapters
    from jet.trainer.weights import write_version
    from jet.workers.inference.hf import HFBackend

    cfg = TrainerConfig(lr=1e-2, dtype="bfloat16", device="cpu")
    b = TorchBackend(str(tiny_model), cfg, adapter=ADAPTER)
    inputs, rows = step_inputs()
    before = {n: p.detach().clone() for n, p in b.model.named_parameters()}
    stats = b.train_step(rows, inputs, lr=cfg.lr)
    assert stats.grad_norm > 0 and torch.isfinite(torch.tensor(stats.loss))
    moved = {n for n, p in b.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(".lora_B." in n for n in moved), "with B = 0 the first step moves B alone"
    assert {p.dtype for p in b.model.parameters()} == {torch.float32}, "master weights stay float32"
    with b.full_module() as module:
        sha = write_version(module, tmp_path / "v1", cfg.dtype)
    assert {t.dtype for t in load_file(tmp_path / "v1" / adapters.ADAPTER_FILE).values()} == {torch.bfloat16}
    worker = HFBackend(tiny_model)  # a float32 worker merges the bfloat16 adapter
    worker.load_weights(tmp_path / "v1", sha, 1)
    with torch.no_grad():
        served, trained = row_logprobs(worker.model, rows[0]), row_logprobs(b.model, rows[0])
    assert torch.allclose(served, trained, atol=1e-2, rtol=0), "the adapter rounded to bfloat16"
    assert not torch.equal(served, row_logprobs(HFBackend(tiny_model).model, rows[0]))
