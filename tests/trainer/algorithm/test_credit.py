"""Credit assignment: every mode on hand-computed episodes, with and without automatic intermediate rewards, against
a naive double-loop reference."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from lit_trainer.algorithm.credit import CreditConfig, assign_credit, assign_credits, auto_rewards
from lit_trainer.intake.episodes import Episode, Transition, Unusable, UnusableRollout


def episode(
    rewards: list[float | None],
    final: float | None,
    *,
    tool_errors: list[int] | None = None,
    other_errors: list[int] | None = None,
    finish: list[str] | None = None,
    pre_call: float | None = None,
    rollout_id: str = "r1",
    task_id: str = "t1",
) -> Episode:
    """An episode with one transition per entry of ``rewards`` (the per-call ``lit.reward`` sums)."""
    n = len(rewards)
    transitions = [
        Transition(
            prompt_ids=[1, 2],
            response_ids=[3, 4, 5],
            logprobs=[-0.1, -0.2, -0.3],
            reward=rewards[i],
            agent="a",
            rollout_id=rollout_id,
            task_id=task_id,
            index=i,
            span_id=f"s{i}",
            tool_errors=(tool_errors or [0] * n)[i],
            other_errors=(other_errors or [0] * n)[i],
            finish_reason=(finish or ["stop"] * n)[i],
        )
        for i in range(n)
    ]
    lit_rewards = [("r", value, i) for i, value in enumerate(rewards) if value is not None]
    if pre_call is not None:
        lit_rewards.insert(0, ("early", pre_call, -1))
    episode_return = final if final is not None else sum(v for _, v, _ in lit_rewards)
    return Episode(rollout_id, task_id, 1, transitions, final, episode_return, lit_rewards)


def naive_credit(ep: Episode, mode: str, gamma: float, weight: float) -> list[float]:
    """The module docstring's formulas, written out with Python loops."""
    n = len(ep.transitions)
    p = [-weight * (t.tool_errors + t.other_errors + (1 if t.finish_reason == "length" else 0)) for t in ep.transitions]
    if mode == "identical":
        return [ep.episode_return + sum(p)] * n
    r = [(t.reward or 0.0) + p[k] for k, t in enumerate(ep.transitions)]
    r[-1] += ep.final_reward or 0.0
    g = gamma if mode == "discounted" else 1.0
    return [sum(g ** (k - i) * r[k] for k in range(i, n)) for i in range(n)]


