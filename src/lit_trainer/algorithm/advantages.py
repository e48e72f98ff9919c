"""Group-relative advantages: the credit of each call, centred (and scaled) by statistics over the rollouts of the
same task.

A task's group holds the successful rollouts j = 1..n of that task. Rollout j's return under the credit mode is the
credit of its first call, G_j = c_{j,0} (for identical credit, the episode return R_j). The advantage of call i of
rollout j is::

    A_{j,i} = (c_{j,i} − b_j) / s
    grpo: b_j = mean_k G_k        rloo: b_j = (Σ_{k≠j} G_k) / (n − 1)
    s = std_k G_k + eps (Bessel-corrected, as in TRL and verl), or s = 1 with normalize_std off

Defined edge cases, each counted in the metrics:
- a group of one (``adv/singleton_groups``): no baseline can be formed from the rollout itself; A = 0.
- a group whose returns are all equal (``adv/zero_std_groups``): it carries no learning signal; A = 0 for every
  call, even when turn-level credits differ within a rollout, and never NaN.
- failed, timed-out or rewardless rollouts are not here: the episode functions take ``Episode`` objects only (an
  ``UnusableRollout`` raises), so a group of 3 launched with 1 failed is a group of 2, never [R1, R2, 0].

Departures. From GRPO (DeepSeekMath): with identical credit this is GRPO's outcome advantage, broadcast to every call
of the rollout instead of every token of one completion; with turn-level credit the group baseline b_j (a V(s_0)
estimate) is subtracted from each call's return to go. From PPO: no learned value function. From the paper: it uses
GRPO-style grouping; RLOO and the switch for std normalisation (Dr. GRPO drops it) are lit's options.

Credits (or Episodes) in, one float64 tensor (n_j,) per rollout out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lit_trainer.algorithm.credit import CreditConfig, assign_credits
from lit_trainer.intake.episodes import Episode

ESTIMATORS = ("grpo", "rloo")


@dataclass(frozen=True, slots=True)
class AdvantageConfig:
    """How credits are normalised within a task's group of rollouts."""

    estimator: str = "grpo"
    """``grpo`` (baseline: the group mean) or ``rloo`` (baseline: the mean of the other rollouts of the group)."""
    normalize_std: bool = True
    """Divide by the group's standard deviation of returns (+ ``eps``); off gives Dr. GRPO-style advantages."""
    eps: float = 1e-6
    """Added to the group standard deviation before dividing; > 0."""

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"AdvantageConfig.estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        if not (math.isfinite(self.eps) and self.eps > 0.0):
            raise ValueError(f"AdvantageConfig.eps must be finite and > 0, got {self.eps}")


def group_statistics(
    returns: torch.Tensor, groups: Sequence[str], config: AdvantageConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
    """Per-rollout baseline b, scale s and a ``live`` flag (False: singleton or equal-returns group, A = 0).

    ``returns`` is (R,), one per rollout; ``groups`` names each rollout's task.
    """
    assert returns.dim() == 1 and returns.numel() == len(groups), f"returns {tuple(returns.shape)}, {len(groups)} ids"
    assert torch.isfinite(returns).all(), f"non-finite returns {returns.tolist()}"
    baseline = returns.clone()  # (R,)
    scale = torch.ones_like(returns)  # (R,)
    live = torch.zeros(returns.shape, dtype=torch.bool)  # (R,)
    members: dict[str, list[int]] = {}
    for j, task in enumerate(groups):
        members.setdefault(task, []).append(j)
    singletons = zero_std = 0
    for idx in members.values():
        x = returns[idx]  # (n,)
        if len(idx) == 1:
            singletons += 1
            continue
        if bool(x.max() == x.min()):
            zero_std += 1
            continue
        n = len(idx)
        baseline[idx] = x.mean() if config.estimator == "grpo" else (x.sum() - x) / (n - 1)
        if config.normalize_std:
            scale[idx] = x.std(unbiased=True) + config.eps
        live[idx] = True
    metrics = {
        "adv/groups": float(len(members)),
        "adv/singleton_groups": float(singletons),
        "adv/zero_std_groups": float(zero_std),
        "adv/group_size_mean": returns.numel() / len(members) if members else 0.0,
    }
    return baseline, scale, live, metrics


def group_advantages(
    credits: Sequence[torch.Tensor], task_ids: Sequence[str], config: AdvantageConfig
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """A_{j,i} for every call of every rollout (module docstring).

    ``credits[j]`` is (n_j,), the credit of rollout j's calls in order; ``task_ids[j]`` its task. The group statistics
    use each rollout's first credit, G_j = credits[j][0].
    """
    assert len(credits) == len(task_ids), f"{len(credits)} credit tensors, {len(task_ids)} task ids"
    for j, c in enumerate(credits):
        assert c.dim() == 1 and c.numel() > 0, f"credits[{j}] has shape {tuple(c.shape)}, want (n_j,) with n_j ≥ 1"
    returns = torch.tensor([float(c[0]) for c in credits], dtype=torch.float64)  # (R,)
    baseline, scale, live, metrics = group_statistics(returns, task_ids, config)
    advantages = []
    for j, c in enumerate(credits):
        c = c.to(torch.float64)  # (n_j,)
        advantages.append((c - baseline[j]) / scale[j] if live[j] else torch.zeros_like(c))
    flat = torch.cat(advantages) if advantages else torch.zeros(1, dtype=torch.float64)  # (N,)
    metrics["adv/mean"] = float(flat.mean())
    metrics["adv/std"] = float(flat.std(unbiased=False))
    metrics["adv/abs_max"] = float(flat.abs().max())
    return advantages, metrics


def episode_advantages(
    episodes: Sequence[Episode], credit_config: CreditConfig, config: AdvantageConfig
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Credit then group advantages for successful episodes; one float64 tensor (n_j,) per episode, same order."""
    for e in episodes:
        if not isinstance(e, Episode):
            raise TypeError(
                f"advantages take successful Episodes only, got {type(e).__name__}: unusable rollouts "
                "are reported by episodes.py and excluded, never counted as reward 0"
            )
    ids = [e.rollout_id for e in episodes]
    assert len(set(ids)) == len(ids), f"a rollout appears twice: {sorted(i for i in set(ids) if ids.count(i) > 1)}"
    credits, credit_metrics = assign_credits(episodes, credit_config)
    advantages, metrics = group_advantages(credits, [e.task_id for e in episodes], config)
    return advantages, {**credit_metrics, **metrics}
