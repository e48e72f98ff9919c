"""One training step's update as a pipeline: prepare → update → push → check.

- ``prepare``: LightningRL on the step's episodes (credit → group advantages) and the choice of what is trained on:
  groups smaller than ``min_group_size`` are dropped, transitions lit cannot use are skipped, calls sampled too many
  versions ago are left out (``max_staleness``), responses cut at ``max_tokens`` masked, and transitions whose
  advantage is 0 (a group where every rollout got the same return) add nothing to the policy gradient. Every
  transition's advantage is kept for ``lit show``, also of those then left out. A call sampled with settings lit
  cannot reproduce (top-p, top-k, penalties) stops the run with a message: its importance ratios would be wrong.
- ``update``: the optimizer step(s) of ``[update]`` on this process's share (learner/schedule.py). Under
  ``torchrun --nproc_per_node N`` the main process broadcasts the ``UpdateJob`` and every process runs this stage.
- ``push``: the new weights into every vLLM server (weight version = the step).
- ``check``: after the push of step 1 and every ``check_sync_every`` steps, vLLM's logprobs against the trainer's on
  two of the step's prompts (``score``): a sync that did not land stops the run.

With the policy sharded (``policy.shard``) every use of its weights is a collective: the loop runs ``update``,
``weights``, ``score`` and the checkpoint in every process (loop.py, ``together``).
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from lit_trainer.algorithm.advantages import episode_advantages
from lit_trainer.config import ConfigError, TrainConfig
from lit_trainer.engine import logprob_check
from lit_trainer.engine.fleet import Fleet, Score
from lit_trainer.engine.weight_sync import WeightSyncError
from lit_trainer.intake.episodes import Episode, Transition, unsupported_sampling
from lit_trainer.intake.rows import AdvantageRow, Store
from lit_trainer.learner.batching import SAMPLING_FIX, keep_usable
from lit_trainer.learner.schedule import drop_stale, learning_rate_at, mask_overlong, run_sft, run_update
from lit_trainer.roles import Roles

if TYPE_CHECKING:
    from lit_trainer.learner.policy import Policy

Pairs = list[tuple[Transition, float]]
"""Transitions with their advantages."""


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` made of a step's episodes."""

    pairs: Pairs
    """What the update trains on."""
    advantages: list[AdvantageRow]
    """Every transition's advantage, also of those then left out of the update (``lit show``)."""
    metrics: dict[str, float]

    @property
    def trains(self) -> bool:
        """Whether the update has anything to do (a step of all-correct or all-wrong groups has not)."""
        return bool(self.pairs)


@dataclass(frozen=True)
class UpdateJob:
    """What every process needs of one training step's update: the same arguments on each."""

    pairs: Pairs
    pad_id: int
    seed: int
    learning_rate: float
    """The step's rate (``policy.lr_schedule``)."""
    demos: Sequence[Transition] = ()
    """Demonstrations (rollouts/demonstrations.py): an SFT step's (``sft``), or the SFT term's during RL."""
    sft_weight: float = 0.0
    """The SFT term's weight during RL (``sft.weight``)."""
    sft: bool = False
    """An SFT step: the NLL of ``demos`` alone (``learner/schedule.run_sft``); ``pairs`` is empty."""


