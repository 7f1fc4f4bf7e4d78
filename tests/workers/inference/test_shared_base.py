"""Several models as adapters of one base in one inference worker (`HFBackend(slots=N)`,
`jet.workers.inference.served_adapters.RowAdapters`, `jet worker infer --model a --model b`): rows of
different adapters in one batch compute what each adapter merged alone computes (tokens and logprobs),
each model keeps its own versions and its own prefix cache of its own size (`models[].prefix_cache_mb`),
a bad or full-weights version is refused without touching the others; and a real worker process serves
two models' streams from one base, each with its own versions."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
import yaml

from jet.config import AdapterConfig, TrainerConfig, load_file
from jet.errors import WeightsError
from jet.keys import Keys
from jet.trainer.backend_torch import TorchBackend
from jet.trainer.batch import build_step
from jet.trainer.packing import pack
from jet.trainer.weights import write_version
from jet.workers.inference.backend import SamplingParams
from jet.workers.inference.hf import HFBackend
from tests.trainer.test_step import small_batch
from tests.workers.conftest import wait_for

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [3, 4]]


def trained_adapters(tiny_model, folder, specs) -> list:
    """One adapter version folder per (AdapterConfig, seed, steps): what trainers publish."""
    inputs = build_step(small_batch(), advantage="grpo", loss_agg="token_mean", prefix_trees=False)
    rows = pack(inputs.samples, 64)
    out = []
    for i, (adapter, seed, steps) in enumerate(specs):
        trainer = TorchBackend(str(tiny_model), TrainerConfig(lr=0.05, seed=seed), adapter=adapter)
        for _ in range(steps):
            trainer.train_step(rows, inputs, lr=0.05)
        with trainer.full_module() as module:
            out.append((folder / f"a{i}" / "v1", write_version(module, folder / f"a{i}" / "v1")))
    return out


def requests(n_slots: int):
    """Every prompt on every slot, greedy and seeded-sampled: (prompts, params, slots)."""
    prompts, params, slots = [], [], []
    for slot in range(n_slots):
        for j, p in enumerate(PROMPTS):
            for sp in (SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=1.0, max_tokens=6,
                                                                                   seed=100 * slot + j)):
                prompts.append(p), params.append(sp), slots.append(slot)
    return prompts, params, slots


def test_rows_of_several_adapters_in_one_batch_compute_each_adapter_alone(tiny_model, tmp_path):
    (a, sha_a), (b, sha_b) = trained_adapters(tiny_model, tmp_path, [
        (AdapterConfig(r=4, alpha=16.0), 1, 3),
        (AdapterConfig(r=8, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"]), 2, 4)])
    shared = HFBackend(tiny_model, slots=3)  # slot 2 serves the base
    shared.load_weights(a, sha_a, 1, slot=0)
    shared.load_weights(b, sha_b, 1, slot=1)
    assert shared.versions == [1, 1, 0]
    alone = [HFBackend(tiny_model), HFBackend(tiny_model), HFBackend(tiny_model)]
    alone[0].load_weights(a, sha_a, 1)
    alone[1].load_weights(b, sha_b, 1)

    prompts, params, slots = requests(3)
    for round_ in range(2):  # the second round starts from each slot's prefix cache
        got = shared.generate(prompts, params, slots)
        for g, p, sp, slot in zip(got, prompts, params, slots):
            [want] = alone[slot].generate([p], [sp])
            assert g.finish_reason != "error" and g.version == (0 if slot == 2 else 1)
            assert g.token_ids == want.token_ids, (round_, slot, sp)
            assert g.logprobs == pytest.approx(want.logprobs, abs=1e-5), (round_, slot, sp)
    assert all(c.stats.reused_tokens > 0 for c in shared.prefix_caches), "each slot reused its own prefixes"
    # the adapters differ: the same greedy request is not the same on every slot
    outs = {tuple(x.logprobs) for x, sp in zip(shared.generate(prompts, params, slots), params) if sp.seed is None}
    assert len(outs) == len(prompts) // 2

    # a prompt cached on slot 0 is not reused by slot 1 (its keys and values are slot 0's)
    fresh = HFBackend(tiny_model, slots=2)
    fresh.load_weights(a, sha_a, 1, slot=0)
    fresh.load_weights(b, sha_b, 1, slot=1)
    long = list(range(3, 40))
    fresh.generate([long], [SamplingParams(temperature=0, max_tokens=4)], [0])
    [g] = fresh.generate([long + [41]], [SamplingParams(temperature=0, max_tokens=6)], [1])
    [want] = alone[1].generate([long + [41]], [SamplingParams(temperature=0, max_tokens=6)])
    assert fresh.prefix_caches[1].stats.reused_tokens == 0
    assert g.token_ids == want.token_ids and g.logprobs == pytest.approx(want.logprobs, abs=1e-5)


def test_a_slot_takes_its_own_versions_and_refuses_what_it_cannot_serve(tiny_model, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    [(a, sha_a), (b, sha_b)] = trained_adapters(tiny_model, tmp_path, [(AdapterConfig(r=4, alpha=16.0), 1, 2),
                                                                       (AdapterConfig(r=4, alpha=16.0), 3, 2)])
    shared = HFBackend(tiny_model, slots=2)
    shared.load_weights(a, sha_a, 1, slot=0)
    shared.load_weights(a, sha_a, 1, slot=1)
    prompts, params, slots = requests(2)
    before = shared.generate(prompts, params, slots)
    shared.load_weights(b, sha_b, 5, slot=1)  # slot 1 moves on; slot 0 does not
    assert shared.versions == [1, 5]
    after = shared.generate(prompts, params, slots)
    for x, y, slot in zip(before, after, slots):
        if slot == 0:
            assert x.token_ids == y.token_ids and x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    moved = [x.token_ids != y.token_ids or x.logprobs != pytest.approx(y.logprobs, abs=1e-3)
             for x, y, s in zip(before, after, slots) if s == 1]
    assert all(moved), "slot 1 serves its new adapter"

    # refused, each with its reason; nothing served changes
    with pytest.raises(WeightsError, match="loads their adapters only"):
        shared.load_weights(tiny_model / "model.safetensors", None, 6, slot=1)
    bad = tmp_path / "bad" / "v6"
    bad.mkdir(parents=True)
    (bad / "adapter_config.json").write_text((b / "adapter_config.json").read_text())
    tensors = load_file(str(b / "adapter_model.safetensors"))
    name = next(n for n in tensors if "lora_A" in n)
    tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 1)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(WeightsError, match="features"):
        shared.load_weights(bad, None, 6, slot=1)
    with pytest.raises(WeightsError, match="sha256 mismatch"):
        shared.load_weights(b, "0" * 64, 6, slot=0)
    assert shared.versions == [1, 5]
    again = shared.generate(prompts, params, slots)
    for x, y in zip(again, after):
        assert x.token_ids == y.token_ids and x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


def test_each_slot_keeps_a_prefix_cache_of_its_own_size(tiny_model):
    """A slot's prefix cache is its model's size, whatever the others': 0 turns reuse off for that model
    alone, and what is served is the same either way."""
    shared = HFBackend(tiny_model, slots=2, prefix_cache_mb=[0, 1])
    assert [c.max_bytes for c in shared.prefix_caches] == [0, 2**20]
    long, greedy = list(range(3, 40)), SamplingParams(temperature=0, max_tokens=4)
    [want] = HFBackend(tiny_model, prefix_cache_mb=0).generate([long], [greedy])
    for _ in range(2):  # the second round finds the first's prompt and completion, where they were kept
        for got in shared.generate([long, long], [greedy, greedy], [0, 1]):
            assert got.token_ids == want.token_ids and got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    off, on = shared.prefix_caches
    assert len(off) == 0 and off.stats.reused_tokens == 0 and off.stats.prompt_tokens == 2 * len(long)
    assert len(on) == 1 and on.stats.reused_tokens > 0
    with pytest.raises(ValueError, match="2 prefix cache sizes for 3 slots"):
        HFBackend(tiny_model, slots=3, prefix_cache_mb=[1, 2])


@pytest.mark.anyio
async def test_a_shared_worker_gives_each_model_its_own_prefix_cache_setting(redis_url, tmp_path, tiny_model,
                                                                              monkeypatch):
    """`jet worker infer --model left --model right`: each model's cache is its `models[].prefix_cache_mb`
    (not their sum split evenly: a model would get the average, not its setting)."""
    import anyio

    from jet.queues.connect import connect
    from jet.workers.inference import worker

    keys = Keys(f"shared-cache-{uuid.uuid4().hex[:8]}")  # a server kept between runs holds older keys
    data = team_config(tmp_path / "c.yaml", keys.run, tiny_model)
    data["models"][0]["prefix_cache_mb"], data["models"][1]["prefix_cache_mb"] = 1, 3
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    made, real = [], worker.make_backend
    monkeypatch.setattr(worker, "make_backend", lambda *args: made.append(real(*args)) or made[-1])  # the real one

    r = await connect(redis_url)
    stop = anyio.Event()

    async def serving() -> bool:  # the base loaded, a view per model, both request streams' groups made
        return bool(made) and len(made[0].versions) == 2 and all([await r.exists(keys.gen(m)) for m in ("left", "right")])

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: worker.run_shared(load_file(tmp_path / "c.yaml"), ["left", "right"], redis_url, stop))
            await wait_for(serving, timeout=60, every=0.05)
            stop.set()
    finally:
        await r.aclose()
    [backend] = made
    assert len(backend.versions) == 2, "one base for both"
    assert [backend.view(i).prefix_cache.max_bytes for i in range(2)] == [1 * 2**20, 3 * 2**20]


def team_config(path, run: str, tiny_model, share_base: bool = True) -> dict:
    data = {"run": run, "runs_dir": str(path.parent / "runs"), "queues": {"lease_ms": 3000, "block_ms": 200},
            "models": [{"name": n, "path": str(tiny_model), "adapter": {"r": 4, "share_base": share_base}}
                       for n in ("left", "right")]
            + [{"name": "judge", "path": str(tiny_model), "trainable": False}],
            "tasks": [{"name": "t", "workflow": "a.b:c", "dataset": "guess", "model": "left"}],
            "trainer": {"min_group_size": 1}}
    path.write_text(yaml.safe_dump(data))
    return data


def test_serving_groups_put_adapters_of_one_base_together(tmp_path, tiny_model):
    from jet.cli.up import roles_for

    team_config(tmp_path / "c.yaml", "r", tiny_model)
    cfg = load_file(tmp_path / "c.yaml")
    assert cfg.serving_groups() == [["left", "right"], ["judge"]]
    roles = {c.name: c.argv for c in roles_for(cfg, str(tmp_path / "c.yaml"), (), 1)}
    assert "infer-left+right" in roles and "infer-judge" in roles
    assert roles["infer-left+right"][-4:] == ["--model", "left", "--model", "right"]
    team_config(tmp_path / "d.yaml", "r", tiny_model, share_base=False)
    assert load_file(tmp_path / "d.yaml").serving_groups() == [["left"], ["right"], ["judge"]]
    # a worker asked to serve models that are not adapters of one base says why
    from click.testing import CliRunner

    from jet.workers.inference.worker import cli

    out = CliRunner().invoke(cli, ["--config", str(tmp_path / "c.yaml"), "--model", "left", "--model", "judge",
                                   "--redis-url", "redis://127.0.0.1:1"])
    assert out.exit_code == 2 and "not adapters of one base" in out.output, out.output


@pytest.mark.slow
@pytest.mark.anyio
async def test_one_worker_process_serves_two_adapter_models_from_one_base(redis_url, tmp_path, tiny_model):
    from jet.llm import Tokenizers, open_client
    from jet.queues.connect import connect
    from jet.wire import WeightVersion
    from tests.workers.conftest import HOST

    keys = Keys(f"shared-base-{uuid.uuid4().hex[:8]}")
    team_config(tmp_path / "c.yaml", keys.run, tiny_model)
    runs = tmp_path / "runs" / keys.run / "weights"
    folders = trained_adapters(tiny_model, tmp_path / "src", [(AdapterConfig(r=4, alpha=16.0), 1, 3),
                                                              (AdapterConfig(r=4, alpha=16.0), 2, 3),
                                                              (AdapterConfig(r=4, alpha=16.0), 3, 3)])
    local = [HFBackend(tiny_model) for _ in folders]
    for backend, (folder, sha) in zip(local, folders):
        backend.load_weights(folder, sha, 1)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    want = [backend.generate([PROMPTS[1]], [greedy])[0] for backend in local]
    [base] = HFBackend(tiny_model).generate([PROMPTS[1]], [greedy])

    r = await connect(redis_url)
    log = open(tmp_path / "infer.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jet.workers.inference.worker", "--config", str(tmp_path / "c.yaml"),
                             "--model", "left", "--model", "right", "--redis-url", redis_url],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        async def announce(model: str, version: int, i: int) -> None:
            import shutil

            folder, sha = folders[i]
            dest = runs / model / f"v{version}"
            shutil.copytree(folder, dest)
            await r.xadd(keys.weights(model), WeightVersion(model, version, str(dest), sha, version).to_fields())

        async with open_client(redis_url, keys, Tokenizers({"left": str(tiny_model), "right": str(tiny_model)}),
                               timeout_s=60) as client:
            left, right = client.session("e1", "left"), client.session("e2", "right")

            async def served(llm, version):
                got = await llm.generate(PROMPTS[1], max_tokens=6, temperature=0)
                return got if got.version == version else None

            first = await right.generate(PROMPTS[1], max_tokens=6, temperature=0)
            assert first.version == 0 and list(first.token_ids) == base.token_ids
            await announce("left", 1, 0)
            got = await wait_for(lambda: served(left, 1), timeout=60, every=0.05)
            assert list(got.token_ids) == want[0].token_ids
            assert list(got.logprobs) == pytest.approx(want[0].logprobs, abs=1e-5)
            still = await right.generate(PROMPTS[1], max_tokens=6, temperature=0)
            assert still.version == 0 and list(still.logprobs) == pytest.approx(base.logprobs, abs=1e-5)
            await announce("right", 3, 1)
            got = await wait_for(lambda: served(right, 3), timeout=60, every=0.05)
            assert list(got.logprobs) == pytest.approx(want[1].logprobs, abs=1e-5)
            await announce("left", 2, 2)
            got = await wait_for(lambda: served(left, 2), timeout=60, every=0.05)
            assert list(got.logprobs) == pytest.approx(want[2].logprobs, abs=1e-5)
            assert (await right.generate(PROMPTS[1], max_tokens=6, temperature=0)).version == 3
        # one process, each model its own consumer on its own stream
        for model in ("left", "right"):
            consumers = await r.xinfo_consumers(keys.gen(model), "infer")
            assert [c["name"] for c in consumers] == [f"{HOST}-infer-{model}-0".encode()]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
        await r.aclose()
    text = (tmp_path / "infer.log").read_text()
    assert "one " in text and "for 2 models: left, right" in text, text[-2000:]


def test_keeping_the_base_at_start_changes_nothing_served(tiny_model, tmp_path):
    """A worker of one adapter model keeps the base's copy of the adapted layers at start (`keep_base_of`):
    the first version then serves exactly as without it, whatever the targets it expected."""
    import torch

    [(a, sha)] = trained_adapters(tiny_model, tmp_path, [(AdapterConfig(r=4, alpha=16.0), 1, 2)])
    late = HFBackend(tiny_model)
    late.load_weights(a, sha, 1)
    for targets in ("all-linear", ["q_proj"]):
        early = HFBackend(tiny_model)
        assert early.keep_base_of(targets) > 0
        early.load_weights(a, sha, 1)
        assert set(early.adapters.base) == set(late.adapters.base), targets
        live, want = early.model.state_dict(), late.model.state_dict()
        assert all(torch.equal(live[k], want[k]) for k in want), targets
