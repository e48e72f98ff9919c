"""Credit assignment: one scalar per LLM call (transition) of an episode.

LightningRL treats each LLM call of a rollout as one action. With n calls, episode return R
(``Episode.episode_return``), final reward F (``Episode.final_reward``, 0 when the traced function returned no
number), intermediate rewards u_k (``Transition.reward``: the ``lit.reward`` values that follow call k, 0 when none)
and automatic intermediate rewards p_k, the credit c_i of call i is::

    identical:     c_i = R + Σ_k p_k                         (the paper's choice; p = 0 by default)
    discounted:    c_i = Σ_{k≥i} γ^(k−i) r_k,   r_k = u_k + p_k + [k = n−1]·F
    intermediate:  c_i = Σ_{k≥i} r_k                         (discounted with γ = 1)
    p_k = −w · (tool_errors_k + other_errors_k + [finish_reason_k = "length"])

- ``tool_errors``/``other_errors`` are the errored spans between call k and the next call (episodes.py counts them);
  a response cut at ``max_tokens`` (finish reason ``length``) is the truncated/timeout-like signal. w =
  ``auto_reward_weight``, 0 (off) by default. Each signal counts once, so three failed tools cost 3w.
- ``lit.reward`` values recorded before the first call follow no action; identical mode still sees them through R
  (R sums all ``lit.reward`` values when F is absent), the turn-level modes attribute them to no call.
- With F present, identical mode uses R = F and ignores the u_k: the traced function's return is the episode's
  verdict. The turn-level modes add F to the u_k.

Departures. From the paper (Agent Lightning, arXiv:2508.03680): it assigns R to every call (identical); the turn-level
modes and the concrete formula for automatic intermediate rewards (the paper describes turning monitoring signals
into rewards without fixing one) are lit's options. From PPO: no critic and no GAE; discounting runs over calls, not
tokens. From GRPO: the scalar belongs to a call, not to a whole single-turn completion; with one call, p = 0 and a
numeric return but no ``lit.reward``, every mode gives c_0 = R = F, GRPO's sequence reward.

Episodes in, one float64 tensor (n,) per episode out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lit_trainer.intake.episodes import Episode
from lit_trainer.settings import at_least, between, check, one_of

CREDIT_MODES = ("identical", "discounted", "intermediate")


@dataclass(frozen=True, slots=True)
class CreditConfig:
    """How an episode's reward becomes one scalar per LLM call."""

    SECTION = "credit"
    RULES = {"mode": one_of(CREDIT_MODES), "gamma": between(0, 1), "auto_reward_weight": at_least(0, "(0: off)")}

    mode: str = "identical"
    """``identical`` (every call gets the episode return, as in the paper), ``discounted`` (turn-level return to go
    with ``gamma``), or ``intermediate`` (undiscounted sum to go of the per-call rewards)."""
    gamma: float = 0.95
    """Discount per LLM call in ``discounted`` mode, in [0, 1]; ignored by the other modes."""
    auto_reward_weight: float = 0.0
    """w ≥ 0: each tool error, other errored span and length-truncated response adds −w to its call's reward.
    0 turns automatic intermediate rewards off."""

    def __post_init__(self) -> None:
        check(self)


def _check_episode(episode: Episode) -> None:
    if not isinstance(episode, Episode):
        raise TypeError(f"credit takes successful Episodes only, got {type(episode).__name__}")
    assert episode.episode_return is not None, f"episode {episode.rollout_id} has no return: it is unusable"
    assert math.isfinite(episode.episode_return), f"episode {episode.rollout_id} return {episode.episode_return}"
    assert episode.transitions, f"episode {episode.rollout_id} has no transitions"
    indices = [t.index for t in episode.transitions]
    assert indices == list(range(len(indices))), f"episode {episode.rollout_id}: transitions out of order {indices}"


def auto_rewards(episode: Episode, weight: float) -> torch.Tensor:
    """p_k = −w · (tool errors + other errors + [finish reason ``length``]) per call; float64 (n,)."""
    counts = [t.tool_errors + t.other_errors + int(t.finish_reason == "length") for t in episode.transitions]
    return -weight * torch.tensor(counts, dtype=torch.float64)  # (n,)


def call_rewards(episode: Episode, auto_reward_weight: float = 0.0) -> torch.Tensor:
    """r_k = u_k + p_k, with the final reward F added at the last call; float64 (n,)."""
    _check_episode(episode)
    u = torch.tensor([t.reward or 0.0 for t in episode.transitions], dtype=torch.float64)  # (n,)
    r = u + auto_rewards(episode, auto_reward_weight)  # (n,)
    if episode.final_reward is not None:
        r[-1] += episode.final_reward
    return r


def assign_credit(episode: Episode, config: CreditConfig) -> torch.Tensor:
    """The credit c_i of each call of one episode (module docstring); float64 (n,)."""
    _check_episode(episode)
    n = len(episode.transitions)
    if config.mode == "identical":
        total = episode.episode_return + auto_rewards(episode, config.auto_reward_weight).sum()
        return torch.full((n,), float(total), dtype=torch.float64)  # (n,)
    gamma = config.gamma if config.mode == "discounted" else 1.0
    r = call_rewards(episode, config.auto_reward_weight)  # (n,)
    credit = torch.empty_like(r)  # (n,)
    to_go = 0.0
    for i in range(n - 1, -1, -1):
        to_go = float(r[i]) + gamma * to_go
        credit[i] = to_go
    return credit


def assign_credits(episodes: Sequence[Episode], config: CreditConfig) -> tuple[list[torch.Tensor], dict[str, float]]:
    """``assign_credit`` for each episode, with metrics over all their calls."""
    credits = [assign_credit(e, config) for e in episodes]
    penalties = [auto_rewards(e, config.auto_reward_weight) for e in episodes]
    flat = torch.cat(credits) if credits else torch.zeros(0, dtype=torch.float64)
    flat_p = torch.cat(penalties) if penalties else torch.zeros(0, dtype=torch.float64)
    metrics = {
        "credit/mean": float(flat.mean()) if flat.numel() else 0.0,
        "credit/calls": float(flat.numel()),
        "credit/auto_penalized_calls": float((flat_p < 0).sum()),
        "credit/auto_reward_sum": float(flat_p.sum()),
    }
    return credits, metrics
