"""The hf backend's prefix cache (jet.workers.inference.prefix_cache): prompts that start with tokens
already computed give the same generations and logprobs as without the cache, greedy and sampled with
fixed seeds, in the batch API and the continuous-batching engine, for a GRPO group's shared prompt and an
episode's next turn; fewer prompt tokens are computed; a weight load empties it; memory stays bounded."""

import anyio
import pytest
import torch
from safetensors.torch import load_file, save_file

from jet.models import init_model
from jet.workers.inference.backend import SamplingParams
from jet.workers.inference.hf import HFBackend
from jet.workers.inference.prefix_cache import PrefixCache, shared_heads
from tests.weights import perturbed_weights

ATOL = 1e-4  # float32: as tests/workers/inference/test_hf_engine.py (a row in a merged, padded batch)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = init_model(tmp_path_factory.mktemp("m") / "tiny", vocab_size=512, hidden_size=32, layers=2, heads=4,
                     kv_heads=2, max_position=256, seed=0)
    state = load_file(out / "model.safetensors")
    state["lm_head.weight"] = state["lm_head.weight"] * 40  # peaked distributions, as the engine's tests
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


SYSTEM = [(13 * k) % 500 + 3 for k in range(60)]  # the shared "system prompt"


def group_turn1(size: int = 6):
    out = []
    for i in range(size):
        task = SYSTEM + [(7 * (i // 2) + k) % 500 + 3 for k in range(5)]  # pairs of members share a task
        sp = SamplingParams(temperature=[0.0, 1.0, 0.7][i % 3], top_p=[1.0, 0.9][i % 2], max_tokens=6 + i,
                            seed=10 + i)
        out.append((task, sp))
    return out


def next_turn(reqs, outs, extra: int = 4):
    return [(prompt + out.token_ids + [(5 * i + k) % 500 + 3 for k in range(extra)],
             SamplingParams(temperature=sp.temperature, top_p=sp.top_p, max_tokens=5, seed=sp.seed + 100))
            for i, ((prompt, sp), out) in enumerate(zip(reqs, outs))]


def same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=ATOL)


def test_batch_api_turns_reuse_the_group_prompt_and_the_previous_turn(model_dir):
    cached, plain = HFBackend(model_dir), HFBackend(model_dir, prefix_cache_mb=0)
    turn1 = group_turn1()
    a1, b1 = cached.generate(*zip(*turn1)), plain.generate(*zip(*turn1))
    same(a1, b1)
    stats = cached.prefix_cache.stats
    assert stats.shared_prefills >= 1  # the members' shared heads were computed once, before their rows
    first = stats.computed_tokens
    assert first < sum(len(p) for p, _ in turn1) - 4 * len(SYSTEM)  # the system prompt is not computed 6x
    turn2 = next_turn(turn1, a1)
    a2, b2 = cached.generate(*zip(*turn2)), plain.generate(*zip(*turn2))
    same(a2, b2)
    assert any(o.token_ids for o in a2)
    # turn 2 computed its new tokens and the last generated token of turn 1 (never fed), little more
    assert stats.computed_tokens - first <= sum(len(p) - len(q) - len(o.token_ids) + 1
                                                for (p, _), (q, _), o in zip(turn2, turn1, a1)) + len(turn2)
    assert plain.prefix_cache.stats.reused_tokens == 0 and len(plain.prefix_cache) == 0


def test_engine_rows_with_cached_heads_join_a_running_batch(model_dir):
    cached, plain = HFBackend(model_dir), HFBackend(model_dir, prefix_cache_mb=0)
    turn1 = group_turn1()

    async def run(backend, reqs):
        outs = [None] * len(reqs)

        async def one(i):
            await anyio.sleep(i * 0.003)  # arriving one after the other: rows join a batch in flight
            outs[i] = await backend.agenerate_one(*reqs[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(reqs)):
                tg.start_soon(one, i)
        return outs

    a1, b1 = anyio.run(run, cached, turn1), anyio.run(run, plain, turn1)
    same(a1, b1)
    turn2 = next_turn(turn1, a1)
    reused = cached.prefix_cache.stats.reused_tokens
    same(anyio.run(run, cached, turn2), anyio.run(run, plain, turn2))
    assert cached.prefix_cache.stats.reused_tokens - reused >= sum(len(p) for p, _ in turn1)


def test_a_weight_load_empties_the_cache(model_dir, tmp_path):
    backend = HFBackend(model_dir)
    turn1 = group_turn1(2)
    backend.generate(*zip(*turn1))
    assert len(backend.prefix_cache) > 0
    path, _ = perturbed_weights(model_dir, tmp_path / "v1", seed=1, scale=0.05)
    backend.load_weights(path, version=1)
    assert len(backend.prefix_cache) == 0
    fresh = HFBackend(model_dir, prefix_cache_mb=0)
    fresh.load_weights(path, version=1)
    same(backend.generate(*zip(*turn1)), fresh.generate(*zip(*turn1)))


def kv(n: int, layers: int = 2):
    return [(torch.zeros(1, 2, n, 4), torch.zeros(1, 2, n, 4)) for _ in range(layers)]


def test_entries_are_bounded_least_recently_used_first_and_heads_are_subsumed():
    per_token = 2 * 2 * (2 * 4 * 4)  # layers x (keys, values) x kv_heads*head_dim*4 bytes
    cache = PrefixCache(10 * per_token)
    cache.put((1, 2, 3), kv(3))
    cache.put((1, 2, 3, 4, 5), kv(5))  # (1, 2, 3) is a head of it: replaced
    assert list(cache.entries) == [(1, 2, 3, 4, 5)] and cache.bytes == 5 * per_token
    cache.put((1, 2), kv(2))  # a head of a stored entry: nothing to add
    assert list(cache.entries) == [(1, 2, 3, 4, 5)]
    cache.put((7, 8, 9), kv(3))
    assert cache.match([1, 2, 3, 9, 9]) == ((1, 2, 3, 4, 5), 3)
    assert cache.match([1, 2, 3, 4, 5]) == ((1, 2, 3, 4, 5), 4)  # never the whole prompt
    assert [k.shape[2] for k, _ in cache.get((1, 2, 3, 4, 5), 3)] == [3, 3]  # and now it is the newest
    cache.put((5, 6, 7, 8), kv(4))  # 12 tokens > 10: the least recently used, (7, 8, 9), goes
    assert list(cache.entries) == [(1, 2, 3, 4, 5), (5, 6, 7, 8)] and cache.bytes == 9 * per_token
    assert cache.match([4, 4]) == (None, 0)
    cache.put(tuple(range(100, 120)), kv(20))  # larger than the whole budget: not stored
    assert cache.bytes <= cache.max_bytes and tuple(range(100, 120)) not in cache.entries


def test_shared_heads_are_those_several_prompts_share_past_their_hits():
    a, b, c = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9], [7, 8, 9]
    assert shared_heads([a, b, c], [0, 0, 0], min_gain=2) == [(1, 2, 3, 4)]
    assert shared_heads([a, b, c], [3, 3, 0], min_gain=2) == []  # one token past the cache: not worth it
    assert shared_heads([a, list(a)], [0, 0], min_gain=2) == [(1, 2, 3, 4, 5)]  # identical: all but the last