def f64(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# Three calls, a lit.reward of 0.5 after the second, final reward 1.0 (so R = 1.0).
PLAIN = dict(rewards=[None, 0.5, None], final=1.0)
# Same, plus runtime signals: a tool error on call 0, two other errors on call 1, call 2 cut at max_tokens.
NOISY = dict(PLAIN, tool_errors=[1, 0, 0], other_errors=[0, 2, 0], finish=["stop", "stop", "length"])


@pytest.mark.parametrize(
    ("spec", "mode", "gamma", "weight", "expected"),
    [
        # identical: every call gets R = 1.0.
        (PLAIN, "identical", 0.5, 0.0, [1.0, 1.0, 1.0]),
        # r = [0, 0.5, 1.0]; to go: c2 = 1.0, c1 = 0.5 + 1.0 = 1.5, c0 = 0 + 1.5 = 1.5.
        (PLAIN, "intermediate", 0.5, 0.0, [1.5, 1.5, 1.0]),
        # γ = 0.5: c2 = 1.0, c1 = 0.5 + 0.5·1.0 = 1.0, c0 = 0 + 0.5·1.0 = 0.5.
        (PLAIN, "discounted", 0.5, 0.0, [0.5, 1.0, 1.0]),
        # signals are ignored while the weight is 0.
        (NOISY, "discounted", 0.5, 0.0, [0.5, 1.0, 1.0]),
        # w = 0.1: p = [−0.1, −0.2, −0.1], Σp = −0.4; identical: 1.0 − 0.4 = 0.6 on every call.
        (NOISY, "identical", 0.5, 0.1, [0.6, 0.6, 0.6]),
        # r = [−0.1, 0.5 − 0.2, 1.0 − 0.1] = [−0.1, 0.3, 0.9]; c2 = 0.9, c1 = 1.2, c0 = 1.1.
        (NOISY, "intermediate", 0.5, 0.1, [1.1, 1.2, 0.9]),
        # γ = 0.5: c2 = 0.9, c1 = 0.3 + 0.45 = 0.75, c0 = −0.1 + 0.375 = 0.275.
        (NOISY, "discounted", 0.5, 0.1, [0.275, 0.75, 0.9]),
    ],
)
def test_credit_modes_by_hand(spec, mode, gamma, weight, expected):
    ep = episode(**spec)
    config = CreditConfig(mode=mode, gamma=gamma, auto_reward_weight=weight)
    credit = assign_credit(ep, config)  # (n,)
    assert_close(credit, f64(expected))
    assert_close(credit, f64(naive_credit(ep, mode, gamma, weight)))


def test_credit_without_final_reward_uses_lit_rewards_and_drops_pre_call_rewards_from_turn_modes():
    # lit.reward 0.1 before any call, 0.2 after call 0, 0.3 after call 2: R = 0.1 + 0.2 + 0.3 = 0.6.
    ep = episode([0.2, None, 0.3], None, pre_call=0.1)
    assert ep.episode_return == pytest.approx(0.6)
    assert_close(assign_credit(ep, CreditConfig(mode="identical")), f64([0.6, 0.6, 0.6]))
    # r = [0.2, 0, 0.3] (the pre-call 0.1 follows no action): to go [0.5, 0.3, 0.3].
    assert_close(assign_credit(ep, CreditConfig(mode="intermediate")), f64([0.5, 0.3, 0.3]))
    # γ = 0.9: c2 = 0.3, c1 = 0.27, c0 = 0.2 + 0.243 = 0.443.
    assert_close(assign_credit(ep, CreditConfig(mode="discounted", gamma=0.9)), f64([0.443, 0.27, 0.3]))


def test_discounted_with_gamma_one_is_intermediate_and_random_episodes_match_the_reference():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        n = 1 + trial % 5
        values = torch.randn(n, generator=gen).tolist()
        rewards = [v if k % 2 == 0 else None for k, v in enumerate(values)]
        final = None if trial % 3 == 0 else float(torch.randn(1, generator=gen))
        if final is None and all(r is None for r in rewards):
            rewards[0] = 0.25
        ep = episode(rewards, final, tool_errors=[k % 2 for k in range(n)], finish=["length"] * n)
        for mode in ("identical", "discounted", "intermediate"):
            config = CreditConfig(mode=mode, gamma=0.7, auto_reward_weight=0.05)
            assert_close(assign_credit(ep, config), f64(naive_credit(ep, mode, 0.7, 0.05)))
        one = CreditConfig(mode="discounted", gamma=1.0, auto_reward_weight=0.05)
        assert_close(
            assign_credit(ep, one), assign_credit(ep, CreditConfig(mode="intermediate", auto_reward_weight=0.05))
        )


def test_one_call_every_mode_gives_the_final_reward():
    ep = episode([None], 0.75)
    for mode in ("identical", "discounted", "intermediate"):
        assert_close(assign_credit(ep, CreditConfig(mode=mode)), f64([0.75]))


def test_auto_rewards_and_credit_metrics():
    ep = episode(**NOISY)
    # tool error → −0.1, two other errors → −0.2, finish reason "length" → −0.1.
    assert_close(auto_rewards(ep, 0.1), f64([-0.1, -0.2, -0.1]))
    credits, metrics = assign_credits([ep, episode(**PLAIN, rollout_id="r2")], CreditConfig(auto_reward_weight=0.1))
    assert_close(credits[1], f64([1.0, 1.0, 1.0]))
    assert metrics["credit/auto_penalized_calls"] == 3
    assert metrics["credit/auto_reward_sum"] == pytest.approx(-0.4)
    assert metrics["credit/calls"] == 6
    assert metrics["credit/mean"] == pytest.approx((3 * 0.6 + 3 * 1.0) / 6)


def test_unusable_rollouts_and_missing_returns_are_rejected():
    with pytest.raises(TypeError, match="UnusableRollout"):
        assign_credit(UnusableRollout("r9", Unusable.FAILED), CreditConfig())
    ep = episode([None], 1.0)
    broken = Episode(ep.rollout_id, ep.task_id, 1, ep.transitions, None, None)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="no return"):
        assign_credit(broken, CreditConfig())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"mode": "gae"}, "mode"), ({"gamma": 1.5}, "gamma"), ({"auto_reward_weight": -0.1}, "auto_reward_weight")],
)
def test_credit_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=f"credit.{field}"):
        CreditConfig(**kwargs)
