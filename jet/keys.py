"""Every Redis key name Jet uses, built in one place.

All keys of one run share the hash tag `{<run>}` so every multi-key atomic step
(ack + produce + marker) lands in one slot on Redis Cluster. No other module
writes a key name as a string literal.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")

# Consumer group names, one per role that reads a stream.
GROUP_ENV = "env"
GROUP_ENV_SHADOW = "env-shadow"  # shadow env workers: see every new task, never take one from `env`
# Groups whose readers may miss entries: trimming (jet.queues.producer.safe_trim) does not wait for them.
BEST_EFFORT_GROUPS = (GROUP_ENV_SHADOW,)
GROUP_INFER = "infer"
GROUP_TRAINER = "trainer"
GROUP_STUDY = "study"  # study workers on a study's run stream


def check_name(kind: str, value: str) -> str:
    """Reject names that would break the key layout (':' '{' '}' or spaces)."""
    if not _NAME.match(value or ""):
        raise ValueError(f"{kind} name {value!r} must match [A-Za-z0-9_.-]+")
    return value


class Keys:
    """Key names for one run: `Keys("demo").tasks("guess") == "jet:{demo}:tasks:guess"`."""

    __slots__ = ("run", "prefix")

    def __init__(self, run: str):
        self.run = check_name("run", run)
        self.prefix = f"jet:{{{run}}}:"

    def tasks(self, task: str) -> str:
        return f"{self.prefix}tasks:{check_name('task', task)}"

    def gen(self, model: str) -> str:
        return f"{self.prefix}gen:{check_name('model', model)}"

    def reply(self, client: str) -> str:
        return f"{self.prefix}reply:{check_name('client', client)}"

    def traj(self, model: str) -> str:
        return f"{self.prefix}traj:{check_name('model', model)}"

    def shadow(self, model: str) -> str:
        """Trajectories of shadow-mode env workers: recorded, never read by a trainer."""
        return f"{self.prefix}shadow:{check_name('model', model)}"

    def weights(self, model: str) -> str:
        return f"{self.prefix}weights:{check_name('model', model)}"

    def weight_blobs(self, model: str) -> str:
        """Stream of the files of small weight versions (LoRA adapters), chunked, for inference workers that
        share no folder with the trainer (`jet.queues.blobs`); the announcement on `weights` points into it."""
        return f"{self.prefix}wblob:{check_name('model', model)}"

    def weights_rejected(self, model: str) -> str:
        """Hash `<consumer> <entry id>` -> reason: weight announcements an inference worker dead-lettered
        (it never reads them again, also after a restart)."""
        return f"{self.prefix}weights-rejected:{check_name('model', model)}"

    def rollout(self, model: str) -> str:
        """Hash: what entered and left `model`'s training: `admitted` (trajectories the feeder let in,
        HINCRBY), `counts` (the trainer's outcome counts as JSON, rewritten after every step), `dead`
        (admitted work dead-lettered before any outcome, HINCRBY) and `dead_seen` (the dead stream's id
        the feeder counted up to). The feeder's staleness-aware admission reads them (`jet.workers.feeder`)."""
        return f"{self.prefix}rollout:{check_name('model', model)}"

    def calls(self, episode_id: str, tag: str) -> str:
        """Stream of the LLM calls a `jet gateway` answered for one run (`tag`) of an episode;
        the env worker creates it when the episode starts and reads and deletes it at its end."""
        return f"{self.prefix}calls:{check_name('episode', episode_id)}.{check_name('tag', tag)}"

    @property
    def gateway_secret(self) -> str:
        """String: the run's HMAC key for gateway API keys (unless $JET_GATEWAY_SECRET is set)."""
        return f"{self.prefix}gateway:secret"

    @property
    def dead(self) -> str:
        return f"{self.prefix}dead"

    @property
    def events(self) -> str:
        return f"{self.prefix}events"

    @property
    def stats(self) -> str:
        """Hash of counters (lost work reported by XAUTOCLAIM, dead letters, ...)."""
        return f"{self.prefix}stats"

    def worker(self, name: str) -> str:
        """Hash: one worker's heartbeat (role, host, code and weight versions), expiring when it stops
        beating (`jet.queues.registry`)."""
        return f"{self.prefix}worker:{check_name('worker', name)}"

    @property
    def workers(self) -> str:
        """Sorted set: worker name -> unix time of its last heartbeat (the index of the worker hashes)."""
        return f"{self.prefix}workers"

    def done_marker(self, group: str, msg_id: str) -> str:
        """Idempotency marker: set when `group` committed the effects of message `msg_id`."""
        return f"{self.prefix}done:{group}:{msg_id}"

    def sent_marker(self, msg_id: str) -> str:
        """Producer dedup marker: set when message `msg_id` was added once."""
        return f"{self.prefix}sent:{msg_id}"

    def last_error(self) -> str:
        """Hash `<stream>/<entry id>` -> last handler error, used as the dead-letter reason."""
        return f"{self.prefix}errors"

    # -- a study's keys (`jet study`): a Keys of the study's own namespace, `Keys.for_study(name)`

    @classmethod
    def for_study(cls, study: str) -> "Keys":
        """The namespace of study `study`: its keys share the hash tag `{study.<name>}`."""
        return cls(f"study.{check_name('study', study)}")

    @property
    def study_runs(self) -> str:
        """Stream of run requests (one per trial x seed) that study workers consume."""
        return f"{self.prefix}study:runs"

    @property
    def study_results(self) -> str:
        """Stream of finished runs, each added atomically with its request's ack."""
        return f"{self.prefix}study:results"

    @property
    def study_progress(self) -> str:
        """Stream of per-step metric values of running runs."""
        return f"{self.prefix}study:progress"

    @property
    def study_launched(self) -> str:
        """Hash run id -> its request: the runner's ledger of every run it launched (never expires)."""
        return f"{self.prefix}study:launched"

    @property
    def study_stops(self) -> str:
        """Hash run id -> why it must stop (pruned, study stopped, out of budget), read by its worker."""
        return f"{self.prefix}study:stops"

    @property
    def study_state(self) -> str:
        """Hash of the study's own fields: spec, first start time, stop request, runner lock owner."""
        return f"{self.prefix}study:state"

    @property
    def study_runner(self) -> str:
        """String: the live runner's token (expiring lease), so two runners never plan one study."""
        return f"{self.prefix}study:runner"

    def study_run_lock(self, run: str) -> str:
        """String: held (expiring lease) while a run's processes live, so a reclaimed run never runs twice."""
        return f"{self.prefix}study:lock:{check_name('run', run)}"

    @property
    def study_crashes(self) -> str:
        """Hash run id -> infrastructure crashes so far."""
        return f"{self.prefix}study:crashes"

    def pattern(self) -> str:
        """SCAN pattern matching every key of this run (the braces are escaped)."""
        return f"jet:\\{{{self.run}\\}}:*"

    def short(self, key: str) -> str:
        """`jet:{demo}:tasks:guess` -> `tasks:guess` for display."""
        return key[len(self.prefix):] if key.startswith(self.prefix) else key

    def full(self, short: str) -> str:
        """`tasks:guess` -> `jet:{demo}:tasks:guess`: the inverse of `short` (a dead letter names its stream short)."""
        kind, _, name = short.partition(":")
        if kind not in STREAM_KINDS:
            raise ValueError(f"unknown stream kind in {short!r}; one of {', '.join(STREAM_KINDS)}")
        return self.prefix + (f"{kind}:{check_name(kind, name)}" if name else kind)

    def kind(self, key: str) -> str:
        """The stream kind of one of this run's keys: `jet:{demo}:traj:tiny` -> `traj`."""
        return self.short(key).split(":", 1)[0]


# What became of a trajectory at its trainer (`jet.trainer.groups` decides; `counts` of `Keys.rollout`
# holds the counts). trained: in an optimiser step. retried: failed, a new attempt was queued. failed:
# failed for good. stale: older than max_staleness. small_group: its group ended below min_size.
# no_signal: its group's rewards gave every member an advantage of 0 (dropped with
# `trainer.skip_no_signal`). late: its group was already done. duplicate: a second trajectory for one
# member. malformed: unusable (e.g. an agent without a reward).
OUTCOMES = ("trained", "retried", "failed", "stale", "small_group", "no_signal", "late", "duplicate", "malformed")
# The outcomes that end an admitted trajectory (the feeder's admission counts them decided): all but
# retried (another attempt follows), late and duplicate (copies, never admitted on their own).
ENDING = tuple(o for o in OUTCOMES if o not in ("retried", "late", "duplicate"))

# The kinds of stream a run has (the first part of a key after the run's prefix).
STREAM_KINDS = ("tasks", "gen", "reply", "traj", "shadow", "weights", "dead", "events")
ALL_RUNS_PATTERN = "jet:{*}:*"  # SCAN pattern over every run's keys


def run_of(key: str) -> str | None:
    """The run name of a Jet key (`jet:{demo}:tasks:guess` -> `demo`), else None."""
    if key.startswith("jet:{") and "}" in key:
        return key[len("jet:{"):key.index("}")]
    return None
