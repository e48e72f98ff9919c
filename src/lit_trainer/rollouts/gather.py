"""A run of rollouts turned into what training and validation use: the episodes of the rollouts that succeeded
(saved to the store) and the rollout metrics, overall and per task kind."""

from __future__ import annotations

import collections
import logging

from lit_trainer.intake.episodes import Episode, UnusableRollout, build_episode, handed_out
from lit_trainer.intake.rows import RolloutStatus, Store
from lit_trainer.rollouts.attempts import Outcome

log = logging.getLogger("lit")


def gather_episodes(store: Store, outcomes: list[Outcome], agents: tuple[str, ...], success: float,
                    vocab_size: int | None = None, context: int | None = None
                    ) -> tuple[list[Episode], dict[str, float], dict[str, str]]:
    """Episodes of the succeeded rollouts (saved to the store), counts, and why succeeded rollouts gave none (by
    reason, as in ``rollouts/unusable_<reason>``: its words and the first such rollout's detail). Failures give no
    episode, and neither does a rollout whose spans are not all stored (``rollouts/unusable_incomplete``: the
    dispatcher retries those, this is the last guard). Tasks that carry a string ``"kind"`` also get
    ``accuracy/<kind>`` and ``reward/<kind>`` (``per_kind``). ``vocab_size``: the policy's, which every token id
    must be below, and ``context``: the engine's ``max_model_len``, which no call is longer than (``build_episode``).
    An episode whose root names another task or attempt than the outcome's (what the trainer handed out) is
    unusable: grouped under the peer's word, it would move another task's baseline."""
    episodes: list[Episode] = []
    returns_of: dict[str, float] = {}
    unusable: collections.Counter[str] = collections.Counter()
    why: dict[str, str] = {}
    for outcome in outcomes:
        if outcome.status is not RolloutStatus.SUCCEEDED:
            continue
        if store.missing_spans(outcome.rollout_id) is not None:
            unusable["incomplete"] += 1
            why.setdefault("incomplete", f"its spans were not all stored (the first: rollout {outcome.rollout_id})")
            continue
        result = handed_out(build_episode(store.spans_of_rollout(outcome.rollout_id), agents or None, vocab_size,
                                          context), outcome.request.task_id, outcome.attempts)
        if isinstance(result, UnusableRollout):
            if not any(k.startswith("bad_") for k in unusable) and result.reason.name.startswith("BAD_"):
                log.warning("lit: rollout %s is not trained on (rollouts/unusable_%s): %s: %s. Later ones are "
                            "counted in the metrics, not logged", result.rollout_id, result.reason.name.lower(),
                            result.reason.value, result.detail)
            unusable[result.reason.name.lower()] += 1
            detail = f": {result.detail}" if result.detail else ""
            why.setdefault(result.reason.name.lower(),
                           f"{result.reason.value} (the first: rollout {result.rollout_id}{detail})")
            continue
        store.save_episode(outcome.rollout_id, result.to_dict(), result.episode_return)
        episodes.append(result)
        returns_of[outcome.rollout_id] = result.episode_return
    returns = [e.episode_return for e in episodes]
    n = len(outcomes)
    metrics = {
        "rollouts/requested": float(n),
        "rollouts/succeeded": float(sum(o.status is RolloutStatus.SUCCEEDED for o in outcomes)),
        "rollouts/failed": float(sum(o.status is not RolloutStatus.SUCCEEDED for o in outcomes)),
        "rollouts/retried": float(sum(o.attempts > 1 for o in outcomes)),
        "rollouts/unusable": float(sum(unusable.values())),
        **{f"rollouts/unusable_{k}": float(v) for k, v in unusable.items()},
        "episodes": float(len(episodes)),
        "reward/mean": sum(returns) / len(returns) if returns else float("nan"),
        "accuracy": sum(r >= success for r in returns) / n if n else float("nan"),
        "transitions/per_episode": sum(len(e.transitions) for e in episodes) / max(len(episodes), 1),
    }
    for key, value in per_kind(outcomes, returns_of, success).items():
        metrics.setdefault(key, value)  # a kind named "mean" does not replace reward/mean
    return episodes, metrics, why


def per_kind(outcomes: list[Outcome], returns_of: dict[str, float], success: float) -> dict[str, float]:
    """For each ``"kind"`` (a string field of the tasks, in order of first appearance): ``accuracy/<kind>`` over
    all its rollouts (failed or unusable ones count as wrong, like ``accuracy``) and ``reward/<kind>``, the mean
    return of its episodes (NaN without any, like ``reward/mean``). ``returns_of``: episode return by rollout id.
    Empty when no task has a kind."""
    groups: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        task = outcome.request.task
        kind = task.get("kind") if isinstance(task, dict) else None
        if isinstance(kind, str) and kind:
            groups.setdefault(kind, []).append(outcome)
    metrics: dict[str, float] = {}
    for kind, group in groups.items():
        returns = [returns_of[o.rollout_id] for o in group if o.rollout_id in returns_of]
        metrics[f"accuracy/{kind}"] = sum(r >= success for r in returns) / len(group)
        metrics[f"reward/{kind}"] = sum(returns) / len(returns) if returns else float("nan")
    return metrics
