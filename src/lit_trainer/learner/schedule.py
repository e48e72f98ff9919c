"""One training step's update schedule: which transitions are trained on, in how many optimizer steps, how often.

    for epoch in 1..ppo_epochs:                       (the step's transitions, reshuffled each epoch)
        for each of mini_batches parts:               (one optimizer step each; micro-batches accumulate inside)
            Policy.update(part, loss with the part's normaliser N)

With the defaults (1 epoch, 1 mini-batch) a training step is one optimizer step on all its transitions and the
PPO ratio starts at about 1, so clipping only acts on the engine/trainer mismatch. More epochs or mini-batches reuse
the same rollouts for several optimizer steps (PPO): the policy moves away from the one that sampled them, and the
clip and the ratio cap bound how far. ``recompute_old_logprobs`` takes π_old from the trainer's own weights at the
start of the step (one more forward pass over the step, without gradients) instead of vLLM's logprobs; the loss then
corrects for the engine/trainer mismatch with ``loss.is_correction`` (algorithm/loss.py).

Transitions with advantage 0 add nothing to the policy gradient: they are left out of the forward and backward
passes, and counted in N only with ``loss.normalizer = "batch"``. With ``loss.kl_beta > 0`` or
``loss.entropy_coef > 0`` they carry the KL term's or the entropy bonus's gradient, so they are trained on too.
Responses cut by ``max_tokens`` (finish reason ``length``) are trained on (``overlong = "train"``) or left out of
the loss and of N (``"mask"``); to penalise them instead, use the credit assignment's automatic reward
(``credit.auto_reward_weight``: p_k counts a ``length`` finish as one signal).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from lit_trainer.algorithm.loss import LossConfig, normalizer_of, sft_loss, step_loss
from lit_trainer.intake.episodes import Transition
from lit_trainer.learner import distributed
from lit_trainer.learner.batching import BatchingConfig, MicroBatch, budget_for, keep_usable, make_micro_batches
from lit_trainer.progress import progress_bar
from lit_trainer.settings import at_least, check, one_of

if TYPE_CHECKING:
    from lit_trainer.learner.policy import Policy

OVERLONG = ("train", "mask")
LR_SCHEDULES = ("constant", "linear", "cosine")
"""``policy.lr_schedule``'s values (``learning_rate_at``)."""


@dataclass(frozen=True)
class UpdateConfig:
    """How a training step's transitions become optimizer steps."""

    SECTION = "update"
    RULES = {"ppo_epochs": at_least(1), "mini_batches": at_least(1), "overlong": one_of(OVERLONG)}

    ppo_epochs: int = 1
    """Passes over the step's transitions; each pass reshuffles them (seeded by ``train.seed`` and the step)."""
    mini_batches: int = 1
    """Optimizer steps per pass: the transitions are split into this many parts of (nearly) equal size."""
    recompute_old_logprobs: bool = False
    """π_old of the PPO ratio from the trainer's weights at the start of the step (one no-grad forward pass) instead
    of vLLM's behaviour logprobs; pair it with ``loss.is_correction`` for the mismatch between the two."""
    overlong: str = "train"
    """Responses cut by ``max_tokens``: ``train`` on them like any other, or ``mask`` them out of the loss and N
    (counted as ``update/overlong_masked``)."""

    def __post_init__(self) -> None:
        check(self)


def split(n: int, parts: int, seed: int) -> list[list[int]]:
    """Indices 0..n-1 in ``parts`` nearly equal parts (sizes differ by at most 1; none empty unless n < parts), in
    a random order fixed by ``seed``; with one part, the natural order."""
    order = list(range(n))
    if parts > 1:
        random.Random(seed).shuffle(order)
    size, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        end = start + size + (1 if p < extra else 0)
        out.append(order[start:end])
        start = end
    return [part for part in out if part]


def mask_overlong(pairs: Sequence[tuple[Transition, float]], config: UpdateConfig
                  ) -> tuple[list[tuple[Transition, float]], int]:
    """The pairs to train on and how many were masked for ending at ``max_tokens`` (``overlong = "mask"``)."""
    if config.overlong == "train":
        return list(pairs), 0
    kept = [(t, a) for t, a in pairs if t.finish_reason != "length"]
    return kept, len(pairs) - len(kept)


