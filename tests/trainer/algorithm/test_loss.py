"""The token-level clipped objective: clipping on both sides, the ratio cap, masks, all-masked rows, both
aggregations, KL and metrics — by hand and against a naive per-token loop (values and gradients)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from lit_trainer.algorithm.loss import LossConfig, policy_loss, sft_loss

LN = math.log


def naive_loss(new, old, adv, mask, config: LossConfig, ref=None, normalizer=None):
    """The module docstring's formula one token at a time, with torch scalars so autograd gives the gradient."""
    lo, hi, cap = 1 - config.clip_eps_low, 1 + config.clip_eps_high, config.ratio_cap
    total, tokens, sequences = torch.zeros((), dtype=new.dtype), 0, 0
    for b in range(new.shape[0]):
        row = [t for t in range(new.shape[1]) if mask[b, t]]
        sequences += bool(row)
        for t in row:
            ratio = torch.exp(new[b, t] - old[b, t])
            weighted = ratio * (cap / ratio.item()) if cap is not None and ratio.item() > cap else ratio
            token = -torch.minimum(weighted * adv[b], torch.clamp(ratio, lo, hi) * adv[b])
            if config.kl_beta > 0:
                d = ref[b, t] - new[b, t]
                token = token + config.kl_beta * (torch.exp(d) - d - 1)
            total = total + token
            tokens += 1
    if config.aggregation == "token_mean":
        return total / (normalizer or max(tokens, 1))
    return total / (normalizer or max(sequences, 1))


