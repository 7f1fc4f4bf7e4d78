"""Poison and long episodes never stop training: each bad trajectory fails alone, with its real reason.

Against a real Redis and the real trainer loop on a tiny model:
- a trajectory with a token id outside the vocabulary is dead-lettered alone
  on intake with that reason; its group trains on without it, and so does
  every other group;
- long episodes: a tree larger than the micro-batch whose
  paths fit is split; a path longer than the micro-batch is truncated
  (`overlong: truncate`, counted) or dead-lettered alone
  (`overlong: dead_letter`);
- the step guard, with the screen bypassed (a fault it cannot see): the
  model raises on one trajectory's tokens inside the optimiser step; that
  trajectory is dead-lettered with the model's own error and the step trains
  the rest.
"""

from __future__ import annotations

import math
import random

import anyio
import pytest
import torch

from jet.config import load_file
from jet.queues import codec
from jet.queues.connect import connect
from jet.runs import read_metrics as read
from jet.timeline import Call
from jet.trainer.backend_torch import TorchBackend
from jet.trainer.checkpoint import Checkpoints
from jet.trainer.groups import Assembler
from jet.trainer.guard import guarded, guarded_step, prepare
from jet.trainer.intake import Intake
from jet.trainer.link import Link
from tests.trainer.helpers import MODEL, traj
from tests.trainer.rollouts import produce_sync, stream_state, synthetic_group, write_config
from tests.trainer.test_trainer_redis import trainer_dir


def call(prompt, completion, version=0):
    return Call(tuple(prompt), tuple(completion), [-0.5] * len(completion), version, MODEL, "a")


def dead_letters(url, keys) -> dict[str, str]:
    """entry id -> reason of every dead letter of the run."""
    async def go():
        r = await connect(url)
        try:
            out = {}
            for _, f in await r.xrange(keys.dead):
                meta = codec.decode(f, max_bytes=1 << 62).meta
                out[meta["entry_id"]] = meta["reason"]
            return out
        finally:
            await r.aclose()

    return anyio.run(go)


def entry_ids(url, keys) -> list[str]:
    async def go():
        r = await connect(url)
        try:
            return [i.decode() for i, _ in await r.xrange(keys.traj(MODEL))]
        finally:
            await r.aclose()

    return anyio.run(go)


def check_ledger_and_dead(cfg, url, keys, produced, poisoned: set[str], trained: set[str]) -> list[dict]:
    """Every produced entry ends once: in the ledger or (the poisoned ones) in dead, never both."""
    ledger = Checkpoints(trainer_dir(cfg)).consumed()
    in_ledger = [c["msg"] for c in ledger]
    assert len(in_ledger) == len(set(in_ledger))
    assert set(in_ledger) | poisoned == {t.msg_id for t in produced} and not set(in_ledger) & poisoned
    assert {c["msg"] for c in ledger if c["outcome"] == "trained"} == trained
    assert anyio.run(stream_state, url, keys)["pending"] == 0
    return ledger


@pytest.mark.slow
@pytest.mark.parametrize("bad_id", [600, -3])
def test_a_token_outside_the_vocabulary_is_dead_lettered_alone(bad_id, tiny_model, redis_url, keys, tmp_path):
    from jet.trainer import loop

    rng = random.Random(0)
    cfg = load_file(write_config(tmp_path / "c.yaml", keys.run, tiny_model, tmp_path / "runs", steps=3,
                                 batch_groups=1, checkpoint_every=1))
    innocent = [t for g in range(2) for t in synthetic_group(f"g{g}", 2, rng)]
    poison = traj("p", 2, size=3, calls=[call([1, 2, 3], [7, bad_id, 9])])
    mixed = [traj("p", 0, size=3), poison, traj("p", 1, size=3)]
    produced = innocent[:2] + mixed + innocent[2:]
    produce_sync(redis_url, keys, produced)
    ids = dict(zip((t.msg_id for t in produced), entry_ids(redis_url, keys)))
    state = loop.run(cfg, MODEL, redis_url, lambda: False)
    assert state.step == 3
    dead = dead_letters(redis_url, keys)
    assert list(dead) == [ids[poison.msg_id]]
    assert f"id {bad_id} is outside the model's vocabulary [0, 512)" in dead[ids[poison.msg_id]]
    trained = {t.msg_id for t in produced} - {poison.msg_id}
    check_ledger_and_dead(cfg, redis_url, keys, produced, {poison.msg_id}, trained)
    assert read(trainer_dir(cfg) / "metrics.jsonl")[-1]["counts/poison"] == 1