def drop_stale(pairs: Sequence[tuple[Transition, float]], policy_version: int, max_staleness: int,
               dispatched: int) -> tuple[list[tuple[Transition, float]], dict[str, float]]:
    """The pairs whose call was sampled at most ``max_staleness`` weight versions before ``policy_version`` (the
    policy the update starts from), and the staleness metrics. A call's version is the one the engine recorded
    (``Transition.weight_version``); a call without one counts as ``dispatched``, the engine's version when its
    rollout was handed out (no call of the rollout can be older); ``async/versioned_calls`` counts those that had
    one. A version above ``policy_version`` names weights that do not exist yet (an agent's word, not the
    engine's): it counts as ``dispatched`` too, so that no call escapes ``max_staleness`` by it."""
    versions = [t.weight_version if t.weight_version is not None and t.weight_version <= policy_version else None
                for t, _ in pairs]
    ages = [policy_version - (v if v is not None else dispatched) for v in versions]
    kept = [pair for pair, age in zip(pairs, ages, strict=True) if age <= max_staleness]
    metrics = {"async/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
               "async/staleness_max": float(max(ages, default=0)),
               "async/dropped_stale": float(len(pairs) - len(kept)),
               "async/calls": float(len(pairs)),
               "async/versioned_calls": float(sum(v is not None for v in versions))}
    return kept, metrics