def logprobs_for(ratios: list[list[float]], old: float = -1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(new, old) logprobs (B, T) whose ratios exp(new − old) are ``ratios``; new requires grad."""
    old_lp = torch.full((len(ratios), len(ratios[0])), old, dtype=torch.float64)  # (B, T)
    new_lp = (old_lp + torch.tensor(ratios, dtype=torch.float64).log()).requires_grad_()  # (B, T)
    return new_lp, old_lp


def loss_and_grad(new, old, adv, mask, config, **kwargs):
    loss, metrics = policy_loss(new, old, adv, mask, config, **kwargs)
    (grad,) = torch.autograd.grad(loss, new)
    return loss, grad, metrics


def check_against_naive(new, old, adv, mask, config, ref=None, normalizer=None):
    loss, grad, metrics = loss_and_grad(new, old, adv, mask, config, ref_logprobs=ref, normalizer=normalizer)
    expected = naive_loss(new, old, adv, mask, config, ref, normalizer)
    (expected_grad,) = torch.autograd.grad(expected, new)
    assert_close(loss, expected)
    assert_close(grad, expected_grad)
    return loss, grad, metrics


PLAIN = LossConfig(clip_eps_low=0.2, clip_eps_high=0.2, ratio_cap=None)
ADV = torch.tensor([1.0, -1.0], dtype=torch.float64)  # (B,)
# Row 0 (A = +1): ρ = 1.5 clipped to 1.2 → ℓ = −1.2, no gradient; ρ = 0.5 → ℓ = −min(0.5, 0.8) = −0.5; ρ = 1 → −1.
# Row 1 (A = −1): ρ = 0.5 → ℓ = −min(−0.5, −0.8) = 0.8, clipped, no gradient; ρ = 1.5 → −min(−1.5, −1.2) = 1.5;
# ρ = 1.1 → 1.1. Unclipped tokens have dℓ/dlog π = −ρA.
RATIOS = [[1.5, 0.5, 1.0], [0.5, 1.5, 1.1]]
GRAD_SUM = [[0.0, -0.5, -1.0], [0.0, 1.5, 1.1]]


def test_clipping_on_both_sides_token_mean():
    new, old = logprobs_for(RATIOS)
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss, grad, metrics = check_against_naive(new, old, ADV, mask, PLAIN)
    # (−1.2 − 0.5 − 1.0 + 0.8 + 1.5 + 1.1) / 6 = 0.7 / 6
    assert_close(loss, torch.tensor(0.7 / 6, dtype=torch.float64))
    assert_close(grad, torch.tensor(GRAD_SUM, dtype=torch.float64) / 6)
    assert metrics["loss/clip_frac"] == pytest.approx(2 / 6)
    assert metrics["loss/ratio_mean"] == pytest.approx(6.1 / 6)
    assert metrics["loss/ratio_max"] == pytest.approx(1.5)
    assert metrics["loss/policy"] == pytest.approx(0.7 / 6)
    assert metrics["loss/cap_frac"] == 0.0


def test_seq_mean_token_sum_and_token_mean_differ_by_their_normaliser():
    new, old = logprobs_for(RATIOS)
    full = torch.ones(2, 3, dtype=torch.bool)
    seq = LossConfig(clip_eps_low=0.2, clip_eps_high=0.2, ratio_cap=None, aggregation="seq_mean_token_sum")
    loss, grad, _ = check_against_naive(new, old, ADV, full, seq)
    # row sums −2.7 and 3.4, mean over 2 sequences: 0.35
    assert_close(loss, torch.tensor(0.35, dtype=torch.float64))
    assert_close(grad, torch.tensor(GRAD_SUM, dtype=torch.float64) / 2)
    # Row 1 keeps one token (ℓ = 0.8): token_mean (−2.7 + 0.8) / 4 = −0.475; seq_mean_token_sum (−2.7 + 0.8) / 2.
    short = torch.tensor([[True, True, True], [True, False, False]])
    loss, _, _ = check_against_naive(new, old, ADV, short, PLAIN)
    assert_close(loss, torch.tensor(-0.475, dtype=torch.float64))
    loss, _, _ = check_against_naive(new, old, ADV, short, seq)
    assert_close(loss, torch.tensor(-0.95, dtype=torch.float64))


def test_ratio_cap_truncates_the_unclipped_branch_as_a_detached_weight():
    # Row 0 (A = −1): ρ = 4 > C = 2 → value −min(2·(−1), 1.2·(−1)) = 2, gradient −A·min(ρ, C) = 2;
    #                 ρ = 1.5 < C → ℓ = 1.5, gradient 1.5.
    # Row 1 (A = +1): ρ = 4 → clipped branch 1.2 wins → ℓ = −1.2, gradient 0; second token masked.
    new, old = logprobs_for([[4.0, 1.5], [4.0, 1.0]])
    adv = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False]])
    capped = LossConfig(clip_eps_low=0.2, clip_eps_high=0.2, ratio_cap=2.0)
    loss, grad, metrics = check_against_naive(new, old, adv, mask, capped)
    assert_close(loss, torch.tensor((2.0 + 1.5 - 1.2) / 3, dtype=torch.float64))
    assert_close(grad, torch.tensor([[2.0, 1.5], [0.0, 0.0]], dtype=torch.float64) / 3)
    assert metrics["loss/cap_frac"] == pytest.approx(2 / 3)
    assert metrics["loss/clip_frac"] == pytest.approx(1 / 3)
    # Without the cap the A < 0 token is unbounded: ℓ = 4, gradient 4.
    loss, grad, _ = check_against_naive(new, old, adv, mask, PLAIN)
    assert_close(loss, torch.tensor((4.0 + 1.5 - 1.2) / 3, dtype=torch.float64))
    assert_close(grad, torch.tensor([[4.0, 1.5], [0.0, 0.0]], dtype=torch.float64) / 3)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum"])
def test_masked_tokens_and_all_masked_rows_contribute_nothing_and_no_nan(aggregation):
    config = LossConfig(ratio_cap=3.0, kl_beta=0.1, aggregation=aggregation)
    new, old = logprobs_for([[1.5, 0.5, 1.0], [1.0, 1.0, 1.0], [2.0, 1.0, 1.0]])
    ref = old.clone()
    adv = torch.tensor([1.0, 0.5, -2.0], dtype=torch.float64)
    with torch.no_grad():  # garbage where the mask is False: padding, -inf from a masked softmax, NaN
        new[0, 2], old[0, 2], ref[0, 2] = -math.inf, 0.0, math.nan
        new[1] = -math.inf
    mask = torch.tensor([[True, True, False], [False, False, False], [True, True, True]])
    loss, grad, metrics = check_against_naive(new, old, adv, mask, config, ref)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert (grad[~mask] == 0).all()
    # The same loss as the batch without the padding row and the padded token.
    clean_new = torch.stack([new[0].detach(), new[2].detach()]).clone()
    clean_new[0, 2] = -1.0
    clean_ref = torch.stack([old[0], old[2]]).clone()
    clean_ref[0, 2] = -1.0
    sub = policy_loss(clean_new, clean_ref, adv[[0, 2]], mask[[0, 2]], config, ref_logprobs=clean_ref)[0]
    assert_close(loss.detach(), sub)
    assert all(math.isfinite(v) for v in metrics.values())
    # A batch with no response token at all: loss 0, zero gradient, finite metrics.
    none = torch.zeros_like(mask)
    loss, grad, metrics = loss_and_grad(new, old, adv, none, config, ref_logprobs=ref)
    assert loss.item() == 0.0 and (grad == 0).all()
    assert all(math.isfinite(v) for v in metrics.values()) and metrics["loss/ratio_max"] == 0.0


def test_kl_k3_approx_kl_and_entropy_by_hand():
    # ref − new = ln 2: k3 = 2 − ln 2 − 1 = 0.306853; A = 0 so the policy term is 0; β = 0.1 → loss 0.0306853.
    # d k3 / d log π = −exp(d) + 1 = −1 → gradient −0.1.
    new = torch.tensor([[-1.0, -3.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0 - LN(1.5), 0.0]], dtype=torch.float64)  # ρ = 1.5 on the response token
    ref = torch.tensor([[-1.0 + LN(2.0), 5.0]], dtype=torch.float64)
    mask = torch.tensor([[True, False]])
    entropy = torch.tensor([[2.5, 100.0]], dtype=torch.float64)
    adv = torch.zeros(1, dtype=torch.float64)
    config = LossConfig(kl_beta=0.1)
    loss, grad, metrics = loss_and_grad(new, old, adv, mask, config, ref_logprobs=ref, entropy=entropy)
    k3 = 2.0 - LN(2.0) - 1.0
    assert_close(loss, torch.tensor(0.1 * k3, dtype=torch.float64))
    assert_close(grad, torch.tensor([[-0.1, 0.0]], dtype=torch.float64))
    assert metrics["loss/kl"] == pytest.approx(k3)
    assert metrics["loss/approx_kl"] == pytest.approx(0.5 - LN(1.5))  # (ρ − 1) − ln ρ
    assert metrics["loss/entropy"] == pytest.approx(2.5)
    # β = 0: the KL is reported but not optimised.
    loss, _ = policy_loss(new, old, adv, mask, LossConfig(kl_beta=0.0), ref_logprobs=ref)
    assert loss.item() == 0.0
    with pytest.raises(ValueError, match="kl_beta"):
        policy_loss(new, old, adv, mask, config)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum"])
def test_entropy_bonus_by_hand(aggregation):
    # Response tokens with entropies 2.0 and 1.0 in row 0 and 3.0 in row 1 (row 1's second token is masked: its
    # 50.0 counts nowhere); A = 0, so the policy term is 0 and the loss is −η·(aggregated entropy), η = 0.01:
    #   token_mean:         −0.01·(2 + 1 + 3)/3 tokens    = −0.02;   d/dH = −0.01/3 per response token
    #   seq_mean_token_sum: −0.01·((2 + 1) + 3)/2 rows    = −0.03;   d/dH = −0.01/2 per response token
    new = torch.tensor([[-1.0, -2.0], [-0.5, -4.0]], dtype=torch.float64, requires_grad=True)
    old = new.detach().clone()
    entropy = torch.tensor([[2.0, 1.0], [3.0, 50.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    adv = torch.zeros(2, dtype=torch.float64)
    config = LossConfig(entropy_coef=0.01, aggregation=aggregation)
    loss, metrics = policy_loss(new, old, adv, mask, config, entropy=entropy)
    (grad,) = torch.autograd.grad(loss, entropy)
    n = 3.0 if aggregation == "token_mean" else 2.0
    assert_close(loss, torch.tensor(-0.01 * 6.0 / n, dtype=torch.float64))
    assert_close(grad, torch.tensor([[-0.01 / n, -0.01 / n], [-0.01 / n, 0.0]], dtype=torch.float64))
    assert metrics["loss/entropy"] == pytest.approx(2.0)  # the mean over response tokens, whatever the aggregation
    # With an advantage the bonus adds to the policy term; the step's normaliser divides both.
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    plain, _ = policy_loss(new, old, adv, mask, LossConfig(aggregation=aggregation), normalizer=4.0)
    both, _ = policy_loss(new, old, adv, mask, config, entropy=entropy, normalizer=4.0)
    assert_close(both, plain - 0.01 * 6.0 / 4.0)
    with pytest.raises(ValueError, match="entropy_coef"):
        policy_loss(new, old, adv, mask, config)
    assert config.trains_every_transition and LossConfig(kl_beta=0.1).trains_every_transition
    assert not LossConfig().trains_every_transition


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize(("cap", "beta"), [(None, 0.0), (1.5, 0.0), (2.0, 0.05)])
def test_random_batches_match_the_naive_loop(aggregation, cap, beta):
    gen = torch.Generator().manual_seed(3)
    B, T = 5, 6
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 2  # (B, T)
    new = (old + 0.8 * torch.randn(B, T, generator=gen, dtype=torch.float64)).requires_grad_()  # (B, T)
    ref = old + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)  # (B, T)
    adv = torch.randn(B, generator=gen, dtype=torch.float64)  # (B,)
    mask = torch.rand(B, T, generator=gen) > 0.3  # (B, T)
    mask[1] = False
    config = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, ratio_cap=cap, kl_beta=beta, aggregation=aggregation)
    _, _, metrics = check_against_naive(new, old, adv, mask, config, ref)
    assert metrics["loss/clip_frac"] > 0


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum"])
def test_normalizer_makes_micro_batches_add_up_to_the_batch(aggregation):
    gen = torch.Generator().manual_seed(4)
    old = -torch.rand(4, 5, generator=gen, dtype=torch.float64)
    new = (old + 0.5 * torch.randn(4, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(4, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    config = LossConfig(aggregation=aggregation)
    whole, _ = policy_loss(new, old, adv, mask, config)
    norm = float(mask.sum()) if aggregation == "token_mean" else 4.0
    parts = [
        policy_loss(new[s], old[s], adv[s], mask[s], config, normalizer=norm)[0] for s in (slice(0, 1), slice(1, 4))
    ]
    assert_close(parts[0] + parts[1], whole)
    check_against_naive(new, old, adv, mask, config, normalizer=norm)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"clip_eps_low": 1.0}, "clip_eps_low"),
        ({"clip_eps_high": 0.0}, "clip_eps_high"),
        ({"ratio_cap": 1.1}, "ratio_cap"),
        ({"kl_beta": -1.0}, "kl_beta"),
        ({"entropy_coef": -0.01}, "entropy_coef"),
        ({"entropy_coef": float("nan")}, "entropy_coef"),
        ({"aggregation": "seq_mean_token_mean"}, "aggregation"),
    ],
)
def test_loss_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=f"loss.{field}"):
        LossConfig(**kwargs)


def test_shapes_are_checked():
    new, old = logprobs_for(RATIOS)
    with pytest.raises(AssertionError, match="advantages"):
        policy_loss(new, old, torch.zeros(3), torch.ones(2, 3, dtype=torch.bool), PLAIN)
    with pytest.raises(AssertionError, match="mask"):
        policy_loss(new, old, ADV, torch.ones(2, 4, dtype=torch.bool), PLAIN)


def test_the_sft_loss_is_the_weighted_nll_of_the_response_tokens_over_the_normaliser():
    """Two rows, three response tokens in all (the rest masked): NLL 0.5 + 1.0 + 2.0 = 3.5; normaliser 7 (the
    step's demonstration tokens), weight 0.5: 0.5 * 3.5 / 7 = 0.25; the metric is the micro-batch's own mean."""
    logp = torch.tensor([[-9.0, -0.5, -1.0], [-9.0, -9.0, -2.0]], requires_grad=True)
    mask = torch.tensor([[False, True, True], [False, False, True]])
    loss, metrics = sft_loss(logp, mask, normalizer=7.0, weight=0.5)
    assert loss.item() == pytest.approx(0.25)
    assert metrics == {"sft/nll": pytest.approx(3.5 / 3)}
    loss.backward()
    assert_close(logp.grad, torch.tensor([[0.0, -0.5 / 7, -0.5 / 7], [0.0, 0.0, -0.5 / 7]]))
