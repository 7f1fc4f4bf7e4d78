"""Prometheus metrics of `jet dash` (`GET /metrics`), built from the same data as the pages.

What it is: `render(swarms, trainers)` turns the swarm snapshots
(`jet.dash.swarm.snapshot`, one per run) and the trainers' latest metrics
lines into the Prometheus text format with prometheus-client. Every series is
labelled with its `run` (and `stream`, `group`, `model`, `role` or `event`).

What it is not: a registry of live counters. Each scrape builds a fresh
collector from a fresh snapshot, so the dashboard holds no Prometheus state and
any number of dashboards can be scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# trainer metric (metrics.jsonl) -> (Prometheus gauge, help)
TRAINER = {
    "rollout/reward_mean": ("jet_reward_mean", "Mean episode reward of the trainer's last step."),
    "policy/staleness": ("jet_staleness", "Mean staleness (versions) of the last step's samples."),
    "policy/staleness_max": ("jet_staleness_max", "Largest staleness (versions) in the last step."),
    "perf/tokens_per_s": ("jet_trainer_tokens_per_second", "Trained tokens per second since the trainer started."),
    "perf/steps_per_min": ("jet_trainer_steps_per_minute", "Optimiser steps per minute since the trainer started."),
    "train/loss": ("jet_trainer_loss", "Loss of the last step."),
    "train/kl": ("jet_trainer_kl", "KL term of the last step."),
    "train/clip_frac": ("jet_trainer_clip_fraction", "Fraction of clipped tokens in the last step."),
    "train/entropy": ("jet_trainer_entropy", "Mean -logprob of the last step's trained tokens (sampled entropy)."),
    "policy/version": ("jet_trainer_weight_version", "Weight version the trainer is at."),
}


class _Collector:
    def __init__(self, swarms: dict[str, dict], trainers: dict[tuple[str, str], dict]):
        self.swarms, self.trainers = swarms, trainers

    def collect(self):
        yield from self._streams()
        yield from self._swarm()
        yield from self._trainers()

    def _streams(self):
        length = GaugeMetricFamily("jet_stream_length", "Entries in the stream.", labels=["run", "stream"])
        pending = GaugeMetricFamily("jet_group_pending", "Entries read by the group and not acked yet.",
                                    labels=["run", "stream", "group"])
        lag = GaugeMetricFamily("jet_group_lag", "Entries not yet read by the group.", labels=["run", "stream", "group"])
        consumers = GaugeMetricFamily("jet_group_consumers", "Consumers the group has ever had (XINFO).",
                                      labels=["run", "stream", "group"])
        alive = GaugeMetricFamily("jet_consumers_alive", "Consumers of the group seen within the alive window.",
                                  labels=["run", "stream", "group"])
        for run, snap in self.swarms.items():
            for s in snap["streams"]:
                length.add_metric([run, s["name"]], s["length"])
                for g in s["groups"]:
                    labels = [run, s["name"], g["name"]]
                    pending.add_metric(labels, g["pending"])
                    if g.get("lag") is not None:
                        lag.add_metric(labels, g["lag"])
                    consumers.add_metric(labels, len(g["consumers"]))
                    alive.add_metric(labels, sum(c["idle_ms"] / 1000 < snap["alive_s"] for c in g["consumers"]))
        yield from (length, pending, lag, consumers, alive)

    def _swarm(self):
        dead = GaugeMetricFamily("jet_dead_letters", "Entries in the dead-letter stream.", labels=["run"])
        events = CounterMetricFamily("jet_queue_events", "The run's stats counters (lost, duplicates, dead, "
                                     "no_llm_calls, ...).", labels=["run", "event"])
        workers = GaugeMetricFamily("jet_workers_alive", "Workers alive, per role.", labels=["run", "role"])
        version = GaugeMetricFamily("jet_weight_version", "Latest weight version announced on weights:<model>.",
                                    labels=["run", "model"])
        for run, snap in self.swarms.items():
            dead.add_metric([run], snap["dead"])
            for name, value in sorted(snap["stats"].items()):
                events.add_metric([run, name], value)
            roles: dict[str, int] = {}
            for w in snap["workers"]:
                roles[str(w.get("role"))] = roles.get(str(w.get("role")), 0) + bool(w.get("alive"))
            for role, n in sorted(roles.items()):
                workers.add_metric([run, role], n)
            for model, w in snap["weights"].items():
                version.add_metric([run, model], w["version"])
        yield from (dead, events, workers, version)

    def _trainers(self):
        step = GaugeMetricFamily("jet_trainer_step", "Optimiser steps the trainer has logged.", labels=["run", "model"])
        gauges = {k: GaugeMetricFamily(name, doc, labels=["run", "model"]) for k, (name, doc) in TRAINER.items()}
        for (run, model), last in sorted(self.trainers.items()):
            if "step" in last:
                step.add_metric([run, model], last["step"])
            for k, g in gauges.items():
                if isinstance(last.get(k), (int, float)):
                    g.add_metric([run, model], last[k])
        yield step
        yield from gauges.values()


def render(swarms: dict[str, dict], trainers: dict[tuple[str, str], dict]) -> bytes:
    """The Prometheus text exposition of these snapshots and trainer lines."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(swarms, trainers))
    return generate_latest(reg)
