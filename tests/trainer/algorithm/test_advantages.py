"""Group-relative advantages: GRPO and RLOO, with and without std normalisation, each edge case by hand, against a
naive reference; and the reduction of a one-call episode to single-turn GRPO through credit, advantages and loss."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch.testing import assert_close

from lit_trainer.algorithm.advantages import AdvantageConfig, episode_advantages, group_advantages
from lit_trainer.algorithm.credit import CreditConfig
from lit_trainer.algorithm.loss import LossConfig, policy_loss
from lit_trainer.intake.episodes import Episode, Transition, Unusable, UnusableRollout

EPS = 1e-6


def f64(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def one_call_episode(rollout_id: str, task_id: str, final: float, response_ids: list[int] | None = None) -> Episode:
    response_ids = response_ids or [7, 8]
    call = Transition([1, 2], response_ids, [-0.5] * len(response_ids), None, "a", rollout_id, task_id, 0, "s0")
    return Episode(rollout_id, task_id, 1, [call], final, final)


def naive_advantages(returns: list[float], tasks: list[str], estimator: str, normalize: bool) -> list[float]:
    """Loops over each rollout's group, with ``statistics`` for mean and Bessel-corrected std."""
    out = []
    for j, task in enumerate(tasks):
        group = [returns[k] for k, t in enumerate(tasks) if t == task]
        if len(group) == 1 or len(set(group)) == 1:
            out.append(0.0)
            continue
        if estimator == "grpo":
            baseline = statistics.mean(group)
        else:
            baseline = (sum(group) - returns[j]) / (len(group) - 1)
        scale = statistics.stdev(group) + EPS if normalize else 1.0
        out.append((returns[j] - baseline) / scale)
    return out


def run(returns: list[float], tasks: list[str], **kwargs) -> tuple[torch.Tensor, dict[str, float]]:
    advantages, metrics = group_advantages([f64([r]) for r in returns], tasks, AdvantageConfig(eps=EPS, **kwargs))
    return torch.cat(advantages), metrics


@pytest.mark.parametrize(
    ("estimator", "normalize", "expected"),
    [
        # mean 2, Bessel std sqrt((1 + 0 + 1) / 2) = 1: (R − 2) / (1 + eps).
        ("grpo", True, [-1 / (1 + EPS), 0.0, 1 / (1 + EPS)]),
        ("grpo", False, [-1.0, 0.0, 1.0]),
        # leave-one-out baselines (2+3)/2 = 2.5, (1+3)/2 = 2, (1+2)/2 = 1.5.
        ("rloo", False, [-1.5, 0.0, 1.5]),
        ("rloo", True, [-1.5 / (1 + EPS), 0.0, 1.5 / (1 + EPS)]),
    ],
)
def test_estimators_by_hand(estimator, normalize, expected):
    adv, metrics = run([1.0, 2.0, 3.0], ["t"] * 3, estimator=estimator, normalize_std=normalize)
    assert_close(adv, f64(expected))
    assert_close(adv, f64(naive_advantages([1.0, 2.0, 3.0], ["t"] * 3, estimator, normalize)))
    assert metrics["adv/groups"] == 1 and metrics["adv/singleton_groups"] == 0 and metrics["adv/zero_std_groups"] == 0


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_of_one_and_equal_returns_give_zero_without_nan(estimator):
    # task "solo": one rollout; task "flat": three rollouts with 0.1 (their float mean is not exactly 0.1);
    # task "ok": 0 and 1, mean 0.5, std sqrt(0.5) → ±0.5 / (0.70711 + eps) (grpo) or ±1 / (0.70711 + eps) (rloo).
    returns = [0.4, 0.1, 0.0, 0.1, 1.0, 0.1]
    tasks = ["solo", "flat", "ok", "flat", "ok", "flat"]
    adv, metrics = run(returns, tasks, estimator=estimator)
    half = (0.5 if estimator == "grpo" else 1.0) / (math.sqrt(0.5) + EPS)
    assert_close(adv, f64([0.0, 0.0, -half, 0.0, half, 0.0]))
    assert_close(adv, f64(naive_advantages(returns, tasks, estimator, True)))
    assert metrics["adv/singleton_groups"] == 1
    assert metrics["adv/zero_std_groups"] == 1
    assert metrics["adv/groups"] == 3
    assert metrics["adv/group_size_mean"] == pytest.approx(2.0)
    assert all(math.isfinite(v) for v in metrics.values())


def test_random_groups_match_the_naive_reference():
    gen = torch.Generator().manual_seed(1)
    returns = torch.randint(0, 4, (40,), generator=gen).double().div(3).tolist()  # ties make some flat groups
    tasks = [f"t{int(i)}" for i in torch.randint(0, 12, (40,), generator=gen)]
    for estimator in ("grpo", "rloo"):
        for normalize in (True, False):
            adv, metrics = run(returns, tasks, estimator=estimator, normalize_std=normalize)
            assert_close(adv, f64(naive_advantages(returns, tasks, estimator, normalize)))
            assert metrics["adv/mean"] == pytest.approx(float(adv.mean()))


