"""One optimiser step's inputs: trainable groups -> samples, per-entry advantages and loss weights.

What it is: `build_step(groups, advantage=..., loss_agg=..., prefix_trees=...)` lists every
sample of every member (in group, member, sample order) and, per (sample,
episode) entry in `jet.trainer.packing`'s `seq` numbering, the advantage of
the tokens of that entry and their loss weight. A row's per-token values are
then `table[row.seq]` (`StepInputs.token_values`).

- Advantage: the member's advantage from `jet.trainer.advantages` among its
  group, per agent when the reward is a dict (a sample then belongs to its
  one agent, `Sample.agents[0]`; `jet.trainer.groups.malformed` rejects others).
- Weight (the loss aggregation): `token_mean` gives every trained token of the
  step 1 / N_tokens; `seq_mean` gives the tokens of one sequence
  1 / (N_sequences * its tokens), where a sequence is one episode of one
  trajectory: all tokens of that episode, however many samples (turns, tree
  pieces) merging made of it. Both are functions of the episode, never of the
  sample layout, so merged and unmerged samples give the same loss.

What it is not: a packer or a loss; no model, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from jet.timeline import Sample
from jet.timeline.share import share_prefixes
from jet.trainer.advantages import member_advantages
from jet.trainer.packing import seq_offsets
from jet.wire import Trajectory

AGGREGATIONS = ("token_mean", "seq_mean")


@dataclass(slots=True)
class StepInputs:
    samples: list[Sample]
    advantages: torch.Tensor  # [E] float32, one per (sample, episode) entry
    weights: torch.Tensor  # [E] float32
    n_tokens: int  # trained tokens in the step
    n_sequences: int
    rewards: list[float] = field(default_factory=list)  # one per member (dict rewards: their mean)

    def token_values(self, seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token advantages and weights of a row's `seq` column (0 where seq is -1)."""
        idx = seq.clamp(min=0)
        valid = seq >= 0
        if self.advantages.numel() == 0:
            zero = torch.zeros(seq.shape, dtype=torch.float32)
            return zero, zero
        adv = self.advantages[idx].masked_fill(~valid, 0.0)
        return adv, self.weights[idx].masked_fill(~valid, 0.0)


def build_step(groups: Sequence[Sequence[Trajectory]], *, advantage: str, loss_agg: str,
               prefix_trees: bool, gradient_only: bool = False, whole_episodes: bool = False) -> StepInputs:
    """Inputs of one step from groups of successful trajectories (each group: its members); with
    `prefix_trees`, the samples that share a prefix merged into trees (`jet.timeline.share`), each
    entry's advantage and weight following its tokens. No default: the one default is the config's
    (`trainer.prefix_trees`), which every caller passes on. `gradient_only`: the samples with no
    gradient left out (`with_gradient`; `whole_episodes` as there), before any tree is built; the
    weights, `n_tokens` and `rewards` still count every sample (the loss's aggregation is unchanged)."""
    if loss_agg not in AGGREGATIONS:
        raise ValueError(f"loss_agg must be one of {AGGREGATIONS}, got {loss_agg!r}")
    samples: list[Sample] = []
    adv: list[float] = []
    seq_of_entry: list[tuple[str, str]] = []  # (trajectory msg_id, episode id) of each entry
    rewards: list[float] = []
    for members in groups:
        per_member = member_advantages([t.reward for t in members], advantage)
        for traj, a in zip(members, per_member):
            rewards.append(mean_reward(traj))
            for s in traj.samples:
                key = s.agents[0] if isinstance(traj.reward, dict) else None
                samples.append(s)
                for episode_id in s.episode_ids:
                    adv.append(a[key])
                    seq_of_entry.append((traj.msg_id, episode_id))
    tokens = _entry_tokens(samples)
    weights, n_seq = _weights(seq_of_entry, tokens, loss_agg)
    if gradient_only:
        samples, kept = with_gradient(samples, adv, whole_episodes)
        adv, weights = [adv[e] for e in kept], [weights[e] for e in kept]
    if prefix_trees:
        trees = share_prefixes(samples)
        samples = [tree for tree, _ in trees]
        entries = [e for _, of_tree in trees for e in of_tree]
        adv, weights = [adv[e] for e in entries], [weights[e] for e in entries]
    return StepInputs(samples, torch.tensor(adv, dtype=torch.float32), torch.tensor(weights, dtype=torch.float32),
                      n_tokens=sum(tokens), n_sequences=n_seq, rewards=rewards)


def with_gradient(samples: Sequence[Sample], adv: Sequence[float], whole_episodes: bool = False
                  ) -> tuple[list[Sample], list[int]]:
    """The samples that have an entry with a nonzero advantage (`adv`: one per entry, in seq order),
    and the indices of their entries. Without a KL term they are the only ones whose loss has a
    gradient: a zero advantage zeroes the policy-gradient term of its tokens and that term's gradient,
    exactly (a group whose rewards are all equal: `rollout/no_signal_frac`). `whole_episodes` (a
    sequence-level rollout correction, whose weight is a statistic of all of an episode's tokens) also
    keeps every sample of an episode that has such an entry (an agent's samples at advantage 0 beside
    another agent's in the same episode). With none, the first sample alone, so the step still
    backpropagates: a zero gradient is not no gradient to the optimiser (AdamW's moments still move the
    weights, and its step count)."""
    firsts = seq_offsets(samples)
    spans = list(zip(firsts, firsts[1:] + [len(adv)]))
    live = [any(adv[e] != 0 for e in range(a, b)) for a, b in spans]
    if whole_episodes:
        episodes = {e for s, on in zip(samples, live) if on for e in s.episode_ids}
        live = [on or any(e in episodes for e in s.episode_ids) for s, on in zip(samples, live)]
    if samples and not any(live):
        live[0] = True
    kept = [i for i, on in enumerate(live) if on]
    return [samples[i] for i in kept], [e for i in kept for e in range(*spans[i])]


def _entry_tokens(samples: Sequence[Sample]) -> list[int]:
    """Trained tokens of each (sample, episode) entry, in seq order."""
    out: list[int] = []
    for s in samples:
        counts = [0] * len(s.episode_ids)
        for e, m in zip(s.episodes, s.mask):
            if m:
                counts[e] += 1
        out += counts
    return out


def _weights(seq_of_entry: list[tuple[str, str]], tokens: list[int], loss_agg: str) -> tuple[list[float], int]:
    per_seq: dict[tuple[str, str], int] = {}
    for key, n in zip(seq_of_entry, tokens):
        per_seq[key] = per_seq.get(key, 0) + n
    live = {k: n for k, n in per_seq.items() if n > 0}
    total = sum(live.values())
    if not total:
        return [0.0] * len(tokens), 0
    if loss_agg == "token_mean":
        return [1.0 / total] * len(tokens), len(live)
    return [1.0 / (len(live) * live[k]) if k in live else 0.0 for k in seq_of_entry], len(live)


def mean_reward(traj: Trajectory) -> float:
    """The member's reward for metrics: the number, or the mean over agents of a dict."""
    r = traj.reward
    if isinstance(r, dict):
        return sum(r.values()) / len(r) if r else 0.0
    return float(r)
