"""The token-level LightningRL objective: a clipped policy gradient against the behaviour policy that vLLM sampled
from, with a cap on large importance ratios and an optional KL term to a frozen reference model.

Every response token t of transition b carries its transition's advantage A_b; prompt and padding tokens are masked
(m_{b,t} = 0). With ρ = exp(log π_θ − log μ), μ the behaviour logprobs vLLM returned, sg the stop-gradient::

    ℓ_{b,t} = −min( ρ̃ A_b,  clip(ρ, 1 − ε_low, 1 + ε_high) A_b ) + β · k3_{b,t}
    ρ̃      = ρ · sg(min(1, C / ρ))            value min(ρ, C), gradient min(ρ, C) · ∇log π_θ
    k3      = exp(log π_ref − log π_θ) − (log π_ref − log π_θ) − 1

    token_mean:          L = Σ_{b,t} m ℓ / Σ_{b,t} m
    seq_mean_token_sum:  L = Σ_b (Σ_t m ℓ) / #{b : Σ_t m > 0}

Length biases. ``token_mean`` weighs every token equally: a sequence's share of the gradient grows with its length,
and the scale of one sequence's contribution depends on the other sequences of the batch (its normaliser is the
batch's token count). ``seq_mean_token_sum`` gives each sequence the sum of its tokens, so a long sequence also
weighs more, but with a normaliser (the number of sequences) that does not depend on lengths: the gradient's scale
grows with the mean length. Neither divides a sequence by its own length, so neither has GRPO's bias towards short
correct and long wrong answers. When a step is split into micro-batches, each micro-batch's loss takes the whole
step's denominator (``normalizer=step_normalizer(...)``), so the micro-batch losses, and their gradients, add up to
those of the whole batch however its rows fall into micro-batches.

The cap C (``ratio_cap``, > 1 + ε_high) bites only where PPO's clip leaves the ratio unbounded: A < 0 and ρ > C. There
the token's value is C·A and its gradient C·A·∇log π_θ — dual-clip PPO's value, with truncated-IS's gradient (dual clip
zeroes it). For A > 0 and ρ > 1 + ε_high the clipped branch already wins. Log-ratios are clamped to ±20 before exp
(ρ ≤ 4.9e8), so a mismatched token gives a finite loss; the clamp zeroes that token's gradient.

Departures. From PPO: the "old" policy is vLLM's behaviour policy, not the trainer's own snapshot, so ρ also absorbs
the engine/trainer numerical mismatch (hence the cap); ε_low and ε_high may differ (DAPO's clip-higher); no value or
entropy loss terms. From GRPO: advantages are per call, not per completion; aggregation is token-level (DAPO), not
the per-sequence mean of GRPO; KL is the same k3 estimator, added per token. From the paper: it uses this
objective with identical credit; the ratio cap and the choice of aggregation are lit's options.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

AGGREGATIONS = ("token_mean", "seq_mean_token_sum")
LOG_RATIO_LIMIT = 20.0


@dataclass(frozen=True, slots=True)
class LossConfig:
    """The clipped policy-gradient objective's settings."""

    clip_eps_low: float = 0.2
    """ε_low: the ratio is clipped below at 1 − ε_low (acts on negative advantages); in (0, 1)."""
    clip_eps_high: float = 0.2
    """ε_high: the ratio is clipped above at 1 + ε_high (acts on positive advantages); > 0."""
    ratio_cap: float | None = 3.0
    """C: the unclipped branch's importance weight is truncated at C as a detached weight; > 1 + ε_high, or None
    for plain PPO clipping."""
    kl_beta: float = 0.0
    """β ≥ 0: weight of the k3 KL estimate to the reference model; > 0 needs ``ref_logprobs``."""
    aggregation: str = "token_mean"
    """``token_mean`` or ``seq_mean_token_sum`` (module docstring, with their length biases)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.clip_eps_low < 1.0:
            raise ValueError(f"LossConfig.clip_eps_low must be in (0, 1), got {self.clip_eps_low}")
        if not (math.isfinite(self.clip_eps_high) and self.clip_eps_high > 0.0):
            raise ValueError(f"LossConfig.clip_eps_high must be finite and > 0, got {self.clip_eps_high}")
        if self.ratio_cap is not None and not self.ratio_cap > 1.0 + self.clip_eps_high:
            raise ValueError(
                f"LossConfig.ratio_cap must be > 1 + clip_eps_high = {1.0 + self.clip_eps_high} or None, "
                f"got {self.ratio_cap}"
            )
        if not (math.isfinite(self.kl_beta) and self.kl_beta >= 0.0):
            raise ValueError(f"LossConfig.kl_beta must be finite and ≥ 0, got {self.kl_beta}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"LossConfig.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")


def step_normalizer(masks: Sequence[torch.Tensor], aggregation: str) -> float:
    """The denominator of a whole step's loss, given the response masks (B_i, T_i) of its micro-batches: their
    response tokens (``token_mean``) or their sequences with at least one (``seq_mean_token_sum``); at least 1."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if aggregation == "token_mean":
        count = sum(int(m.bool().sum()) for m in masks)
    else:
        count = sum(int(m.bool().any(dim=-1).sum()) for m in masks)
    return float(max(count, 1))


