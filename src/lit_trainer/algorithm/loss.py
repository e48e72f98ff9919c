"""The token-level LightningRL objective: a clipped policy gradient against the behaviour policy that vLLM sampled
from, with a cap on large importance ratios, an optional KL term to a frozen reference model and an optional
entropy bonus.

Every response token t of transition b carries its transition's advantage A_b; prompt and padding tokens are masked
(m_{b,t} = 0). μ is the behaviour policy vLLM sampled from (its logprobs at the call's temperature), π_old the
"old" policy of the ratio, sg the stop-gradient::

    ℓ_{b,t} = −w_{b,t} · min( ρ̃ A_b,  clip(ρ, 1 − ε_low, 1 + ε_high) A_b ) + β · k3_{b,t} − η · H_{b,t}
    ρ       = exp(log π_θ − log π_old)
    ρ̃      = ρ · sg(min(1, C / ρ))            value min(ρ, C), gradient min(ρ, C) · ∇log π_θ
    k3      = exp(log π_ref − log π_θ) − (log π_ref − log π_θ) − 1
    H       = −Σ_v π_θ(v) log π_θ(v)        the entropy of the distribution token t was drawn from (at its temperature)
    π_old   = μ (default), or the trainer's own logprobs before the step (``recompute_old_logprobs``)
    w       = 1 (π_old = μ, or is_correction = none)
            = sg(min(π_old / μ, C_is))                   is_correction = truncate  (truncated IS)
            = 1[1 / C_is ≤ π_old / μ ≤ C_is]             is_correction = mask      (masked IS)

    token_mean:          L = Σ_{b,t} m ℓ / N_tokens
    seq_mean_token_sum:  L = Σ_b (Σ_t m ℓ) / N_sequences

N (``normalizer``): ``batch`` counts the response tokens (or sequences) of every usable transition of the step,
including those whose advantage is 0, which are left out of the forward pass because they add nothing to the
policy gradient (as verl does: every token of the step weighs 1/N, so a step where few groups carry signal takes a
proportionally smaller step); ``kept`` counts only the transitions trained on, so the step size grows as fewer
groups carry signal (Dr. GRPO's objection to per-batch normalisers). bench/normalizer.py measures both.

Length biases. ``token_mean`` weighs every token equally: a sequence's share of the gradient grows with its length,
and the scale of one sequence's contribution depends on the other sequences of the batch (its normaliser is the
batch's token count). ``seq_mean_token_sum`` gives each sequence the sum of its tokens, so a long sequence also
weighs more, but with a normaliser (the number of sequences) that does not depend on lengths: the gradient's scale
grows with the mean length. Neither divides a sequence by its own length, so neither has GRPO's bias towards short
correct and long wrong answers. When a step is split into micro-batches, each micro-batch's loss takes the whole
step's denominator (``normalizer=``), so the micro-batch losses, and their gradients, add up to those of the whole
batch however its rows fall into micro-batches.

The cap C (``ratio_cap``, > 1 + ε_high) bites only where PPO's clip leaves the ratio unbounded: A < 0 and ρ > C. There
the token's value is C·A and its gradient C·A·∇log π_θ — dual-clip PPO's value, with truncated-IS's gradient (dual clip
zeroes it). For A > 0 and ρ > 1 + ε_high the clipped branch already wins. Log-ratios are clamped to ±20 before exp
(ρ ≤ 4.9e8), so a mismatched token gives a finite loss; the clamp zeroes that token's gradient.

Departures. From PPO: by default the "old" policy is vLLM's behaviour policy, not the trainer's own snapshot, so ρ
also absorbs the engine/trainer numerical mismatch (hence the cap); ``recompute_old_logprobs`` restores PPO's
snapshot and moves the mismatch into w, as verl's and SkyRL's per-token truncated/masked importance sampling do;
ε_low and ε_high may differ (DAPO's clip-higher); no value loss; an entropy bonus η (``entropy_coef``, as verl's
``entropy_coeff``; 0 by default) rewards spread in the policy's token distributions, the usual counter to a policy
that collapses onto one answer. From GRPO: advantages are per call, not per completion; aggregation is token-level
(DAPO), not the per-sequence mean of GRPO; KL is the same k3 estimator to a frozen reference (the initial weights),
added per token. From the paper: it uses this objective with identical credit; the ratio cap, the normaliser, the
importance-sampling correction and the choice of aggregation are lit's options.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lit_trainer.settings import above, at_least, between, check, one_of, positive

AGGREGATIONS = ("token_mean", "seq_mean_token_sum")
NORMALIZERS = ("batch", "kept")
IS_CORRECTIONS = ("none", "truncate", "mask")
LOG_RATIO_LIMIT = 20.0


@dataclass(frozen=True, slots=True)
class LossConfig:
    """The clipped policy-gradient objective's settings."""

    SECTION = "loss"
    RULES = {"clip_eps_low": between(0, 1, low_open=True, high_open=True), "clip_eps_high": positive(),
             "kl_beta": at_least(0, "(0: no KL term)"), "entropy_coef": at_least(0, "(0: no entropy bonus)"),
             "aggregation": one_of(AGGREGATIONS), "normalizer": one_of(NORMALIZERS),
             "is_correction": one_of(IS_CORRECTIONS), "is_threshold": above(1)}

    clip_eps_low: float = 0.2
    """ε_low: the ratio is clipped below at 1 − ε_low (acts on negative advantages); in (0, 1)."""
    clip_eps_high: float = 0.2
    """ε_high: the ratio is clipped above at 1 + ε_high (acts on positive advantages); > 0."""
    ratio_cap: float | None = 3.0
    """C: the unclipped branch's importance weight is truncated at C as a detached weight; > 1 + ε_high. None
    (library use; a config file has no null, where a very large C does the same) is plain PPO clipping."""
    kl_beta: float = 0.0
    """β ≥ 0: weight of the k3 KL estimate to the reference model; > 0 needs ``ref_logprobs``."""
    entropy_coef: float = 0.0
    """η ≥ 0: weight of the entropy bonus (the loss subtracts η times the aggregated entropy of the response tokens'
    distributions); > 0 needs the entropy with its gradient (the learner computes it then)."""
    aggregation: str = "token_mean"
    """``token_mean`` or ``seq_mean_token_sum`` (module docstring, with their length biases)."""
    normalizer: str = "batch"
    """N: ``batch`` (the tokens or sequences of every usable transition of the step, those with advantage 0
    included, as verl) or ``kept`` (only the transitions with a nonzero advantage). Module docstring."""
    is_correction: str = "none"
    """w, the correction for the trainer-vs-engine mismatch when ``update.recompute_old_logprobs`` is on: ``none``,
    ``truncate`` (w = min(π_old/μ, is_threshold)) or ``mask`` (w = 0 where π_old/μ is outside [1/is_threshold,
    is_threshold]). The mismatch itself is reported every step (``mismatch/*``)."""
    is_threshold: float = 2.0
    """C_is > 1 of ``is_correction``."""

    def __post_init__(self) -> None:
        check(self)
        if self.ratio_cap is not None and not self.ratio_cap > 1.0 + self.clip_eps_high:
            raise ValueError(f"loss.ratio_cap must be > 1 + loss.clip_eps_high = {1.0 + self.clip_eps_high} "
                             f"(or None), got {self.ratio_cap}")

    @property
    def trains_every_transition(self) -> bool:
        """Whether transitions whose advantage is 0 carry a gradient (the KL term's or the entropy bonus's), so that
        the update trains on them too instead of leaving them out."""
        return self.kl_beta > 0.0 or self.entropy_coef > 0.0