def prepare(episodes: Sequence[Episode], cfg: TrainConfig, step: int, dispatched: int | None = None) -> Prepared:
    """The pairs that training step ``step`` (from 1) trains on, every transition's advantage, and their metrics.
    ``dispatched``: the engine's weight version when the episodes' rollouts were handed out (default ``step - 1``,
    synchronous); with ``rollouts.max_staleness`` the calls sampled more than that many versions before the policy's
    are left out (``drop_stale``)."""
    groups = collections.Counter(e.task_id for e in episodes)
    kept = [e for e in episodes if groups[e.task_id] >= cfg.rollouts.min_group_size]
    metrics: dict[str, float] = {"rollouts/small_groups_dropped": float(len(episodes) - len(kept))}
    if not kept:
        return Prepared([], [], metrics)
    bad = unsupported_sampling(kept)
    if bad is not None and all(t.sampling_unsupported for e in kept for t in e.transitions):
        # every call: the agent's settings, not one odd span (which keep_usable skips: update/skipped_sampling)
        raise ConfigError(f"every transition of step {step} was sampled with settings beyond temperature, e.g. "
                          f"{bad.rollout_id}#{bad.index} (agent {bad.agent!r}) with {bad.sampling_unsupported}: "
                          f"{SAMPLING_FIX}")
    advantages, adv_metrics = episode_advantages(kept, cfg.credit, cfg.advantages)
    metrics.update(adv_metrics)
    roles = cfg.role_table
    if roles is not None:  # each adapter's calls are a group of their own: normalised among themselves
        advantages = _role_advantages(kept, roles, cfg, advantages, metrics)
    # rollouts run for nothing: their group gave no call an advantage (all rewards equal, or a group of one)
    metrics["rollouts/without_signal"] = float(sum(not bool(a.any()) for a in advantages))
    pairs = [(t, float(a)) for e, adv in zip(kept, advantages, strict=True)
             for t, a in zip(e.transitions, adv.tolist(), strict=True)]
    rows = [AdvantageRow(t.rollout_id, t.index, step, a) for t, a in pairs]
    if roles is not None:
        pairs, wrong = _served_by_own_adapter(pairs, roles)
        metrics["update/skipped_wrong_adapter"] = float(wrong)
    pairs, skipped = keep_usable(pairs, cfg.batching)  # a bad transition costs itself, not the step
    metrics.update({f"update/skipped_{reason}": float(n) for reason, n in skipped.items()})
    if cfg.rollouts.max_staleness:
        dispatched = step - 1 if dispatched is None else dispatched
        pairs, stale = drop_stale(pairs, step - 1, cfg.rollouts.max_staleness, dispatched)
        metrics.update(stale)
    pairs, overlong = mask_overlong(pairs, cfg.update)
    metrics["update/overlong_masked"] = float(overlong)
    metrics["update/transitions"] = float(sum(1 for _, a in pairs if a != 0.0))
    if not cfg.loss.trains_every_transition and not any(a != 0.0 for _, a in pairs):
        pairs = []  # all-correct or all-wrong groups (or only unusable transitions): nothing to learn from
    return Prepared(pairs, rows, metrics)


def _role_advantages(episodes: Sequence[Episode], roles: Roles, cfg: TrainConfig, advantages: list[torch.Tensor],
                     metrics: dict[str, float]) -> list[torch.Tensor]:
    """The advantages with each trained adapter's calls credited and normalised among themselves (the groups of a
    task made of the rollouts in which that adapter's agents called at all); ``role/<adapter>/...`` metrics added."""
    out = [a.clone() for a in advantages]
    for adapter in roles.adapters:
        own = [(i, [j for j, t in enumerate(e.transitions) if roles.adapter_of(t.agent) == adapter])
               for i, e in enumerate(episodes)]
        own = [(i, where) for i, where in own if where]
        metrics[f"role/{adapter}/calls"] = float(sum(len(where) for _, where in own))
        metrics[f"role/{adapter}/rollouts"] = float(len(own))
        if not own:
            continue
        parts = [replace(episodes[i], transitions=[replace(episodes[i].transitions[j], index=k)
                                                   for k, j in enumerate(where)]) for i, where in own]
        values, role_metrics = episode_advantages(parts, cfg.credit, cfg.advantages)
        metrics.update({f"role/{adapter}/{key}": value for key, value in role_metrics.items()})
        for (i, where), value in zip(own, values, strict=True):
            out[i][where] = value
    return out


def _served_by_own_adapter(pairs: Pairs, roles: Roles) -> tuple[Pairs, int]:
    """The pairs whose call the engine answered with its agent's adapter (``Transition.model``), and how many were
    not: their behaviour logprobs are another policy's (a demonstration or a guided reference has none)."""
    kept = [(t, a) for t, a in pairs if t.guided or t.model == roles.served_name(t.agent)]
    return kept, len(pairs) - len(kept)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Training step ``step``'s learning rate under ``policy.lr_schedule`` over ``train.steps``."""
    p = cfg.policy
    return learning_rate_at(step, cfg.train.steps, p.learning_rate, p.lr_schedule, p.warmup_steps, p.min_lr_ratio)


