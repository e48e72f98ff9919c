"""The update schedule on a tiny real Llama: the normaliser counts zero-advantage transitions (``batch``), PPO epochs
and mini-batches take several optimizer steps, recomputed old logprobs and importance-sampling corrections, overlong
responses, calls sampled too many weight versions ago (asynchronous rollouts), the KL term against a frozen
reference (full fine-tune and LoRA), the entropy bonus, guided responses without behaviour logprobs, and the
learning-rate schedule (by hand)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from lit_trainer.algorithm.loss import LossConfig
from lit_trainer.intake.episodes import Transition
from lit_trainer.learner.batching import BatchingConfig, make_micro_batches
from lit_trainer.learner.policy import Policy, PolicyConfig
from lit_trainer.learner.schedule import (
    UpdateConfig,
    drop_stale,
    fill_guided_logprobs,
    learning_rate_at,
    mask_overlong,
    run_sft,
    run_update,
    split,
)

VOCAB = 64  # the tiny_model fixture's (conftest.py)
BATCHING = BatchingConfig()


def rows(shapes: list[tuple[int, int]], seed: int = 5, finish: str = "stop") -> list[Transition]:
    rng = random.Random(seed)
    return [Transition(prompt_ids=[rng.randrange(1, VOCAB) for _ in range(p)],
                       response_ids=[rng.randrange(1, VOCAB) for _ in range(r)],
                       logprobs=[-rng.uniform(2.0, 5.0) for _ in range(r)], reward=None, agent="a",
                       rollout_id=f"r{i}", task_id="t", index=0, span_id="s", finish_reason=finish)
            for i, (p, r) in enumerate(shapes)]


def first_gradient(policy: Policy) -> list[torch.Tensor]:
    """Makes ``policy`` record the gradient of each optimizer step into the returned list."""
    grads: list[torch.Tensor] = []
    step = policy.optimizer.step

    def capture(*args, **kwargs):
        grads.append(torch.cat([p.grad.flatten() for p in policy.trainable]))
        return step(*args, **kwargs)

    policy.optimizer.step = capture
    return grads


def with_own_logprobs(policy: Policy, pairs: list[tuple[Transition, float]], shifts: list[float]
                      ) -> list[tuple[Transition, float]]:
    """The pairs with behaviour logprobs set to ``policy``'s own minus ``shifts[i]`` (π_old/μ = e^shift)."""
    mb = make_micro_batches([t for t, _ in pairs], [a for _, a in pairs], BATCHING, pad_id=0)[0]
    with torch.no_grad():
        own = policy.token_logprobs(mb)[0]  # (B, T)
    out = list(pairs)
    for b, i in enumerate(mb.index):
        t, adv = pairs[i]
        fields = {f: getattr(t, f) for f in t.__slots__}
        out[i] = (Transition(**{**fields, "logprobs": (own[b][mb.response_mask[b].bool()] - shifts[i]).tolist()}), adv)
    return out


def test_split_gives_near_equal_seeded_parts():
    parts = split(10, 3, seed=1)
    assert sorted(len(p) for p in parts) == [3, 3, 4] and sorted(sum(parts, [])) == list(range(10))
    assert parts == split(10, 3, seed=1) and parts != split(10, 3, seed=2)
    assert split(4, 1, seed=9) == [[0, 1, 2, 3]]
    assert split(2, 3, seed=0) and all(split(2, 3, seed=0))  # no empty parts


@pytest.mark.parametrize("normalizer", ["batch", "kept"])
def test_zero_advantage_tokens_count_in_the_batch_normaliser(tiny_model: Path, normalizer: str):
    """Defect 6: dropping the zero-advantage transitions used to drop their tokens from N too (``kept``); ``batch``
    keeps them in N, so the same informative transitions take a step smaller by kept/all tokens."""
    a, zero, c = rows([(4, 3), (5, 6), (3, 2)])
    loss = LossConfig(normalizer=normalizer)
    policy = Policy(PolicyConfig(model=str(tiny_model), max_grad_norm=0.0))
    grads = first_gradient(policy)
    run_update(policy, [(a, 1.0), (zero, 0.0), (c, -1.0)], UpdateConfig(), loss, BATCHING, pad_id=0, seed=0)
    alone = Policy(PolicyConfig(model=str(tiny_model), max_grad_norm=0.0))
    alone_grads = first_gradient(alone)
    run_update(alone, [(a, 1.0), (c, -1.0)], UpdateConfig(), loss, BATCHING, pad_id=0, seed=0)
    scale = (3 + 2) / (3 + 6 + 2) if normalizer == "batch" else 1.0
    assert alone_grads[0].abs().sum() > 0
    assert_close(grads[0], alone_grads[0] * scale, atol=1e-7, rtol=1e-4)
    assert LossConfig().normalizer == "batch"