def step_normalizer(masks: Sequence[torch.Tensor], aggregation: str) -> float:
    """The denominator of a whole step's loss, given the response masks (B_i, T_i) of its micro-batches: their
    response tokens (``token_mean``) or their sequences with at least one (``seq_mean_token_sum``); at least 1."""
    lengths = [int(n) for m in masks for n in m.bool().sum(dim=-1)]  # response tokens of each row
    return normalizer_of(lengths, aggregation)


def normalizer_of(response_lengths: Sequence[int], aggregation: str) -> float:
    """N of a step from the response lengths of the transitions it counts: their tokens (``token_mean``) or the
    transitions with at least one (``seq_mean_token_sum``); at least 1."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    count = sum(response_lengths) if aggregation == "token_mean" else sum(1 for n in response_lengths if n > 0)
    return float(max(count, 1))


def step_loss(config: LossConfig, micro_batches: Sequence[Any], normalizer: float | None = None
              ) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """The loss function of one optimizer step for ``Policy.update``: ``loss_fn(logp, micro_batch, entropy, ref)``
    is ``policy_loss`` on that micro-batch with the whole step's N (``normalizer``, by default
    ``step_normalizer`` of the micro-batches), so that the micro-batch losses add up to the step's.
    ``micro_batches``: the learner's micro-batches (``response_mask``, ``old_logprobs`` and, when recomputed,
    ``prox_logprobs`` (B, T); ``advantages`` (B,))."""
    if normalizer is None:
        normalizer = step_normalizer([mb.response_mask for mb in micro_batches], config.aggregation)

    def loss_fn(logp: torch.Tensor, mb: Any, entropy: torch.Tensor | None = None, ref: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
        return policy_loss(logp, mb.old_logprobs, mb.advantages, mb.response_mask.bool(), config, ref_logprobs=ref,
                           entropy=entropy, normalizer=normalizer, prox_logprobs=mb.prox_logprobs)

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


@torch.no_grad()
def _is_weight(prox: torch.Tensor | None, behaviour: torch.Tensor, mask: torch.Tensor, config: LossConfig
               ) -> tuple[torch.Tensor | None, dict[str, float]]:
    """w of the module docstring (None when it is 1 everywhere) and the mismatch metrics between π_old and μ."""
    if prox is None:
        return None, {}
    log_r = _masked_log_diff(prox, behaviour, mask)  # (B, T): log π_old/μ
    r = torch.exp(log_r)  # (B, T)
    metrics = {"mismatch/k3": _masked_mean(r - 1.0 - log_r, mask), "mismatch/ratio_max": float(r[mask].max())
               if bool(mask.any()) else 0.0}
    if config.is_correction == "none":
        return None, metrics
    c = config.is_threshold
    if config.is_correction == "truncate":
        weight = r.clamp(max=c)
        metrics["mismatch/truncated_frac"] = _masked_mean((r > c).to(r.dtype), mask)
    else:
        weight = ((r >= 1.0 / c) & (r <= c)).to(r.dtype)
        metrics["mismatch/masked_frac"] = _masked_mean(1.0 - weight, mask)
    return weight, metrics


def _check_inputs(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, config: LossConfig, ref_logprobs: torch.Tensor | None,
                  entropy: torch.Tensor | None, normalizer: float | None, prox_logprobs: torch.Tensor | None) -> None:
    """``policy_loss``'s inputs have the shapes it documents, and what ``config`` asks for is given."""
    assert new_logprobs.dim() == 2, f"new_logprobs must be (B, T), got {tuple(new_logprobs.shape)}"
    shape = new_logprobs.shape
    for name, t in (
        ("old_logprobs", old_logprobs),
        ("mask", mask),
        ("ref_logprobs", ref_logprobs),
        ("entropy", entropy),
        ("prox_logprobs", prox_logprobs),
    ):
        assert t is None or t.shape == shape, f"{name} has shape {tuple(t.shape)}, want {tuple(shape)}"
    assert advantages.shape == shape[:1], f"advantages has shape {tuple(advantages.shape)}, want ({shape[0]},)"
    assert mask.dtype == torch.bool, f"mask must be bool, got {mask.dtype}"
    assert normalizer is None or normalizer > 0, f"normalizer must be > 0, got {normalizer}"
    if config.kl_beta > 0.0 and ref_logprobs is None:
        raise ValueError("loss.kl_beta > 0 needs ref_logprobs (a reference model), or set kl_beta = 0")
    if config.entropy_coef > 0.0 and entropy is None:
        raise ValueError("loss.entropy_coef > 0 needs the entropy of the response tokens (Policy.update "
                         "computes it when given with_entropy=True), or set entropy_coef = 0")


def policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    normalizer: float | None = None,
    prox_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss L (module docstring) and its metrics.

    new_logprobs (B, T) from the policy (with grad), old_logprobs (B, T) the behaviour logprobs μ from vLLM,
    advantages (B,) one per transition, mask (B, T) bool with True on response tokens, ref_logprobs (B, T) for the
    KL term, entropy (B, T) for the metric and, with ``entropy_coef`` > 0, the bonus (it must then carry the
    gradient), prox_logprobs (B, T) the recomputed π_old (None: π_old = μ).
    ``normalizer`` replaces the aggregation's denominator (see module docstring).
    """
    _check_inputs(new_logprobs, old_logprobs, advantages, mask, config, ref_logprobs, entropy, normalizer,
                  prox_logprobs)
    shape = new_logprobs.shape
    old = old_logprobs.detach() if prox_logprobs is None else prox_logprobs.detach()  # (B, T): π_old
    log_ratio = _masked_log_diff(new_logprobs, old, mask)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    weight, is_metrics = _is_weight(prox_logprobs, old_logprobs, mask, config)  # (B, T) or None
    adv = advantages.detach().to(new_logprobs.dtype)[:, None].expand(shape)  # (B, T)
    lo, hi = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
    weighted = ratio
    if config.ratio_cap is not None:
        # ρ̃: value min(ρ, C); the detached factor keeps the gradient ∝ min(ρ, C) instead of ρ.
        weighted = ratio * (config.ratio_cap / ratio).clamp(max=1.0).detach()
    surrogate = torch.minimum(weighted * adv, ratio.clamp(lo, hi) * adv)  # (B, T)
    policy_tokens = -surrogate if weight is None else -weight * surrogate  # (B, T)
    loss_policy = _aggregate(policy_tokens, mask, config.aggregation, normalizer)

    kl_tokens = None
    if ref_logprobs is not None:
        d = _masked_log_diff(ref_logprobs.detach(), new_logprobs, mask)  # (B, T)
        kl_tokens = torch.exp(d) - d - 1.0  # (B, T)
    loss = loss_policy
    if config.kl_beta > 0.0:
        loss = loss + config.kl_beta * _aggregate(kl_tokens, mask, config.aggregation, normalizer)
    if config.entropy_coef > 0.0:
        loss = loss - config.entropy_coef * _aggregate(entropy, mask, config.aggregation, normalizer)

    metrics = _metrics(ratio.detach(), log_ratio.detach(), adv, mask, config, kl_tokens, entropy) | is_metrics
    # The micro-batch's own mean, whatever the normalizer: averaged by tokens over micro-batches, it is the step's.
    metrics["loss/policy"] = float(_aggregate(policy_tokens.detach(), mask, config.aggregation, None))
    return loss, metrics


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, normalizer: float, weight: float = 1.0
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """Supervised fine-tuning on demonstrations: ``weight`` times the negative log-likelihood of the response tokens
    (``mask``, bool (B, T)) summed and divided by ``normalizer`` (the step's demonstration tokens, so that
    micro-batch losses add up to the step's). ``logp`` (B, T): the policy's token logprobs, with their gradient.
    Metrics: ``sft/nll``, this micro-batch's mean NLL per token."""
    nll = torch.where(mask, -logp, torch.zeros_like(logp))  # (B, T)
    tokens = max(int(mask.sum()), 1)
    return weight * nll.sum() / normalizer, {"sft/nll": float(nll.detach().sum()) / tokens}
