"""Rest what every rollout already solves (``rollouts.rest_after``): a curriculum that spends the steps' rollouts
where the policy still has something to learn.

A group whose rollouts all got the success reward teaches GRPO nothing (its advantages are all 0). Once a category
of tasks (the value of the task field ``rollouts.rest_by``; each task is its own with the default ``"id"``) has had
``rest_after`` such groups in a row, it rests: none of its tasks is drawn in the next ``rest_steps`` steps. Then it
comes back, and rests again after ``rest_after`` more groups solved by every rollout. A step draws from every task
when fewer than it needs are not resting. Groups count in the order of the training tasks, so the same rollouts
give the same state.

The state is a plain dict (``state`` / ``load``) that checkpoints keep, so that ``--resume`` draws the tasks the
run would have drawn. Knows nothing of rollouts or workers: the feed tells it each step's groups
(``feed.groups_in_order``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lit_trainer.rollouts.sampling import RolloutsConfig


@dataclass
class Curriculum:
    rollouts: RolloutsConfig
    """Its settings: ``rest_by``, ``rest_after``, ``rest_steps`` and ``min_group_size``."""
    success_reward: float
    """A rollout whose return is at least this solved its task (``train.success_reward``)."""
    streak: dict[str, int] = field(default_factory=dict)
    """Per category: groups solved by every rollout since its last group that was not (or since it rested)."""
    until: dict[str, int] = field(default_factory=dict)
    """Per resting category: the first step (from 0) that may draw it again."""

    def category(self, task: dict) -> str:
        return str(task[self.rollouts.rest_by])

    def resting(self, step: int) -> set[str]:
        """The categories that step ``step`` (from 0) does not draw."""
        return {category for category, until in self.until.items() if until > step}

    def drawable(self, tasks: list[dict], step: int, n: int) -> list[dict]:
        """The tasks step ``step`` draws its ``n`` from: those not resting, or all of them if that leaves fewer
        than ``n``."""
        resting = self.resting(step)
        if not resting:
            return tasks
        left = [task for task in tasks if self.category(task) not in resting]
        return left if len(left) >= n else tasks

    def record(self, step: int, groups: Iterable[tuple[dict, Sequence[float]]]) -> None:
        """Step ``step``'s groups, (task, its episodes' returns), in the order of the training tasks."""
        for task, returns in groups:
            if len(returns) < max(self.rollouts.min_group_size, 1):
                continue
            category = self.category(task)
            solved = min(returns) >= self.success_reward
            self.streak[category] = self.streak.get(category, 0) + 1 if solved else 0
            if self.rollouts.rest_after and self.streak[category] >= self.rollouts.rest_after:
                self.until[category] = step + 1 + self.rollouts.rest_steps
                self.streak[category] = 0

    def metrics(self, tasks: list[dict], step: int) -> dict[str, float]:
        resting = self.resting(step)
        return {"curriculum/resting": float(len(resting)),
                "curriculum/resting_tasks": float(sum(self.category(task) in resting for task in tasks))}

    def state(self) -> dict[str, Any]:
        return {"streak": dict(self.streak), "until": dict(self.until)}

    def load(self, state: dict[str, Any] | None) -> None:
        if state:
            self.streak, self.until = dict(state["streak"]), dict(state["until"])


def check_rest_by(tasks: list[dict], rest_by: str) -> str | None:
    """Why ``rest_by`` cannot name the categories of ``tasks`` (a task without that field, or a value that is not
    a string, number or boolean), or None."""
    for task in tasks:
        if rest_by not in task:
            return (f"rollouts.rest_by = {rest_by!r}, but training task {task.get('id')!r} has no field {rest_by!r} "
                    f"(its fields: {', '.join(sorted(task))}): name a field every task has, or \"id\"")
        if not isinstance(task[rest_by], str | int | float | bool):
            return (f"rollouts.rest_by = {rest_by!r}, but training task {task.get('id')!r} has a "
                    f"{type(task[rest_by]).__name__} there: a category is a string, number or boolean")
    return None