def test_ppo_epochs_and_mini_batches_take_several_steps_and_the_ratio_moves(tiny_model: Path):
    pairs = list(zip(rows([(4, 3), (5, 6), (3, 2), (6, 4)]), [1.0, -1.0, 0.5, -0.5], strict=True))
    policy = Policy(PolicyConfig(model=str(tiny_model), learning_rate=5e-2))
    pairs = with_own_logprobs(policy, pairs, [0.0] * 4)  # the first optimizer step's ratio is exactly 1
    grads = first_gradient(policy)
    metrics = run_update(policy, pairs, UpdateConfig(ppo_epochs=2, mini_batches=2), LossConfig(), BATCHING, 0, 0)
    assert len(grads) == 4 and metrics["update/optimizer_steps"] == 4.0
    assert metrics["update/micro_batches"] == 4.0  # 2 rows of 5-11 tokens a mini-batch: one micro-batch each
    assert metrics["loss/ratio_max"] > 1.0 + 1e-3  # later optimizer steps see a policy that moved away
    assert metrics["policy/response_tokens"] == 2 * (3 + 6 + 2 + 4)


def test_the_token_budget_sets_the_micro_batches_of_an_optimizer_step(tiny_model: Path):
    """Four rows of 7, 11, 5 and 10 tokens, each its own prompt group: under a budget of 11 tokens no two fit
    together (two groups cost twice the longer one), so the one optimizer step runs 4 micro-batches."""
    pairs = list(zip(rows([(4, 3), (5, 6), (3, 2), (6, 4)]), [1.0, -1.0, 0.5, -0.5], strict=True))
    policy = Policy(PolicyConfig(model=str(tiny_model)))
    metrics = run_update(policy, pairs, UpdateConfig(), LossConfig(), BatchingConfig(max_tokens_per_micro_batch=11),
                         0, 0)
    assert metrics["update/optimizer_steps"] == 1.0 and metrics["update/micro_batches"] == 4.0
    assert metrics["update/micro_batches_over_budget"] == 0.0  # each row fits alone
    small = run_update(policy, pairs, UpdateConfig(), LossConfig(), BatchingConfig(max_tokens_per_micro_batch=6), 0, 0)
    assert small["update/micro_batches"] == 4.0 and small["update/micro_batches_over_budget"] == 3.0  # 7, 11, 10


