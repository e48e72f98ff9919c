"""Group-relative advantages: the credit of each call, centred (and scaled) by statistics over the rollouts of the
same task.

A task's group holds the successful rollouts j = 1..n of that task. With ``identical`` credit every call of rollout j
carries its return R_j, and the advantage of each of its calls is GRPO's::

    A_{j,i} = (R_j − b_j) / s
    grpo: b_j = mean_k R_k        rloo: b_j = (Σ_{k≠j} R_k) / (n − 1)
    s = std_k R_k + eps (Bessel-corrected, as in TRL and verl), or s = 1 with normalize_std off

With turn-level credit (``discounted``, ``intermediate``) the calls of one rollout carry different credits, and each
call position is a group of its own (``per_call``): call i of rollout j is compared with call i of the other
rollouts of its task that made an i-th call, M_i = {k : n_k > i}::

    A_{j,i} = (c_{j,i} − b_{j,i}) / s_i      b and s as above, over c_{k,i} for k in M_i

Centring every call on the first call's credit instead (lit before 2026-11-26) gave the later calls an advantage
made of the discounted rewards between them and the first call, divided by the first call's spread: on the RAG
example ``adv/std`` reached 19 and ``discounted`` credit did not learn (examples/rag/README.md).

Defined edge cases, each counted in the metrics:
- a group of one (``adv/singleton_groups``): no baseline can be formed from the rollout itself; A = 0.
- a group whose returns are all equal (``adv/zero_std_groups``): it carries no learning signal; A = 0 for every
  call. Per call: a position whose credits are all equal, or that only one rollout of the group reached
  (``adv/unpaired_calls``), gives its calls A = 0; a group counts as zero-std when every position does.
- failed, timed-out or rewardless rollouts are not here: the episode functions take ``Episode`` objects only (an
  ``UnusableRollout`` raises), so a group of 3 launched with 1 failed is a group of 2, never [R1, R2, 0].

Departures. From GRPO (DeepSeekMath): with identical credit this is GRPO's outcome advantage, broadcast to every call
of the rollout instead of every token of one completion; with turn-level credit each call position has its own
group baseline (a V(s_i) estimate from the group's i-th calls) subtracted from the call's return to go. From PPO: no
learned value function. From the paper: it uses GRPO-style grouping; RLOO, the std switch (Dr. GRPO drops it) and
the per-call groups are lit's options.

Credits (or Episodes) in, one float64 tensor (n_j,) per rollout out.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lit_trainer.algorithm.credit import CreditConfig, assign_credits
from lit_trainer.intake.episodes import Episode
from lit_trainer.settings import check, one_of, positive

ESTIMATORS = ("grpo", "rloo")


@dataclass(frozen=True, slots=True)
class AdvantageConfig:
    """How credits are normalised within a task's group of rollouts."""

    SECTION = "advantages"
    RULES = {"estimator": one_of(ESTIMATORS), "eps": positive()}

    estimator: str = "grpo"
    """``grpo`` (baseline: the group mean) or ``rloo`` (baseline: the mean of the other rollouts of the group)."""
    normalize_std: bool = True
    """Divide by the group's standard deviation of returns (+ ``eps``); off gives Dr. GRPO-style advantages."""
    eps: float = 1e-6
    """Added to the group standard deviation before dividing; > 0."""

    def __post_init__(self) -> None:
        check(self)


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
    credits: Sequence[torch.Tensor], task_ids: Sequence[str], config: AdvantageConfig, per_call: bool = False
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """A_{j,i} for every call of every rollout (module docstring).

    ``credits[j]`` is (n_j,), the credit of rollout j's calls in order; ``task_ids[j]`` its task. Without
    ``per_call`` the group statistics use each rollout's first credit, G_j = credits[j][0] (identical credit: every
    credit of a rollout is its return); with it, each call position i is grouped on its own (``_per_call``).
    """
    assert len(credits) == len(task_ids), f"{len(credits)} credit tensors, {len(task_ids)} task ids"
    for j, c in enumerate(credits):
        assert c.dim() == 1 and c.numel() > 0, f"credits[{j}] has shape {tuple(c.shape)}, want (n_j,) with n_j ≥ 1"
    credits = [c.to(torch.float64) for c in credits]
    if per_call:
        advantages, metrics = _per_call(credits, task_ids, config)
    else:
        returns = torch.tensor([float(c[0]) for c in credits], dtype=torch.float64)  # (R,)
        baseline, scale, live, metrics = group_statistics(returns, task_ids, config)
        advantages = [(c - baseline[j]) / scale[j] if live[j] else torch.zeros_like(c) for j, c in enumerate(credits)]
    flat = torch.cat(advantages) if advantages else torch.zeros(1, dtype=torch.float64)  # (N,)
    metrics["adv/mean"] = float(flat.mean())
    metrics["adv/std"] = float(flat.std(unbiased=False))
    metrics["adv/abs_max"] = float(flat.abs().max())
    return advantages, metrics


def _per_call(credits: list[torch.Tensor], task_ids: Sequence[str], config: AdvantageConfig
              ) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Advantages with each (task, call position) its own group: ``group_statistics`` over the credits of the i-th
    calls of a task's rollouts. A task's group counts as singleton or zero-std as a whole."""
    owners = [j for j, c in enumerate(credits) for _ in range(c.numel())]  # per call: its rollout
    positions = [i for c in credits for i in range(c.numel())]
    names: dict[tuple[str, int], str] = {}
    keys = [names.setdefault((task_ids[j], i), str(len(names))) for j, i in zip(owners, positions, strict=True)]
    values = torch.cat(credits) if credits else torch.zeros(0, dtype=torch.float64)  # (N,)
    baseline, scale, live, _ = group_statistics(values, keys, config)
    flat = torch.where(live, (values - baseline) / scale, torch.zeros_like(values))  # (N,)
    advantages = list(flat.split([c.numel() for c in credits])) if credits else []
    rollouts = collections.Counter(task_ids)  # per task
    calls = collections.Counter(keys)  # per (task, position)
    live_tasks = {task_ids[j] for j, ok in zip(owners, live.tolist(), strict=True) if ok}
    metrics = {
        "adv/groups": float(len(rollouts)),
        "adv/singleton_groups": float(sum(n == 1 for n in rollouts.values())),
        "adv/zero_std_groups": float(sum(n > 1 and task not in live_tasks for task, n in rollouts.items())),
        "adv/group_size_mean": len(credits) / len(rollouts) if rollouts else 0.0,
        "adv/unpaired_calls": float(sum(calls[key] == 1 and rollouts[task_ids[j]] > 1
                                        for j, key in zip(owners, keys, strict=True))),
    }
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
    per_call = credit_config.mode != "identical"  # turn-level credit: each call position is a group of its own
    advantages, metrics = group_advantages(credits, [e.task_id for e in episodes], config, per_call=per_call)
    return advantages, {**credit_metrics, **metrics}
