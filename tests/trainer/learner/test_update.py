"""The step does not depend on how its rows fall into micro-batches: for every aggregation, one micro-batch and one
row per micro-batch give the same loss and the same gradient. On a tiny Llama made here (random weights, real
transformers model, real accelerate step), so that it runs in seconds."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from lit_trainer.algorithm.loss import AGGREGATIONS, LossConfig, step_loss, step_normalizer
from lit_trainer.intake.episodes import Transition
from lit_trainer.learner.batching import BatchingConfig, make_micro_batches
from lit_trainer.learner.policy import Policy, PolicyConfig

VOCAB = 64  # the tiny_model fixture's (conftest.py)


def transitions() -> tuple[list[Transition], list[float]]:
    """Rows of very different prompt and response lengths, so that token shares and row counts differ."""
    rng = random.Random(3)
    shapes = [(3, 1), (9, 7), (4, 2), (12, 3), (5, 9), (2, 4)]
    rows = [Transition([rng.randrange(1, VOCAB) for _ in range(p)], [rng.randrange(1, VOCAB) for _ in range(r)],
                       [-rng.uniform(0.5, 4.0) for _ in range(r)], None, "a", f"r{i}", "t", 0, "s")
            for i, (p, r) in enumerate(shapes)]
    return rows, [1.0, -0.5, 2.0, -1.5, 0.7, -0.3]


def gradient(model: Path, aggregation: str, budget: int) -> tuple[torch.Tensor, dict[str, float], int]:
    """The flattened gradient of one update (max_grad_norm=0: no clipping), its metrics, and how many micro-batches."""
    policy = Policy(PolicyConfig(model=str(model), max_grad_norm=0.0))
    rows, advantages = transitions()
    batches = make_micro_batches(rows, advantages, BatchingConfig(max_tokens_per_micro_batch=budget), pad_id=0)
    grads: list[torch.Tensor] = []
    step = policy.optimizer.step

    def capture(*args, **kwargs):  # read the accumulated gradient just before the optimizer uses it
        grads.append(torch.cat([p.grad.flatten() for p in policy.trainable]))
        return step(*args, **kwargs)

    policy.optimizer.step = capture
    metrics = policy.update(batches, step_loss(LossConfig(aggregation=aggregation), batches))
    return grads[0], metrics, len(batches)


@pytest.mark.parametrize(("budget", "n_batches"), [(2, 6), (20, 4)])  # one row each; rows of similar length
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batching_does_not_change_the_step(tiny_model: Path, aggregation: str, budget: int, n_batches: int):
    whole, whole_metrics, n_whole = gradient(tiny_model, aggregation, budget=10_000)
    split, split_metrics, n_split = gradient(tiny_model, aggregation, budget=budget)
    assert (n_whole, n_split) == (1, n_batches)
    assert whole.abs().sum() > 0
    assert_close(split, whole, atol=1e-6, rtol=1e-4)
    assert split_metrics["policy/grad_norm"] == pytest.approx(whole_metrics["policy/grad_norm"], rel=1e-4)
    if aggregation == "token_mean":  # the token-weighted mean of the micro-batches' own means is the step's mean
        assert split_metrics["loss/policy"] == pytest.approx(whole_metrics["loss/policy"], rel=1e-4)


def test_step_normalizer_counts_the_whole_step():
    masks = [torch.tensor([[0, 1, 1], [0, 0, 0]]), torch.tensor([[1, 1, 1, 1]])]
    assert step_normalizer(masks, "token_mean") == 6.0
    assert step_normalizer(masks, "seq_mean_token_sum") == 2.0
    assert step_normalizer([torch.zeros(1, 3)], "token_mean") == 1.0
    with pytest.raises(ValueError, match="aggregation must be one of"):
        step_normalizer(masks, "seq_mean")