def step_loss(config: LossConfig, micro_batches: Sequence[Any]) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """The loss function of one step for ``Policy.update``: ``loss_fn(logp, micro_batch, entropy)`` is
    ``policy_loss`` on that micro-batch with the whole step's ``step_normalizer``, so that the micro-batch losses add
    up to the step's. ``micro_batches``: the learner's micro-batches (``response_mask`` and ``old_logprobs`` (B, T),
    ``advantages`` (B,))."""
    normalizer = step_normalizer([mb.response_mask for mb in micro_batches], config.aggregation)

    def loss_fn(logp: torch.Tensor, mb: Any, entropy: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
        return policy_loss(logp, mb.old_logprobs, mb.advantages, mb.response_mask.bool(), config, entropy=entropy,
                           normalizer=normalizer)

    return loss_fn


def _masked_log_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """a − b on response tokens, 0 elsewhere (padding may hold -inf or garbage), clamped for a finite exp."""
    return torch.where(mask, a - b, torch.zeros_like(a)).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def _aggregate(
    token_loss: torch.Tensor, mask: torch.Tensor, aggregation: str, normalizer: float | None
) -> torch.Tensor:
    """Reduce (B, T) per-token losses to a scalar; masked tokens contribute exactly 0."""
    masked = torch.where(mask, token_loss, torch.zeros_like(token_loss))  # (B, T)
    if aggregation == "token_mean":
        denom = normalizer if normalizer is not None else max(int(mask.sum()), 1)
        return masked.sum() / denom
    denom = normalizer if normalizer is not None else max(int(mask.any(dim=-1).sum()), 1)
    return masked.sum(dim=-1).sum() / denom


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    n = int(mask.sum())
    return float(torch.where(mask, x, torch.zeros_like(x)).sum()) / n if n else 0.0


@torch.no_grad()
def _metrics(
    r: torch.Tensor,
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    kl_tokens: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> dict[str, float]:
    """Ratio, clipping, KL and entropy statistics over the response tokens; all (B, T) inputs, detached."""
    lo, hi = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
    clipped = ((adv > 0) & (r > hi)) | ((adv < 0) & (r < lo))  # the clipped branch wins: no gradient
    capped = r > config.ratio_cap if config.ratio_cap is not None else torch.zeros_like(mask)
    metrics = {
        "loss/kl": _masked_mean(kl_tokens, mask) if kl_tokens is not None else 0.0,
        "loss/clip_frac": _masked_mean(clipped.to(r.dtype), mask),
        "loss/cap_frac": _masked_mean(capped.to(r.dtype), mask),
        # k3 estimate of KL(μ ‖ π_θ) from the sampled tokens: (ρ − 1) − log ρ.
        "loss/approx_kl": _masked_mean(r - 1.0 - log_ratio, mask),
        "loss/ratio_mean": _masked_mean(r, mask),
        "loss/ratio_max": float(r[mask].max()) if bool(mask.any()) else 0.0,
        "loss/tokens": float(mask.sum()),
    }
    if entropy is not None:
        metrics["loss/entropy"] = _masked_mean(entropy.detach(), mask)
    return metrics


def policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss L (module docstring) and its metrics.

    new_logprobs (B, T) from the policy (with grad), old_logprobs (B, T) the behaviour logprobs from vLLM, advantages
    (B,) one per transition, mask (B, T) bool with True on response tokens, ref_logprobs (B, T) for the KL term,
    entropy (B, T) for the metric only. ``normalizer`` replaces the aggregation's denominator (see module docstring).
    """
    assert new_logprobs.dim() == 2, f"new_logprobs must be (B, T), got {tuple(new_logprobs.shape)}"
    shape = new_logprobs.shape
    for name, t in (
        ("old_logprobs", old_logprobs),
        ("mask", mask),
        ("ref_logprobs", ref_logprobs),
        ("entropy", entropy),
    ):
        assert t is None or t.shape == shape, f"{name} has shape {tuple(t.shape)}, want {tuple(shape)}"
    assert advantages.shape == shape[:1], f"advantages has shape {tuple(advantages.shape)}, want ({shape[0]},)"
    assert mask.dtype == torch.bool, f"mask must be bool, got {mask.dtype}"
    assert normalizer is None or normalizer > 0, f"normalizer must be > 0, got {normalizer}"
    if config.kl_beta > 0.0 and ref_logprobs is None:
        raise ValueError("LossConfig.kl_beta > 0 needs ref_logprobs (a reference model), or set kl_beta = 0")

    log_ratio = _masked_log_diff(new_logprobs, old_logprobs.detach(), mask)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    adv = advantages.detach().to(new_logprobs.dtype)[:, None].expand(shape)  # (B, T)
    lo, hi = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
    weighted = ratio
    if config.ratio_cap is not None:
        # ρ̃: value min(ρ, C); the detached factor keeps the gradient ∝ min(ρ, C) instead of ρ.
        weighted = ratio * (config.ratio_cap / ratio).clamp(max=1.0).detach()
    surrogate = torch.minimum(weighted * adv, ratio.clamp(lo, hi) * adv)  # (B, T)
    policy_tokens = -surrogate  # (B, T)
    loss_policy = _aggregate(policy_tokens, mask, config.aggregation, normalizer)

    kl_tokens = None
    if ref_logprobs is not None:
        d = _masked_log_diff(ref_logprobs.detach(), new_logprobs, mask)  # (B, T)
        kl_tokens = torch.exp(d) - d - 1.0  # (B, T)
    loss = loss_policy
    if config.kl_beta > 0.0:
        loss = loss + config.kl_beta * _aggregate(kl_tokens, mask, config.aggregation, normalizer)

    metrics = _metrics(ratio.detach(), log_ratio.detach(), adv, mask, config, kl_tokens, entropy)
    # The micro-batch's own mean, whatever the normalizer: averaged by tokens over micro-batches, it is the step's.
    metrics["loss/policy"] = float(_aggregate(policy_tokens.detach(), mask, config.aggregation, None))
    return loss, metrics