def test_turn_level_credits_are_centred_by_the_groups_first_call_returns():
    # rollout a: credits [1, 3] (G = 1); rollout b: [3] (G = 3). mean 2, std sqrt(2).
    credits = [f64([1.0, 3.0]), f64([3.0])]
    adv, _ = group_advantages(credits, ["t", "t"], AdvantageConfig(normalize_std=False))
    assert_close(adv[0], f64([-1.0, 1.0]))
    assert_close(adv[1], f64([1.0]))
    adv, _ = group_advantages(credits, ["t", "t"], AdvantageConfig(eps=EPS))
    assert_close(adv[0], f64([-1.0, 1.0]) / (math.sqrt(2) + EPS))
    # returns all equal (G = 1 twice) → zero everywhere, though the second calls' credits differ.
    adv, metrics = group_advantages([f64([1.0, 5.0]), f64([1.0, -2.0])], ["t", "t"], AdvantageConfig())
    assert_close(torch.cat(adv), torch.zeros(4, dtype=torch.float64))
    assert metrics["adv/zero_std_groups"] == 1


def test_failed_rollouts_are_excluded_not_counted_as_zero():
    # Three rollouts of task t were launched; one failed. The group is the two successful ones: returns 1.0 and 0.5,
    # mean 0.75, std sqrt(2 · 0.25² / 1) = 0.353553 → ±0.25 / 0.353553 = ±0.707107.
    successful = [one_call_episode("r1", "t", 1.0), one_call_episode("r2", "t", 0.5)]
    adv, _ = episode_advantages(successful, CreditConfig(), AdvantageConfig(eps=EPS))
    expected = 0.25 / (math.sqrt(0.125) + EPS)
    assert_close(torch.cat(adv), f64([expected, -expected]))
    as_zero = naive_advantages([1.0, 0.5, 0.0], ["t"] * 3, "grpo", True)[:2]  # what counting the failure as 0 gives
    assert not torch.allclose(torch.cat(adv), f64(as_zero))
    with pytest.raises(TypeError, match="never counted as reward 0"):
        episode_advantages([*successful, UnusableRollout("r3", Unusable.FAILED)], CreditConfig(), AdvantageConfig())
    with pytest.raises(AssertionError, match="appears twice"):
        episode_advantages([successful[0], successful[0]], CreditConfig(), AdvantageConfig())


def test_empty_input_and_config_validation():
    adv, metrics = group_advantages([], [], AdvantageConfig())
    assert adv == [] and metrics["adv/groups"] == 0 and all(math.isfinite(v) for v in metrics.values())
    with pytest.raises(ValueError, match="advantages.estimator"):
        AdvantageConfig(estimator="ppo")
    with pytest.raises(ValueError, match="advantages.eps"):
        AdvantageConfig(eps=0.0)


def naive_grpo_loss(rewards, new, old, ref, lengths, eps_clip, beta):
    """Single-turn GRPO with token-level (DAPO) aggregation, from scratch: group z-score, clipped surrogate per token
    plus β·k3, averaged over all response tokens."""
    mean, std = statistics.mean(rewards), statistics.stdev(rewards)
    total, count = 0.0, 0
    for i, reward in enumerate(rewards):
        a = (reward - mean) / (std + EPS)
        for t in range(lengths[i]):
            ratio = torch.exp(new[i, t] - old[i, t])
            surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps_clip, 1 + eps_clip) * a)
            d = ref[i, t] - new[i, t]
            total = total - surrogate + beta * (torch.exp(d) - d - 1)
            count += 1
    return total / count


def test_one_call_episodes_reduce_to_single_turn_grpo():
    gen = torch.Generator().manual_seed(2)
    rewards, lengths, T = [1.0, 0.0, 0.0, 1.0, 0.5], [3, 1, 4, 2, 4], 4
    episodes = [
        one_call_episode(f"r{i}", "t", r, list(range(n))) for i, (r, n) in enumerate(zip(rewards, lengths, strict=True))
    ]
    old = -torch.rand(5, T, generator=gen, dtype=torch.float64) - 0.1  # (B, T)
    new = (old + 0.3 * torch.randn(5, T, generator=gen, dtype=torch.float64)).requires_grad_()  # (B, T)
    ref = old + 0.1 * torch.randn(5, T, generator=gen, dtype=torch.float64)  # (B, T)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T)

    adv, _ = episode_advantages(episodes, CreditConfig(mode="identical"), AdvantageConfig(eps=EPS))
    config = LossConfig(clip_eps_low=0.2, clip_eps_high=0.2, ratio_cap=None, kl_beta=0.05, aggregation="token_mean")
    loss, _ = policy_loss(new, old, torch.cat(adv), mask, config, ref_logprobs=ref)
    (grad,) = torch.autograd.grad(loss, new)

    expected = naive_grpo_loss(rewards, new, old, ref, lengths, 0.2, 0.05)
    (expected_grad,) = torch.autograd.grad(expected, new)
    assert_close(loss, expected)
    assert_close(grad, expected_grad)