def update(policy: Policy, job: UpdateJob, cfg: TrainConfig, store: Store | None = None) -> dict[str, float]:
    """This process's share of the update's optimizer steps; their metrics. ``store`` (the main process's): keeps
    the trainer's logprobs of the response tokens it trained on, taken before the first optimizer step (the
    viewer's trainer-vs-engine gap)."""
    t0 = time.perf_counter()
    trainer_logprobs: dict[int, list[float]] = {}
    policy.set_learning_rate(job.learning_rate)
    if job.sft:
        metrics = run_sft(policy, job.demos, cfg.batching, job.pad_id)
    else:
        metrics = run_update(policy, job.pairs, cfg.update, cfg.loss, cfg.batching, job.pad_id, seed=job.seed,
                             trainer_logprobs=trainer_logprobs, demos=job.demos, sft_weight=job.sft_weight)
    if store is not None:
        store.save_trainer_logprobs((job.pairs[i][0].rollout_id, job.pairs[i][0].index, values)
                                    for i, values in trainer_logprobs.items())
    metrics["time/update"] = time.perf_counter() - t0
    metrics["policy/learning_rate"] = job.learning_rate
    return metrics


def weights(policy: Policy, dtype: Any = None, device: Any = None) -> dict[str, Any]:
    """The policy's whole weights, as vLLM gets them (sharded: gathered into the main process, {} elsewhere, cast
    to vLLM's serving ``dtype`` and moved to ``device`` as they are gathered)."""
    return policy.state_dict(dtype, device)


def push(fleet: Fleet, state: Mapping[str, Any], step: int) -> dict[str, float]:
    """The policy's weights ``state`` (``weights``) into every vLLM server as weight version ``step``."""
    t0 = time.perf_counter()
    report = fleet.push_weights(state, version=str(step))
    # None: a vLLM had died and was started again with these weights (Fleet); that took the time
    return {"time/sync": report.total_s if report is not None else time.perf_counter() - t0}


def score(policy: Policy, samples: Sequence[logprob_check.Sample], adapter: str | None = None) -> list[Any]:
    """The trainer's logprobs of vLLM's ``samples``, computed in float32 whatever the policy's precision: the
    weights vLLM was given (``adapter``: by that adapter, with one per role)."""
    if adapter is not None:
        policy.use_adapter(adapter)
    with policy.in_float32() as model:
        return logprob_check.score(model, samples)


def check(fleet: Fleet, policy: Policy, pairs: Pairs, cfg: TrainConfig, step: int,
          scorer: Score | None = None) -> dict[str, float]:
    """After the push of step 1 and of every ``train.check_sync_every`` steps, every server's logprobs of two of
    the step's prompts against the trainer's (each server got its own push); WeightSyncError when one is off by
    more than ``weight_sync.logprob_tolerance``. ``scorer``: how the trainer's logprobs are computed (default
    ``score`` on ``policy`` in this process)."""
    every = cfg.train.check_sync_every
    if not every or not (step == 1 or step % every == 0):
        return {}
    scorer = scorer or functools.partial(score, policy)
    roles = cfg.role_table
    if roles is None:
        return _gap_metrics(fleet.logprob_gaps(scorer, [t.prompt_ids for t, _ in pairs[:2]],
                                               cfg.weight_sync.logprob_tolerance), step, "")
    metrics: dict[str, float] = {}
    for adapter in roles.adapters:  # each adapter against its own served copy
        prompts = [t.prompt_ids for t, _ in pairs if roles.adapter_of(t.agent) == adapter][:2]
        if prompts:
            gaps = fleet.logprob_gaps(functools.partial(scorer, adapter=adapter), prompts,
                                      cfg.weight_sync.logprob_tolerance, model=roles.adapter_served_name(adapter))
            role = _gap_metrics(gaps, step, f" (adapter {adapter!r})")
            gap = metrics[f"role/{adapter}/sync_logprob_gap"] = role["sync/logprob_gap_max"]
            metrics["sync/logprob_gap_max"] = max(metrics.get("sync/logprob_gap_max", 0.0), gap)
            metrics["sync/servers_checked"] = role["sync/servers_checked"]
    return metrics


def _gap_metrics(gaps: Mapping[str, logprob_check.LogprobGap], step: int, what: str) -> dict[str, float]:
    """The sync check's metrics of ``gaps`` (by server); WeightSyncError when one is over its tolerance."""
    worst = max(gaps, key=lambda url: gaps[url].max_abs)
    if not gaps[worst].ok:
        raise WeightSyncError(f"after the weight sync of step {step}, the logprobs of vLLM at {worst}{what} differ "
                              f"from the trainer's by up to {gaps[worst].max_abs:.4f} nats (tolerance "
                              f"{gaps[worst].tolerance}): the new weights did not reach it. See its log; or set "
                              "inference.dtype=float32")
    return {"sync/logprob_gap_max": gaps[worst].max_abs, "sync/servers_checked": float(len(gaps))}
