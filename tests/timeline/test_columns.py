"""The per-token columns of a Sample, declared once (`jet.timeline.COLUMNS`), and everything that derives
from the declaration: the merge, the group prefix trees, the split, the wire and the trainer's packing.

The per-token weight version is the worked example: a version each call records travels with its tokens
through merge -> wire -> group prefix trees -> split -> wire -> packing and arrives, per token, in the
packed row's `versions` tensor next to the behaviour logprobs.
"""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch

from jet import sampling
from jet.queues import codec
from jet.timeline import COLUMNS, Call, Episode, Sample, merge_calls, merge_episodes, split_sample
from jet.timeline.model import CARRIED, PACKED
from jet.timeline.share import share_prefixes
from jet.trainer.batch import build_step
from jet.trainer.packing import FLOAT_TENSORS, INT_TENSORS, Row, pack, pack_row, padded_row
from jet.wire import GenRequest, Trajectory


def over_the_wire(samples, model: str = "m") -> tuple[Sample, ...]:
    fields = Trajectory("t", "g", 0, "e", model, 1.0, tuple(samples)).to_fields()
    return Trajectory.from_payload(codec.decode(fields)).samples


def trajectory(index: int, calls: list[Call]) -> Trajectory:
    samples = tuple(merge_calls(calls, "exact", episode_id=f"e{index}", reward=float(index)))
    return Trajectory("t", "g", index, f"e{index}", "m", float(index), samples, group_size=2)


def trained_in_rows(rows: list[Row]) -> dict[tuple[int, ...], tuple[int, float, float]]:
    """{token path from its root: (version, behaviour logprob, temperature)} of every trained token of the rows."""
    out: dict[tuple[int, ...], tuple[int, float, float]] = {}
    for row in rows:
        for b in range(row.input_ids.shape[0]):
            ids, parents = row.input_ids[b].tolist(), row.parent_index[b].tolist()
            for j in range(len(ids)):
                if not row.loss_mask[b, j]:
                    continue
                path, p = [ids[j]], parents[j]
                while p >= 0:
                    path.append(ids[p])
                    p = parents[p]
                key = tuple(reversed(path))
                assert key not in out, f"{key} trained twice"
                out[key] = (int(row.versions[b, j]), float(row.behaviour_logprobs[b, j]), float(row.temperatures[b, j]))
    return out


def test_each_tokens_version_survives_merge_share_split_the_wire_and_packing():
    system = [1, 2, 3, 4, 5, 6]
    a1 = Call(system + [7], [10, 11, 12], [-0.5, -0.25, -1.0], 3, "m", "a", temperature=0.7)
    a2 = Call(list(a1.ids) + [8], [13, 14], [-0.125, -2.0], 5, "m", "a")  # weights changed between turns
    b1 = Call(system + [9], [20, 21], [-0.75, -1.5], 4, "m", "a", top_p=0.9)
    b2 = Call(list(b1.ids) + [8], [22, 23, 24], [-0.375, -3.0, -0.0625], 8, "m", "a")
    members = [trajectory(0, [a1, a2]), trajectory(1, [b1, b2])]
    f32 = torch.tensor([a1.temperature], dtype=torch.float32).item()  # the column's precision
    expected = {tuple(c.prompt_ids) + c.completion_ids[:k + 1]:
                (c.version, c.completion_logprobs[k], f32 if c is a1 else c.temperature)
                for c in (a1, a2, b1, b2) for k in range(len(c.completion_ids))}
    # merge (the env worker) -> the wire -> the trainer's step with group prefix trees (the system prompt shared)
    sent = [msgspec.structs.replace(t, samples=over_the_wire(t.samples)) for t in members]
    inputs = build_step([sent], advantage="grpo", loss_agg="token_mean", prefix_trees=True)
    [tree] = inputs.samples
    assert not tree.is_linear and tree.tokens[:6] == tuple(system), "the members share one tree"
    # split into pieces small enough to need ancestor copies, each piece over the wire again, then packed
    pieces = [p for piece in split_sample(tree, 14) for p in over_the_wire([piece])]
    assert len(pieces) > 1 and any(p.tokens[:6] == tuple(system) and not p.mask[6] for p in pieces[1:])
    for rows in (pack(pieces, 14, batch_linear=True), [pack_row([p]) for p in pieces]):
        assert trained_in_rows(rows) == expected
        for row in rows:
            assert row.versions.dtype == torch.int64 and row.versions.shape == row.behaviour_logprobs.shape
            assert bool((row.versions[row.loss_mask == 0] == -1).all()), "untrained tokens carry version -1"


