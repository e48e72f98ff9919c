"""The ``[rollouts]`` section: how each training step's rollouts are drawn and run (groups, asynchronous rollouts,
dynamic sampling, the curriculum, guidance). ``feed.StepFeed`` and ``curriculum.Curriculum`` read it as it is."""

from __future__ import annotations

from dataclasses import dataclass

from lit_trainer.settings import at_least, check


@dataclass(frozen=True)
class RolloutsConfig:
    SECTION = "rollouts"
    RULES = {"tasks_per_step": at_least(1), "min_group_size": at_least(1),
             "group_size": at_least(2, "(GRPO compares the rollouts of a group: one alone has no advantage)"),
             "max_staleness": at_least(0, "(0: synchronous)"), "extra_rollouts": at_least(0, "(0: off)"),
             "rest_after": at_least(0, "(0: off)"), "rest_steps": at_least(1)}

    tasks_per_step: int = 8
    """Distinct tasks per step."""
    group_size: int = 8
    """Rollouts per task (the GRPO group)."""
    min_group_size: int = 2
    """A task's group is trained on only if at least this many of its rollouts gave an episode (partial groups
    happen when rollouts fail after every retry)."""

    max_staleness: int = 0
    """0: generation and training alternate (synchronous). k >= 1: asynchronous rollouts: the next step's rollouts
    run while this step updates (one step ahead), and a call sampled with weights more than k versions older than
    the policy being updated is not trained on (``async/dropped_stale``). Needs ``update.recompute_old_logprobs``
    and ``loss.is_correction``, which correct for the older behaviour policy. Off by default: on a few CPU cores
    vLLM and the update compete for the same cores, so overlapping them gains nothing."""
    min_step_groups: int = 0
    """With ``max_staleness`` >= 1: a step's update starts once this many groups have ended (of its own tasks and
    of groups carried over), and trains on every group that has; the groups still running carry over, running, to
    the next step, so that a slow group does not stall the step (``rollouts/carried_groups``,
    ``rollouts/groups_in_flight``). 0: a step waits for all its groups (none carries over)."""

    extra_rollouts: int = 0
    """Dynamic sampling (DAPO's): when fewer than ``tasks_per_step`` of a step's groups have returns that differ
    (a group whose rollouts all got the same return teaches nothing), more tasks of the training split, none the
    step has run, are drawn and run in groups, until the step has that many groups with differing returns or has
    spent this many extra rollouts. The update trains on every group. 0: off. The step's ``accuracy`` and
    ``reward`` metrics stay those of its first draw (the extra tasks are not a fair sample); ``sampling/*`` counts
    the extra rounds, rollouts and groups, ``rollouts/without_signal`` the rollouts spent on groups that taught
    nothing. Synchronous rollouts only (``max_staleness`` = 0)."""

    rest_after: int = 0
    """Curriculum (``rollouts/curriculum.py``): a category of tasks (``rest_by``) whose last this many groups were
    each solved by every rollout (return >= ``train.success_reward``: nothing to learn there) rests for
    ``rest_steps`` steps, its tasks not drawn, then comes back. The step's ``curriculum/resting`` and
    ``curriculum/resting_tasks`` say how many categories and training tasks rested. 0: off. Synchronous rollouts
    only (``max_staleness`` = 0)."""
    rest_by: str = "id"
    """The task field whose value is a task's category for ``rest_after`` (e.g. ``"operation"``): every training
    task must have it. ``"id"``: each task is its own category."""
    rest_steps: int = 10
    """Steps a category sits out once it rests (``rest_after``)."""

    guidance: bool = False
    """Off-policy guidance (``rollouts/guidance.py``): a group whose every rollout failed (return below
    ``train.success_reward``), of a task that carries a ``reference`` (the text a correct agent answers to its first
    LLM call, in the model's format), gets one more episode: that call's prompt with the reference as the response,
    returned ``train.success_reward``. The group then has a signal, towards the reference. ``guidance/groups``
    counts the guided groups of a step, ``guidance/failed_groups`` those where every rollout failed. At least one
    training task must have a reference. Validation is never guided. Off by default."""

    def __post_init__(self) -> None:
        check(self)
        if self.min_group_size > self.group_size:
            raise ValueError(f"rollouts.min_group_size = {self.min_group_size} is more than rollouts.group_size = "
                             f"{self.group_size}: no group could ever be trained on")
        if not 0 <= self.min_step_groups <= self.tasks_per_step:
            raise ValueError(f"rollouts.min_step_groups must be between 0 (wait for every group) and "
                             f"rollouts.tasks_per_step = {self.tasks_per_step}, got {self.min_step_groups}")
        if self.extra_rollouts and self.extra_rollouts < self.group_size:
            raise ValueError(f"rollouts.extra_rollouts must be 0 (off) or at least rollouts.group_size = "
                             f"{self.group_size} (extra tasks run in whole groups), got {self.extra_rollouts}")
        if not self.rest_by:
            raise ValueError('rollouts.rest_by must name a task field ("id": each task is its own category)')
        self._check_asynchronous()

    def _check_asynchronous(self) -> None:
        """What asynchronous rollouts (``max_staleness``) cannot do, and what only they can."""
        if self.extra_rollouts and self.max_staleness:
            raise ValueError(f"rollouts.extra_rollouts = {self.extra_rollouts} (dynamic sampling) waits for a "
                             "step's groups before it draws more, which asynchronous rollouts do not: set "
                             "rollouts.extra_rollouts = 0 or rollouts.max_staleness = 0")
        if self.rest_after and self.max_staleness:
            raise ValueError(f"rollouts.rest_after = {self.rest_after} (the curriculum) needs each step's groups "
                             "before the next step draws, which asynchronous rollouts do not wait for: set "
                             "rollouts.rest_after = 0 or rollouts.max_staleness = 0")
        if self.min_step_groups and not self.max_staleness:
            raise ValueError(f"rollouts.min_step_groups = {self.min_step_groups} lets groups carry over to the next "
                             "step, which only asynchronous rollouts do: set rollouts.max_staleness >= 1, or "
                             "rollouts.min_step_groups = 0")