def test_recomputed_old_logprobs_and_importance_sampling_corrections(tiny_model: Path):
    policy = Policy(PolicyConfig(model=str(tiny_model), learning_rate=1e-9))  # a step that changes nothing
    # vLLM's logprobs 2 nats below the trainer's on the first row (π_old/μ = e² > 2), equal on the second.
    pairs = with_own_logprobs(policy, list(zip(rows([(4, 3), (5, 6)]), [1.0, -1.0], strict=True)), [2.0, 0.0])
    update = UpdateConfig(recompute_old_logprobs=True)
    plain = run_update(policy, pairs, update, LossConfig(), BATCHING, 0, 0)
    # π_old is the trainer's own: the ratio starts at 1 however far vLLM's logprobs are; the gap is reported.
    assert plain["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert plain["mismatch/k3"] == pytest.approx(3 * (2.718281828**2 - 1 - 2) / 9, rel=1e-4)
    masked = run_update(policy, pairs, update, LossConfig(is_correction="mask", is_threshold=2.0), BATCHING, 0, 0)
    assert masked["mismatch/masked_frac"] == pytest.approx(3 / 9)
    truncated = run_update(policy, pairs, update, LossConfig(is_correction="truncate"), BATCHING, 0, 0)
    assert truncated["mismatch/truncated_frac"] == pytest.approx(3 / 9)
    # ρ = 1, so ℓ = −w·A: the first row's 3 tokens (A = 1) weigh 1 (none), 0 (mask) or C_is = 2 (truncate), the
    # second row's 6 tokens (A = −1) weigh 1.
    assert plain["loss/policy"] == pytest.approx(-(3 - 6) / 9, abs=1e-5)
    assert masked["loss/policy"] == pytest.approx(-(0 - 6) / 9, abs=1e-5)
    assert truncated["loss/policy"] == pytest.approx(-(3 * 2 - 6) / 9, abs=1e-5)


def transition(version: int | None) -> Transition:
    return Transition(prompt_ids=[1], response_ids=[2], logprobs=[-1.0], reward=None, agent="a", rollout_id="r",
                      task_id="t", index=0, span_id="s", weight_version=version)


def test_drop_stale_keeps_calls_at_most_max_staleness_versions_old():
    pairs = [(transition(v), 1.0) for v in (5, 4, 3, None)]
    # policy version 5: ages 0, 1, 2 and (no recorded version: dispatched at 4) 1
    kept, metrics = drop_stale(pairs, policy_version=5, max_staleness=1, dispatched=4)
    assert [t.weight_version for t, _ in kept] == [5, 4, None]
    assert metrics == {"async/staleness_mean": 1.0, "async/staleness_max": 2.0, "async/dropped_stale": 1.0,
                       "async/calls": 4.0, "async/versioned_calls": 3.0}
    kept, metrics = drop_stale(pairs, policy_version=5, max_staleness=2, dispatched=4)
    assert len(kept) == 4 and metrics["async/dropped_stale"] == 0.0
    assert drop_stale([], 3, 1, 2) == ([], {"async/staleness_mean": 0.0, "async/staleness_max": 0.0,
                                            "async/dropped_stale": 0.0, "async/calls": 0.0,
                                            "async/versioned_calls": 0.0})


def test_a_version_from_the_future_does_not_escape_the_staleness_limit():
    """An agent's word, not the engine's: a call that claims weights newer than the policy's counts as its
    rollout's dispatch version (4 versions old here), as if it carried none."""
    pairs = [(transition(v), 1.0) for v in (99, 5)]
    kept, metrics = drop_stale(pairs, policy_version=5, max_staleness=1, dispatched=1)
    assert [t.weight_version for t, _ in kept] == [5]
    assert metrics["async/staleness_max"] == 4.0 and metrics["async/versioned_calls"] == 1.0


def test_overlong_responses_are_masked_on_request():
    cut, done = rows([(2, 2)], finish="length") + rows([(2, 2)])
    pairs = [(cut, 1.0), (done, -1.0)]
    assert mask_overlong(pairs, UpdateConfig()) == (pairs, 0)
    assert mask_overlong(pairs, UpdateConfig(overlong="mask")) == ([(done, -1.0)], 1)


def test_kl_to_a_frozen_reference_starts_at_zero_and_grows(tiny_model: Path):
    """Defect 2: kl_beta > 0 used to crash (no reference logprobs); the policy now carries a frozen reference."""
    pairs = list(zip(rows([(4, 3), (5, 6)]), [1.0, -1.0], strict=True))
    policy = Policy(PolicyConfig(model=str(tiny_model), learning_rate=5e-2), reference=str(tiny_model))
    loss = LossConfig(kl_beta=0.1)
    first = run_update(policy, pairs, UpdateConfig(), loss, BATCHING, 0, 0)
    second = run_update(policy, pairs, UpdateConfig(), loss, BATCHING, 0, 0)
    assert first["loss/kl"] == pytest.approx(0.0, abs=1e-6) and second["loss/kl"] > 1e-4
    assert all(not p.requires_grad for p in policy.reference.parameters())


def test_the_entropy_bonus_trains_every_transition_and_raises_the_entropy(tiny_model: Path):
    """``loss.entropy_coef`` > 0: the zero-advantage transitions carry the bonus's gradient, so they are trained on
    (without it they are left out); steps on the bonus alone (every advantage 0) spread the policy's distributions."""
    pairs = list(zip(rows([(4, 3), (5, 6), (3, 2)]), [0.0, 0.0, 0.0], strict=True))
    probe = make_micro_batches([t for t, _ in pairs], [1.0] * 3, BATCHING, pad_id=0)[0]
    policy = Policy(PolicyConfig(model=str(tiny_model), learning_rate=1e-3))

    def entropy() -> float:
        with torch.no_grad():
            return float(policy.token_logprobs(probe, with_entropy=True)[1][probe.response_mask.bool()].mean())

    before = entropy()
    kept: dict[int, list[float]] = {}
    loss = LossConfig(entropy_coef=1.0)
    for _ in range(3):
        metrics = run_update(policy, pairs, UpdateConfig(), loss, BATCHING, 0, 0, trainer_logprobs=kept)
    assert sorted(kept) == [0, 1, 2] and metrics["policy/response_tokens"] == 3 + 6 + 2
    assert metrics["update/optimizer_steps"] == 1 and "loss/entropy" in metrics
    after = entropy()
    assert after > before + 1e-4, (before, after)
    untouched = Policy(PolicyConfig(model=str(tiny_model), learning_rate=5e-2))
    assert run_update(untouched, pairs, UpdateConfig(), LossConfig(), BATCHING, 0, 0)["update/optimizer_steps"] == 0


def test_lora_reference_is_the_base_under_the_adapter(tiny_model: Path):
    pairs = list(zip(rows([(4, 3), (5, 6)]), [1.0, -1.0], strict=True))
    base = Policy(PolicyConfig(model=str(tiny_model)))
    lora = Policy(PolicyConfig(model=str(tiny_model), lora_rank=4, learning_rate=5e-2), reference=str(tiny_model))
    assert lora.reference is None  # no copy: the adapter is switched off instead
    mb = make_micro_batches([t for t, _ in pairs], [a for _, a in pairs], BATCHING, pad_id=0)[0]
    for _ in range(3):
        run_update(lora, pairs, UpdateConfig(), LossConfig(kl_beta=0.1), BATCHING, 0, 0)
    mask = mb.response_mask.bool()
    assert_close(lora.reference_logprobs(mb)[mask], base.token_logprobs(mb)[0].detach()[mask], atol=1e-5, rtol=0)
    assert not torch.allclose(lora.token_logprobs(mb)[0].detach()[mask], base.token_logprobs(mb)[0].detach()[mask])


def test_the_trainer_logprobs_kept_for_the_viewer_are_those_before_each_pairs_first_step(tiny_model: Path):
    """``run_update(trainer_logprobs=...)`` keeps, for each trained pair, its tokens' logprobs under the weights
    that pair's first optimizer step starts from: with one mini-batch, the weights before the update."""
    pairs = [(t, adv) for t, adv in zip(rows([(4, 3), (5, 6), (3, 2), (6, 4)]), [1.0, 0.0, -1.0, 0.5], strict=True)]
    policy = Policy(PolicyConfig(model=str(tiny_model)))
    mb = make_micro_batches([t for t, _ in pairs], [a for _, a in pairs], BATCHING, pad_id=0)[0]
    with torch.no_grad():
        own = policy.token_logprobs(mb)[0]  # (B, T)
    before = {i: own[b][mb.response_mask[b].bool()].tolist() for b, i in enumerate(mb.index)}
    kept: dict[int, list[float]] = {}
    run_update(policy, pairs, UpdateConfig(ppo_epochs=2), LossConfig(), BATCHING, 0, 0, trainer_logprobs=kept)
    assert sorted(kept) == [0, 2, 3]  # the zero-advantage pair is not trained on (kl_beta = 0)
    for i, values in kept.items():
        assert len(values) == len(pairs[i][0].response_ids)
        assert values == pytest.approx(before[i], abs=1e-5)


def test_learning_rate_schedules_by_hand():
    def rates(schedule: str, steps: int = 5, warmup: int = 0, m: float = 0.0) -> list[float]:
        return [round(learning_rate_at(k, steps, 1.0, schedule, warmup, m), 6) for k in range(1, steps + 2)]

    assert rates("constant") == [1.0] * 6
    assert rates("constant", warmup=2) == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    # p = (k - 1) / 5 for steps k = 1..5: the last step still trains; past train.steps (k = 6) the floor
    assert rates("linear") == [1.0, 0.8, 0.6, 0.4, 0.2, 0.0]
    assert rates("linear", m=0.2) == [1.0, 0.84, 0.68, 0.52, 0.36, 0.2]
    # cosine: (1 + cos(pi p)) / 2 at p = 0, .2, .4, .6, .8, 1 (cos 36° = 0.809017, cos 72° = 0.309017)
    assert rates("cosine") == [1.0, 0.904508, 0.654508, 0.345492, 0.095492, 0.0]
    # warm-up 1 of 5, then p = (k - 2) / 4, to m = 0.1: 0.1 + 0.9 (1 + cos(pi p)) / 2 (cos 45° = 0.707107)
    assert rates("cosine", warmup=1, m=0.1) == [1.0, 1.0, 0.868198, 0.55, 0.231802, 0.1]
    assert rates("linear", steps=1) == [1.0, 0.0]  # a one-step run trains at the peak
    assert learning_rate_at(3, 10, 2e-5, "linear", 0, 0.5) == pytest.approx(1.8e-5)  # p = 0.2
    with pytest.raises(ValueError, match="lr_schedule must be one of"):
        learning_rate_at(1, 5, 1.0, "step")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("lr_schedule", "exponential", "lr_schedule must be one of"),
    ("warmup_steps", -1, "warmup_steps must be >= 0"),
    ("min_lr_ratio", 1.5, "min_lr_ratio must be in"),
])
def test_a_bad_schedule_setting_is_refused(field: str, value: object, message: str):
    with pytest.raises(ValueError, match=message):
        PolicyConfig(**{field: value})