def test_every_column_is_declared_once_with_one_spelling():
    names = [c.name for c in COLUMNS]
    assert names == ["tokens", "parents", "mask", "logprobs", "versions", "episodes", "temperatures", "top_ps"]
    per_token = [f.name for f in dataclasses.fields(Sample) if f.name in names]
    assert per_token == names, "every per-token field of Sample is a declared column"
    assert {c.name for c in CARRIED} == set(names) - {"tokens", "parents"}
    # the packed row holds a tensor per packed column, of the declared kind, and nothing under another spelling
    assert {c.row for c in PACKED} == {"loss_mask", "behaviour_logprobs", "versions", "temperatures", "top_ps"}
    for c in PACKED:
        assert c.row in (FLOAT_TENSORS if c.row_kind is float else INT_TENSORS)


def test_every_sampling_setting_has_a_column_and_a_field_in_each_carrier():
    from jet.workers.gateway.chat import Sampling
    from jet.workers.inference.backend import SamplingParams

    columns = {c.name: c for c in COLUMNS}
    for p in sampling.PARAMS:
        c = columns[p.column]
        assert (c.unset, c.source, c.row, c.wire) == (p.neutral, p.name, p.column, "if_needed"), p.name
        assert dataclasses.fields(Call)[[f.name for f in dataclasses.fields(Call)].index(p.name)].default == p.neutral
        assert dataclasses.fields(SamplingParams)[
            [f.name for f in dataclasses.fields(SamplingParams)].index(p.name)].default == p.neutral
        assert getattr(GenRequest(reply_to="r", model="m"), p.name) == p.neutral
        assert p.name in Sampling.model_fields, f"the gateway's bodies take {p.name}"


def test_a_column_travels_only_when_a_receiver_could_not_derive_it():
    plain = merge_calls([Call([1, 2], [3, 4], [-0.5, -0.25], 2, "m")], "exact")
    hot = merge_calls([Call([1, 2], [3, 4], [-0.5, -0.25], 2, "m", temperature=0.5)], "exact")
    tree = merge_episodes([Episode((Call([1], [2], [-1.0], 0, "m"),), "a", 1.0),
                           Episode((Call([1], [3], [-1.0], 1, "m"),), "b", 0.0)], "tree")

    def sent(samples: list[Sample]) -> set[str]:
        return set(codec.decode(Trajectory("t", "g", 0, "e", "m", 1.0, tuple(samples)).to_fields()).arrays)

    assert sent(plain) == {"tokens", "logprobs", "versions"}
    assert sent(hot) == {"tokens", "logprobs", "versions", "temperatures"}, "top_p stayed neutral: not sent"
    assert sent(tree) == {"tokens", "logprobs", "versions", "parents", "episodes"}
    for samples in (plain, hot, tree):
        assert over_the_wire(samples) == tuple(samples)


def test_packing_carries_every_packed_column_with_its_unset_value_on_padding():
    long = merge_calls([Call([1, 2], [3, 4, 5], [-0.5, -0.25, -2.0], 7, "m", temperature=0.5, top_p=0.75)])[0]
    short = merge_calls([Call([1], [6], [-1.0], 9, "m")])[0]
    batch = padded_row([(long, 0), (short, 1)])
    packed = pack_row([long, short])
    for c in PACKED:
        assert getattr(batch, c.row)[0].tolist() == pytest.approx(list(getattr(long, c.name)))
        assert getattr(batch, c.row)[1].tolist() == pytest.approx([*getattr(short, c.name), *[c.unset] * 3])
        assert getattr(packed, c.row)[0].tolist() == pytest.approx([*getattr(long, c.name), *getattr(short, c.name)])
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        batch.nothing  # noqa: B018 - the attribute lookup is the test