def long_episodes(budget: int):
    """A group whose first member is a tree larger than `budget` with every path shorter, and a group
    whose first member has one linear path of budget + 6 tokens; the other members are short."""
    prompt = list(range(10, 20))
    tree = [call(prompt, list(range(100, 108))), call(prompt, list(range(200, 208)))]  # 26 tokens, paths of 18
    linear = [call(prompt, list(range(300, 300 + budget - 4)))]  # a path of budget + 6 tokens
    split = [traj("split", 0, size=2, calls=tree, mode="tree"), traj("split", 1, size=2)]
    cut = [traj("cut", 0, size=3, calls=linear), traj("cut", 1, size=3), traj("cut", 2, size=3)]
    return split, cut


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["truncate", "dead_letter"])
def test_long_episodes_are_split_truncated_or_dead_lettered_alone(policy, tiny_model, redis_url, keys, tmp_path):
    from jet.trainer import loop

    budget = 24
    cfg = load_file(write_config(tmp_path / "c.yaml", keys.run, tiny_model, tmp_path / "runs", steps=1,
                                 batch_groups=2, micro_batch_tokens=budget, overlong=policy))
    split, cut = long_episodes(budget)
    assert len(split[0].samples[0]) == 26 > budget and max(split[0].samples[0].positions) < budget
    produced = split + cut
    produce_sync(redis_url, keys, produced)
    ids = dict(zip((t.msg_id for t in produced), entry_ids(redis_url, keys)))
    assert loop.run(cfg, MODEL, redis_url, lambda: False).step == 1
    row = read(trainer_dir(cfg) / "metrics.jsonl")[-1]
    dead = dead_letters(redis_url, keys)
    long_one = cut[0].msg_id
    assert 0 < row["train/entropy"] < 2 * math.log(512)  # untrained tiny model: near log(its 512-token vocabulary)
    if policy == "truncate":
        assert dead == {}
        check_ledger_and_dead(cfg, redis_url, keys, produced, set(), {t.msg_id for t in produced})
        assert (row["counts/truncated"], row["counts/truncated_tokens"]) == (1, 6)
        # the tree trains whole (16 tokens), the linear one its first budget - 10 completion tokens
        assert row["train/tokens"] == 16 + (budget - 10) + 3 * 2
    else:
        assert list(dead) == [ids[long_one]] and f"a path of {budget + 6} tokens" in dead[ids[long_one]]
        check_ledger_and_dead(cfg, redis_url, keys, produced, {long_one}, {t.msg_id for t in produced} - {long_one})
        assert row["train/tokens"] == 16 + 3 * 2 and "counts/truncated" not in row


@pytest.mark.slow
def test_a_step_that_fails_on_one_trajectory_trains_the_rest(tiny_model, redis_url, keys, tmp_path):
    cfg = load_file(write_config(tmp_path / "c.yaml", keys.run, tiny_model, tmp_path / "runs", steps=1))
    tc = cfg.trainer_of(MODEL)
    other = [call([1, 2, 3], [6, 8])]  # rewards differ and so do the tokens: a gradient that does not cancel
    good = [traj("g", 0, size=2), traj("g", 1, size=2, reward=0.0, calls=other)]
    poison = traj("p", 2, size=3, calls=[call([1, 2, 3], [7, 5000, 9])])
    members = [traj("p", 0, size=3), traj("p", 1, size=3, reward=0.0, calls=other), poison]
    produce_sync(redis_url, keys, good + members)
    engine = TorchBackend(str(tiny_model), tc)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    with Link.for_trainer(cfg, MODEL, redis_url) as link:
        asm = Assembler(min_size=2, timeout_s=60, max_staleness=100)
        intake = Intake(link, asm)  # no screen: the model itself meets the bad id, inside the step
        groups = intake.gather(2, 0, 0, lambda: False)
        inputs, rows = prepare([g.trajectories() for g in groups], tc)
        groups, inputs, rows, stats = guarded_step(engine, intake, tc, groups, inputs, rows, 1e-3, 0)
        assert stats is not None and stats.tokens == 4 * 2  # the 4 innocent members, not the poison
        assert [sorted(g.members) for g in groups] == [[0, 1], [0, 1]]
        intake.trained(groups, 1, 0)
        consumed = intake.take_consumed()
        assert sorted(c["msg"] for c in consumed) == sorted(t.msg_id for t in good + members[:2])
        link.ack([(c["entry"], c["msg"]) for c in consumed])
    [reason] = dead_letters(redis_url, keys).values()
    assert reason.startswith("trainer: IndexError") and "index out of range" in reason
    assert anyio.run(stream_state, redis_url, keys)["pending"] == 0
    unchanged = [n for n, p in engine.model.named_parameters() if torch.equal(p, before[n])]
    assert unchanged == [], "the step trained on the rest"


def test_a_failure_no_trajectory_causes_alone_is_raised():
    class Boom(Exception):
        pass

    def attempt(groups):
        raise Boom("the disk is full")

    with pytest.raises(Boom):
        guarded(None, [], 0, attempt, lambda traj: None)
