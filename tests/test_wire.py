"""jet.wire rollout messages: round trips, compact samples, and validation that names what is wrong."""

import orjson
import pytest

from jet.errors import CodecError
from jet.queues import codec
from jet.timeline import Call, merge_calls
from jet.wire import GenRequest, GenResult, Task, Trajectory, WeightVersion


def roundtrip(msg):
    return type(msg).from_payload(codec.decode(msg.to_fields()))


def samples():
    c1 = Call([1, 2], [3, 4], [-0.5, -0.25], 0, "m", "a")
    c2 = Call([1, 2, 3, 4, 5], [6], [-1.0], 1, "m", "a")
    c3 = Call([1, 9], [7, 8], [-2.0, -0.125], 1, "m", "b")
    return merge_calls([c1, c2, c3], "tree", episode_id="e", reward=0.5) + merge_calls(
        [c1, c2, c3], "exact", episode_id="e", reward=0.5)


def test_messages_round_trip():
    assert roundtrip(GenRequest("jet:{r}:reply:c", "m", [1, 2, 3], episode_id="e", agent="a", temperature=0.7,
                                top_p=0.9, max_tokens=5, stop_token_ids=[9], seed=4, deadline=12.5)).seed == 4
    assert roundtrip(GenResult("rid", "m", [1, 2], [-0.5, -0.25], "stop", 3, worker="w")).token_ids == (1, 2)
    assert roundtrip(GenResult("rid", "m", [], [], "error", 0, error="too long")).error == "too long"
    assert roundtrip(WeightVersion("m", 3, "/w/v3", "ab" * 32, 30)).version == 3
    assert roundtrip(Task("guess", {"secret": 3}, "g", 1, 4, attempt=2)).attempt == 2


def test_trajectory_carries_tree_and_linear_samples_exactly():
    ss = samples()
    assert any(not s.is_linear for s in ss) and any(s.is_linear for s in ss)
    t = Trajectory("guess", "g", 1, "e", "m", {"a": 1.0, "b": 0.0}, ss, group_size=4, meta={"worker": "w"})
    back = roundtrip(t)
    assert back == t and back.samples == tuple(ss) and back.n_tokens == sum(len(s) for s in ss)
    fields = t.to_fields()
    assert b"i4:tokens" in fields and b"i4:parents" in fields and b"f4:logprobs" in fields
    failed = Trajectory("guess", "g", 2, "e2", "m", 0.0, failed=True, retry=True, error="boom", traceback="tb")
    assert roundtrip(failed) == failed and roundtrip(failed).samples == ()


def test_task_without_attempt_decodes_as_first_attempt():
    fields = codec.encode("task", {"task": "t", "row": {}, "group_id": "g", "index": 0, "group_size": 1})
    assert Task.from_payload(codec.decode(fields)).attempt == 0


@pytest.mark.parametrize("mutate, match", [
    (lambda f: f.pop(b"i4:prompt"), "missing array 'prompt'"),
    (lambda f: f.update({b"m": orjson.dumps({**orjson.loads(f[b"m"]), "reply_to": 1})}), "reply_to"),
    (lambda f: f.update({b"m": orjson.dumps({**orjson.loads(f[b"m"]), "stop_token_ids": [1, "x"]})}),
     r"field 'stop_token_ids\[1\]': expected `int`, got `str`"),
    (lambda f: f.update({b"m": orjson.dumps({**orjson.loads(f[b"m"]), "max_tokens": True})}),
     r"field 'max_tokens': expected `int`, got `bool`"),  # strict: a bool is no int
])
def test_bad_requests_raise_codec_errors(mutate, match):
    fields = GenRequest("k", "m", [1, 2]).to_fields()
    mutate(fields)
    with pytest.raises(CodecError, match=match):
        GenRequest.from_payload(codec.decode(fields))


def test_bad_trajectories_raise_codec_errors():
    t = Trajectory("guess", "g", 1, "e", "m", 0.5, samples())
    fields = t.to_fields()
    fields[b"i4:tokens"] = fields[b"i4:tokens"][:-4]
    with pytest.raises(CodecError, match="tokens"):
        Trajectory.from_payload(codec.decode(fields))
    with pytest.raises(CodecError, match="reward"):
        Trajectory("guess", "g", 1, "e", "m", "high")
    with pytest.raises(CodecError, match="model"):
        Trajectory("guess", "g", 1, "e", "other", 0.0, samples())
    with pytest.raises(CodecError, match="finish_reason"):
        GenResult("r", "m", [1], [0.0], "done", 0)
