"""Advantages of a GRPO group's members from their rewards: pure functions.

What it is: `group_advantages(rewards, mode)` for one group's rewards, and
`member_advantages(rewards, mode)` for a group whose members carry either one
reward each or one reward per agent (a dict: each agent its own baseline,
`jet.trainer.groups.baselines`). Three estimators:

- ``grpo``: (r - mean) / (std + eps), std the sample standard deviation
  (Bessel-corrected, as TRL computes it) (Shao et al. 2024, DeepSeekMath);
- ``rloo``: r_i minus the mean of the *other* members' rewards,
  = G / (G - 1) * (r_i - mean) (Ahmadian et al. 2024, "Back to Basics");
- ``no_std``: r - mean, no division by the std (Liu et al. 2025, Dr. GRPO).

A group of one member has no baseline: its advantage is 0 in every mode.
A group whose rewards are all equal gets 0 everywhere (grpo divides 0 by eps).

What it is not: token-level. `jet.trainer.batch` spreads a member's advantage
over the tokens of its samples; the loss never sees rewards.
"""

from __future__ import annotations

from typing import Sequence

import torch

from jet.trainer.groups import Reward, baselines, reward_value

MODES = ("grpo", "rloo", "no_std")
EPS = 1e-6


def group_advantages(rewards: torch.Tensor, mode: str, eps: float = EPS) -> torch.Tensor:
    """[G] rewards of one group -> [G] advantages (float64 inside, the input's dtype out)."""
    if mode not in MODES:
        raise ValueError(f"advantage mode must be one of {MODES}, got {mode!r}")
    r = rewards.to(torch.float64)
    g = r.numel()
    if g < 2:
        return torch.zeros_like(rewards)
    centred = r - r.mean()
    if mode == "grpo":
        out = centred / (r.std(unbiased=True) + eps)
    elif mode == "rloo":
        out = centred * g / (g - 1)
    else:
        out = centred
    return out.to(rewards.dtype)


def member_advantages(rewards: Sequence[Reward], mode: str) -> list[dict[str | None, float]]:
    """Per member: {agent: advantage}, with key None for a member's single (non-dict) reward.

    A dict reward gives each agent its own baseline: agent `a`'s advantage is
    computed among the members whose reward has an entry for `a`. Scalar
    rewards form one baseline together (key None).
    """
    out: list[dict[str | None, float]] = [{} for _ in rewards]
    for key, members in baselines(rewards).items():
        values = torch.tensor([reward_value(rewards[i], key) for i in members], dtype=torch.float64)
        for i, a in zip(members, group_advantages(values, mode).tolist()):
            out[i][key] = a
    return out