def test_a_guided_response_gets_the_trainers_own_logprobs_and_is_pulled_up(tiny_model: Path):
    """A guided transition (a task's reference, rollouts/guidance.py) has no behaviour logprobs: the update takes
    the trainer's own before its first optimizer step (ratio 1, in every process of a sharded policy), leaves the
    sampled transitions' as they are, and a positive advantage raises the reference's logprob."""
    sampled = rows([(4, 3), (5, 6)])
    guided = replace(rows([(4, 5)], seed=9)[0], logprobs=None, guided=True, rollout_id="g")
    pairs = [(sampled[0], -0.5), (guided, 1.5), (sampled[1], -0.5)]
    policy = Policy(PolicyConfig(model=str(tiny_model), learning_rate=1e-2))
    probe = make_micro_batches([replace(guided, logprobs=[0.0] * 5)], [1.0], BATCHING, pad_id=0)[0]

    def own() -> torch.Tensor:
        with torch.no_grad():
            return policy.token_logprobs(probe)[0][probe.response_mask.bool()]  # (5,)

    before = own()
    filled = fill_guided_logprobs(policy, pairs, BATCHING, 0)
    assert [filled[0], filled[2]] == [pairs[0], pairs[2]] and filled[1][1] == 1.5
    assert filled[1][0].logprobs is not None and filled[1][0].guided
    assert_close(torch.tensor(filled[1][0].logprobs), before, atol=1e-5, rtol=0)
    assert pairs[1][0].logprobs is None  # the pairs given are left as they were
    metrics = run_update(policy, pairs, UpdateConfig(), LossConfig(), BATCHING, 0, 0)
    assert metrics["policy/response_tokens"] == 3 + 5 + 6
    assert float(own().sum()) > float(before.sum()) + 1e-3