def test_turn_level_credit_groups_each_call_position_on_its_own():
    # Task t, three rollouts with 2, 2 and 1 calls. Position 0: credits 1, 3, 2 → mean 2, std 1 (Bessel).
    # Position 1: credits 4 and 6 (rollout c has none) → mean 5, std sqrt(2). Task u: one rollout → singleton.
    credits = [f64([1.0, 4.0]), f64([3.0, 6.0]), f64([2.0]), f64([9.0, 9.0])]
    tasks = ["t", "t", "t", "u"]
    adv, metrics = group_advantages(credits, tasks, AdvantageConfig(normalize_std=False), per_call=True)
    assert_close(adv[0], f64([-1.0, -1.0]))
    assert_close(adv[1], f64([1.0, 1.0]))
    assert_close(adv[2], f64([0.0]))
    assert_close(adv[3], f64([0.0, 0.0]))
    adv, metrics = group_advantages(credits, tasks, AdvantageConfig(eps=EPS), per_call=True)
    assert_close(adv[0], f64([-1.0 / (1 + EPS), -1.0 / (math.sqrt(2) + EPS)]))
    assert metrics["adv/singleton_groups"] == 1 and metrics["adv/zero_std_groups"] == 0
    # RLOO at position 1: each of the two is compared with the other alone: 4 - 6 = -2, 6 - 4 = 2.
    adv, _ = group_advantages(credits, tasks, AdvantageConfig(estimator="rloo", normalize_std=False), per_call=True)
    assert_close(adv[0], f64([1.0 - 2.5, -2.0]))


def test_a_call_position_reached_once_or_with_equal_credits_gets_zero():
    # Position 0 differs (0 vs 1); position 1 is equal (5, 5); position 2 only rollout a reached.
    credits = [f64([0.0, 5.0, 7.0]), f64([1.0, 5.0])]
    adv, metrics = group_advantages(credits, ["t", "t"], AdvantageConfig(normalize_std=False), per_call=True)
    assert_close(adv[0], f64([-0.5, 0.0, 0.0]))
    assert_close(adv[1], f64([0.5, 0.0]))
    assert metrics["adv/unpaired_calls"] == 1 and metrics["adv/zero_std_groups"] == 0
    # every position equal: the group is zero-std, as under identical credit
    adv, metrics = group_advantages([f64([2.0, 3.0]), f64([2.0, 3.0])], ["t", "t"], AdvantageConfig(), per_call=True)
    assert_close(torch.cat(adv), torch.zeros(4, dtype=torch.float64))
    assert metrics["adv/zero_std_groups"] == 1


def two_call_episode(rollout_id: str, first: float | None, final: float) -> Episode:
    calls = [Transition([1], [2], [-0.5], reward, "a", rollout_id, "t", i, f"s{i}")
             for i, reward in enumerate((first, None))]
    return Episode(rollout_id, "t", 1, calls, final, final)  # with a final reward F, the return is F


def test_discounted_credit_is_centred_per_call_not_on_the_first_calls_credit():
    # The RAG failure (examples/rag/README.md): answers all equally good (F = 1), one useful search (0.1) in one
    # rollout. Discounted (γ = 0.5) credits: a [0.1 + 0.5, 1] = [0.6, 1]; b [0 + 0.5, 1] = [0.5, 1]. Per call:
    # position 0 centred on 0.55 → ±0.05; the answer calls are equal → 0. Centred on the first calls' credit (the
    # old way) the answer calls got 1 - 0.55 = +0.45 each, nine times the search's own advantage.
    episodes = [two_call_episode("a", 0.1, 1.0), two_call_episode("b", None, 1.0)]
    adv, metrics = episode_advantages(episodes, CreditConfig(mode="discounted", gamma=0.5),
                                      AdvantageConfig(normalize_std=False))
    assert_close(adv[0], f64([0.05, 0.0]))
    assert_close(adv[1], f64([-0.05, 0.0]))
    old, _ = group_advantages([f64([0.6, 1.0]), f64([0.5, 1.0])], ["t", "t"], AdvantageConfig(normalize_std=False))
    assert_close(old[0], f64([0.05, 0.45]))
    # identical credit keeps GRPO over the rollouts' returns: both F = 1, no signal
    adv, metrics = episode_advantages(episodes, CreditConfig(mode="identical"), AdvantageConfig(normalize_std=False))
    assert_close(torch.cat(adv), torch.zeros(4, dtype=torch.float64))
    assert metrics["adv/zero_std_groups"] == 1 and "adv/unpaired_calls" not in metrics