def learning_rate_at(step: int, steps: int, peak: float, schedule: str = "constant", warmup_steps: int = 0,
                     min_ratio: float = 0.0) -> float:
    """The learning rate of training step ``step`` (from 1) of ``steps``: ``peak`` times

        k / W                                   for k = step <= W (warm-up, W = ``warmup_steps``)
        1                                       constant; or else, with p = (step - W - 1) / (steps - W)
        1 - (1 - m) p                           linear        (m = ``min_ratio``)
        m + (1 - m) (1 + cos(pi p)) / 2         cosine

    as Hugging Face's schedulers count: the first step after the warm-up runs at ``peak``, the last one just above
    ``m * peak`` (never at 0: it still trains), and a step past ``steps`` at ``m * peak`` (p stays within [0, 1]).
    ``--resume`` after raising ``train.steps`` recomputes the curve over the new count."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {schedule!r}")
    if warmup_steps and step <= warmup_steps:
        return peak * step / warmup_steps
    if schedule == "constant":
        return peak
    span = steps - warmup_steps
    progress = min(max((step - warmup_steps - 1) / span, 0.0), 1.0) if span > 0 else 1.0
    if schedule == "linear":
        return peak * (1.0 - (1.0 - min_ratio) * progress)
    return peak * (min_ratio + (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress)) / 2.0)


def run_update(policy: Policy, pairs: Sequence[tuple[Transition, float]], update: UpdateConfig, loss: LossConfig,
               batching: BatchingConfig, pad_id: int, seed: int,
               trainer_logprobs: dict[int, list[float]] | None = None, demos: Sequence[Transition] = (),
               sft_weight: float = 0.0) -> dict[str, float]:
    """Every optimizer step of one training step (module docstring) on ``policy``; their metrics, averaged over
    the optimizer steps by the response tokens each trained on, plus ``update/optimizer_steps``,
    ``update/micro_batches`` (the forward and backward passes of them all, under ``batching``'s token budget, shared
    out among the processes), ``update/micro_batches_over_budget`` (those of them that could not be cut to fit the
    budget: each ran whole with gradient checkpointing; many say the budget is too small for the prompts) and
    ``update/processes`` (how many processes shared them, learner/distributed.py).
    ``trainer_logprobs``: filled with the trainer's token logprobs of each trained pair (by index in ``pairs``) in
    the first optimizer step that trains it, before that step changes the weights. ``demos``: demonstrations
    whose NLL, times ``sft_weight``, every optimizer step adds to its loss (``with_demonstrations``)."""
    batching = budget_for(batching, policy.device.type)
    demo_batches, _ = demonstration_batches(demos, batching, pad_id, _adapter_of(policy))
    pairs = fill_guided_logprobs(policy, pairs, batching, pad_id)
    prox = _old_logprobs(policy, pairs, batching, pad_id) if update.recompute_old_logprobs else None
    sums: dict[str, float] = {}
    tokens, rollout_tokens, steps, micro_batches, over_budget = 0.0, 0.0, 0, 0, 0
    bar = progress_bar(total=update.ppo_epochs * update.mini_batches, desc="update", unit="optimizer step",
                       leave=False)
    for epoch in range(update.ppo_epochs):
        for part in split(len(pairs), update.mini_batches, seed * 1000 + epoch):
            chosen = [pairs[i] for i in part]
            counted = chosen if loss.normalizer == "batch" else [(t, a) for t, a in chosen if a != 0.0]
            normalizer = normalizer_of([len(t.response_ids) for t, _ in counted], loss.aggregation)
            train = [i for i in part if pairs[i][1] != 0.0 or loss.trains_every_transition]
            if not train and not demo_batches:
                continue
            batches = make_micro_batches([pairs[i][0] for i in train], [pairs[i][1] for i in train], batching,
                                         pad_id, adapter_of=_adapter_of(policy)) if train else []
            if prox is not None:  # mb.index counts rows of ``train``
                for mb in batches:
                    mb.prox_logprobs = _rows(mb, [prox[i] for i in train])
            kept: dict[int, list[float]] | None = {} if trainer_logprobs is not None and epoch == 0 else None
            loss_fn = with_demonstrations(step_loss(loss, batches, normalizer=normalizer), sft_weight, demo_batches)
            metrics = policy.update(batches + demo_batches, loss_fn, keep_logprobs=kept,
                                    with_entropy=loss.entropy_coef > 0.0)
            for row, values in (kept or {}).items():
                trainer_logprobs.setdefault(train[row], values)  # type: ignore[union-attr]
            weight = metrics["policy/response_tokens"] + metrics["sft/tokens"]
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value * weight
            tokens += weight
            rollout_tokens += metrics["policy/response_tokens"]
            steps += 1
            micro_batches += len(batches) + len(demo_batches)
            over_budget += sum(mb.over_budget for mb in batches + demo_batches)
            bar.update()
    bar.close()
    out = {key: value / max(tokens, 1.0) for key, value in sums.items()}
    out["policy/response_tokens"] = rollout_tokens
    out["update/optimizer_steps"] = float(steps)
    out["update/micro_batches"] = float(micro_batches)
    out["update/micro_batches_over_budget"] = float(over_budget)
    out["update/processes"] = float(distributed.world(policy.accelerator)[1])
    return out


def run_sft(policy: Policy, demos: Sequence[Transition], batching: BatchingConfig, pad_id: int) -> dict[str, float]:
    """One SFT step: one optimizer step on the NLL of ``demos``' response tokens (``algorithm/loss.sft_loss``);
    its metrics (``sft/nll``, ``sft/tokens``, ``sft/demonstrations``, ``sft/skipped``: those the learner cannot
    use, ``policy/grad_norm``, ``update/micro_batches``)."""
    batches, skipped = demonstration_batches(demos, budget_for(batching, policy.device.type), pad_id,
                                             _adapter_of(policy))
    metrics = {"sft/demonstrations": float(len(demos) - skipped), "sft/skipped": float(skipped),
               "update/micro_batches": float(len(batches))}
    if batches:
        metrics.update(policy.update(batches, with_demonstrations(None, 1.0, batches)))
        del metrics["policy/vllm_logprob_gap"], metrics["policy/response_tokens"]
    return metrics


def demonstration_batches(demos: Sequence[Transition], batching: BatchingConfig, pad_id: int,
                          adapter_of: Callable[[Transition], str | None] | None = None
                          ) -> tuple[list[MicroBatch], int]:
    """``demos`` packed into micro-batches marked as demonstrations, and how many were left out as the learner
    cannot use them (``batching.keep_usable``: a prompt over ``batching.max_prompt_tokens``, say)."""
    stand_ins = [(replace(t, logprobs=[0.0] * len(t.response_ids)), 0.0) for t in demos]  # the layout's
    usable, _ = keep_usable(stand_ins, batching)
    batches = make_micro_batches([t for t, _ in usable], [0.0] * len(usable), batching, pad_id,
                                 adapter_of=adapter_of) if usable else []
    for mb in batches:
        mb.demonstrations = True
    return batches, len(demos) - len(usable)


def with_demonstrations(loss_fn: Callable[..., Any] | None, weight: float, demo_batches: Sequence[MicroBatch]
                        ) -> Callable[..., Any]:
    """``loss_fn`` for the rollouts' micro-batches, and ``weight`` times the NLL over all ``demo_batches``' tokens
    for theirs (``sft_loss``, with the step's demonstration tokens as its normaliser)."""
    if not demo_batches:
        return loss_fn
    normalizer = float(max(sum(mb.n_response_tokens for mb in demo_batches), 1))

    def mixed(logp: torch.Tensor, mb: MicroBatch, entropy: torch.Tensor | None = None,
              ref: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        if mb.demonstrations:
            return sft_loss(logp, mb.response_mask.bool(), normalizer, weight)
        return loss_fn(logp, mb, entropy, ref)

    return mixed


def fill_guided_logprobs(policy: Policy, pairs: Sequence[tuple[Transition, float]], batching: BatchingConfig,
                         pad_id: int) -> list[tuple[Transition, float]]:
    """``pairs`` with every guided transition's (``Transition.guided``: a task's reference, not sampled) missing
    behaviour logprobs replaced by the trainer's own under its current weights, at the call's temperature: the
    ratio of a guided response starts at 1, so its gradient is the advantage times ∇log π (rollouts/guidance.py).
    Every process of a sharded policy must call it (``_old_logprobs``)."""
    guided = [i for i, (t, _) in enumerate(pairs) if t.guided and t.logprobs is None]
    if not guided:
        return list(pairs)
    # placeholders of the right length for the batching's layout; the forward pass ignores them
    stand_ins = [(replace(pairs[i][0], logprobs=[0.0] * len(pairs[i][0].response_ids)), pairs[i][1]) for i in guided]
    own = _old_logprobs(policy, stand_ins, batching, pad_id)
    out = list(pairs)
    for i, (t, a), values in zip(guided, stand_ins, own, strict=True):
        out[i] = (replace(t, logprobs=values), a)
    return out


@torch.no_grad()
def _old_logprobs(policy: Policy, pairs: Sequence[tuple[Transition, float]], batching: BatchingConfig, pad_id: int
                  ) -> list[list[float]]:
    """The trainer's logprobs of every pair's response tokens under its current weights, in ``pairs``' order (each
    process computes its share of the micro-batches, and every process gets them all)."""
    out: list[list[float]] = [[] for _ in pairs]
    batches = make_micro_batches([t for t, _ in pairs], [a for _, a in pairs], batching, pad_id,
                                 adapter_of=_adapter_of(policy))
    mine: dict[int, list[float]] = {}
    for mb, real in policy.my_share(batches):
        mb = policy.place(mb)
        logp, _ = policy.token_logprobs(mb)
        if not real:  # a sharded process's padding: it ran for the collectives only
            continue
        for b, i in enumerate(mb.index):
            mine[i] = logp[b][mb.response_mask[b].bool()].tolist()
    for share in distributed.gather(mine):
        for i, values in share.items():
            out[i] = values
    return out


def _rows(mb: MicroBatch, responses: list[list[float]]) -> torch.Tensor:
    """(B, T) token-space tensor holding ``responses[mb.index[b]]`` at row b's response positions, 0 elsewhere."""
    out = torch.zeros_like(mb.old_logprobs)  # (B, T)
    for b, i in enumerate(mb.index):
        where = mb.response_mask[b].bool()  # (T,)
        out[b, where] = torch.tensor(responses[i], dtype=out.dtype)
    return out


def _adapter_of(policy: Policy) -> Callable[[Transition], str | None] | None:
    """Which adapter trains a transition, for a policy of one adapter per role; None for one policy."""
    return (lambda t: policy.adapter_for(t.agent)) if policy.adapters else None