def test_an_sft_step_raises_the_demonstrations_likelihood_and_reports_its_nll(tiny_model: Path):
    """``run_sft``: one optimizer step on the NLL of the demonstrations' response tokens (no behaviour logprobs);
    ``sft/nll`` is their mean NLL per token before the step, as computed by hand from the policy's logprobs."""
    demos = [replace(t, logprobs=None) for t in rows([(4, 3), (6, 5)], seed=11)]
    policy = Policy(PolicyConfig(model=str(tiny_model), learning_rate=1e-2))
    probe = make_micro_batches([replace(t, logprobs=[0.0] * len(t.response_ids)) for t in demos], [0.0, 0.0],
                               BATCHING, pad_id=0)[0]

    def likelihood() -> torch.Tensor:
        with torch.no_grad():
            return policy.token_logprobs(probe)[0][probe.response_mask.bool()]  # (8,)

    before = likelihood()
    metrics = run_sft(policy, demos, BATCHING, 0)
    assert metrics["sft/demonstrations"] == 2 and metrics["sft/tokens"] == 8 and metrics["sft/skipped"] == 0
    assert metrics["sft/nll"] == pytest.approx(float(-before.mean()), rel=1e-4)
    assert float(likelihood().sum()) > float(before.sum()) + 1e-3


def test_the_sft_term_joins_the_rl_step_in_one_optimizer_step(tiny_model: Path):
    """``run_update`` with demonstrations: one optimizer step whose gradient is the policy gradient's plus
    ``sft_weight`` times the NLL's (each with its own normaliser); the rollouts' metrics are averaged over their
    own tokens only."""
    pairs = [(t, 1.0) for t in rows([(4, 3)])]
    demos = [replace(t, logprobs=None) for t in rows([(5, 4)], seed=3)]
    grads = {}
    for name, weight, given in (("rl", 0.0, []), ("sft", 1.0, None), ("both", 0.5, demos)):
        policy = Policy(PolicyConfig(model=str(tiny_model), learning_rate=1e-2, max_grad_norm=0))  # unclipped
        captured = first_gradient(policy)
        if given is None:
            run_sft(policy, demos, BATCHING, 0)
        else:
            metrics = run_update(policy, pairs, UpdateConfig(), LossConfig(), BATCHING, 0, 0, demos=given,
                                 sft_weight=weight)
            assert metrics["update/optimizer_steps"] == 1 and metrics["policy/response_tokens"] == 3
        grads[name] = captured[0]
    assert_close(grads["both"], grads["rl"] + 0.5 * grads["sft"], atol=1e-6, rtol=1e-4)
    assert metrics["sft/nll"] > 0 and "loss/ratio_mean" in metrics
