"""Jet: swarm training for LLM agents with reinforcement learning.

Env workers, inference workers, a gateway and trainers are separate processes
that meet only in Redis Streams (see docs/design.md). This package is one import
namespace: `jet` (core), `jet.queues` (Redis plumbing), `jet.workers`
(rollout processes), `jet.trainer` (optimisation). Importing `jet` is cheap:
nothing heavy (torch, transformers) is imported here.
"""

__version__ = "0.1.0"
