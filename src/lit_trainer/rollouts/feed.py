"""Each training step's rollouts, handed to the loop one step at a time (``StepFeed.take``).

Synchronous (``max_staleness = 0``): a step's rollouts run when the loop takes them. Asynchronous: as soon as a
step has its rollouts, the next step's start in a background thread, so they run during this step's update and
weight sync (the sync pauses them and they go on with the new weights); the next step then waits only for what is
left of them (``time/rollout``). With ``min_step_groups``, it waits only until that many groups have ended, and
takes every group that has: the others carry over, still running, into the next step's rollouts
(``rollouts/carried_groups``, ``rollouts/groups_in_flight``), so that a slow group does not stall the step. A carried
group's calls more than ``max_staleness`` versions older than the policy are not trained on (the batch's
``dispatched_version`` says how old its oldest rollouts are), and a carried and a new group of the same task are one
group for the advantages (the same prompt). The last step, and validation, wait for every group; a run stopped
otherwise gives up the groups in flight (they fail in the store; ``--resume`` does not run them again). The
thread's exception, if any, is raised in the loop by ``take``.

A step's tasks are the same for the same seed and step, also after ``--resume`` (``sample_tasks``); if vLLM dies
during a step's rollouts it is started again and they run again, up to ``MAX_ENGINE_RESTARTS`` times a step.

Dynamic sampling (``extra_rollouts``, synchronous only): while fewer than ``tasks_per_step`` of the step's groups
have returns that differ (``groups_with_signal``), more tasks the step has not run are drawn (as many as the share
of groups with signal so far says are needed, within what is left of the budget) and run; the step's batch holds
every draw's episodes and the first draw's metrics, plus ``sampling/*``.

Curriculum (``rest_after``, synchronous only: ``curriculum.py``): a step draws from the tasks whose category is not
resting, its extra draws too, and then tells the curriculum its groups; ``curriculum/*`` says what rested.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Iterable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from lit_trainer.intake.episodes import Episode
from lit_trainer.rollouts.curriculum import Curriculum
from lit_trainer.rollouts.runner import RolloutBatch, RolloutRunner
from lit_trainer.rollouts.sampling import RolloutsConfig
from lit_trainer.rollouts.tasks import sample_tasks
from lit_trainer.steps import training_label

ABORT_WAIT_S = 60.0
"""How long a run stopping on an error waits for its rollouts running ahead to end (they check every 50 ms; a vLLM
being started again finishes first)."""

MAX_ENGINE_RESTARTS = 3
"""How many times one step's rollouts start vLLM again after it died, before the run stops."""


@dataclass(frozen=True)
class StepPlan:
    """What each training step's rollouts are: the config's ``[rollouts]`` section, with ``train.steps``,
    ``train.seed`` and ``agent.temperature``."""

    rollouts: RolloutsConfig
    steps: int
    seed: int
    temperature: float


def returns_by_task(episodes: Iterable[Episode]) -> dict[str, list[float]]:
    """Each task's group: the returns of its episodes, by task id."""
    returns: dict[str, list[float]] = collections.defaultdict(list)
    for episode in episodes:
        returns[episode.task_id].append(episode.episode_return)
    return returns


def groups_with_signal(episodes: Iterable[Episode], min_group_size: int) -> set[str]:
    """The tasks whose group GRPO learns from: at least ``min_group_size`` episodes (and two), whose returns are
    not all the same (equal returns give every rollout of the group an advantage of 0)."""
    return {task for task, values in returns_by_task(episodes).items()
            if len(values) >= max(min_group_size, 2) and max(values) > min(values)}


def groups_in_order(tasks: list[dict], episodes: Iterable[Episode]) -> list[tuple[dict, list[float]]]:
    """(task, its episodes' returns) for every task of ``tasks`` that has episodes, in the order of ``tasks``."""
    returns = returns_by_task(episodes)
    return [(task, returns[str(task["id"])]) for task in tasks if str(task["id"]) in returns]


class StepFeed:
    """The rollouts of training steps 0, 1, ... of ``tasks``, run by ``runner`` as ``plan`` says (module
    docstring)."""

    def __init__(self, runner: RolloutRunner, tasks: list[dict], plan: StepPlan,
                 curriculum: Curriculum | None = None) -> None:
        self.runner, self.tasks, self.plan, self.curriculum = runner, tasks, plan, curriculum
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="lit-rollouts") if plan.rollouts.max_staleness else None
        self.ahead: tuple[int, Future[RolloutBatch]] | None = None  # (step, its rollouts)
        self.finished: dict[int, RolloutBatch] = {}
        self.wanted = threading.Event()  # set while the loop waits for the rollouts running ahead

    def take(self, step: int) -> RolloutBatch:
        """Step ``step``'s (from 0) rollouts; in asynchronous mode, also start step ``step + 1``'s."""
        t0 = time.perf_counter()
        last = step + 1 >= self.plan.steps
        if self.ahead is not None and self.ahead[0] == step:
            if not last:  # the last step waits for every group: none is left over
                self.wanted.set()  # groups not ended once enough have carry over (``_enough``)
            try:
                self.finish_ahead()
            finally:
                self.wanted.clear()
        # Run now, the engine holds the weights of ``step`` updates; run ahead, it still does.
        batch = self.finished.pop(step) if step in self.finished else self._run(step, version=step)
        batch.metrics["time/rollout"] = time.perf_counter() - t0
        if self.pool is not None and not last:
            self.ahead = (step + 1, self.pool.submit(self._run, step + 1, step))
        return batch

    def finish_ahead(self) -> None:
        """Wait for the rollouts running ahead (their exception is raised here), and keep them for their step."""
        if self.ahead is not None:
            step, future = self.ahead
            self.ahead = None
            self.finished[step] = future.result()

    def close(self) -> None:
        """Wait for rollouts still running ahead (a run stopped by ``max_minutes``) and let go of the thread."""
        try:
            self.finish_ahead()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=False, cancel_futures=True)

    def abort(self, wait_s: float = ABORT_WAIT_S) -> None:
        """The loop is leaving on an error: end the rollouts running ahead (their attempts fail in the store) and
        wait up to ``wait_s`` for their thread to let go of the dispatcher and the fleet, which the services stop
        next (neither may be used from two threads). What they raise is the run's error no more: it is dropped."""
        self.runner.stopping.set()
        if self.ahead is not None:
            _, future = self.ahead
            self.ahead = None
            futures.wait([future], timeout=wait_s)
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> StepFeed:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def _run(self, step: int, version: int) -> RolloutBatch:
        plan, curriculum = self.plan, self.curriculum
        drawable = curriculum.drawable(self.tasks, step, plan.rollouts.tasks_per_step) if curriculum else self.tasks
        tasks = sample_tasks(drawable, plan.seed, step, plan.rollouts.tasks_per_step)
        batch = self.runner.run(tasks, plan.rollouts.group_size, plan.temperature, step, training_label(step), version,
                                self._enough if plan.rollouts.min_step_groups else None, restarts=MAX_ENGINE_RESTARTS)
        if plan.rollouts.extra_rollouts and not batch.nothing_to_train():  # a broken agent stops the loop: no draws
            batch = self._draw_more(step, version, drawable, tasks, batch)
        if curriculum:
            batch.metrics.update(curriculum.metrics(self.tasks, step))
            curriculum.record(step, groups_in_order(self.tasks, batch.episodes))
        return batch

    def _draw_more(self, step: int, version: int, drawable: list[dict], tasks: list[dict],
                   first: RolloutBatch) -> RolloutBatch:
        """Dynamic sampling (module docstring): ``first``, the step's draw of ``tasks``, with as many more draws
        from ``drawable`` as it takes, or as ``extra_rollouts`` allows, for ``tasks_per_step`` groups with signal."""
        plan = self.plan
        ran = {task["id"] for task in tasks}
        episodes, failures, dispatched = list(first.episodes), list(first.failures), first.dispatched_version
        draws = spent = succeeded = 0
        while True:
            signal = len(groups_with_signal(episodes, plan.rollouts.min_group_size))
            needed = plan.rollouts.tasks_per_step - signal
            affordable = (plan.rollouts.extra_rollouts - spent) // plan.rollouts.group_size
            fresh = [task for task in drawable if task["id"] not in ran]
            if needed <= 0 or affordable <= 0 or not fresh:
                break
            # as many tasks as the share of groups with signal so far says it takes; all that is left without any
            wanted = math.ceil(needed * len(ran) / signal) if signal else affordable
            draws += 1
            more = sample_tasks(fresh, plan.seed, step, min(wanted, affordable), draws)
            ran.update(task["id"] for task in more)
            batch = self.runner.run(more, plan.rollouts.group_size, plan.temperature, step,
                                    f"{training_label(step)}-more{draws}", version, restarts=MAX_ENGINE_RESTARTS)
            episodes += batch.episodes
            failures += batch.failures
            dispatched = min(dispatched, batch.dispatched_version)
            spent += len(more) * plan.rollouts.group_size
            succeeded += int(batch.metrics.get("rollouts/succeeded", 0))
        metrics = {**first.metrics, "sampling/draws": float(draws), "sampling/extra_rollouts": float(spent),
                   "sampling/extra_succeeded": float(succeeded), "sampling/groups_with_signal": float(signal)}
        return RolloutBatch(episodes, metrics, dispatched, failures)

    def _enough(self, ended_groups: int) -> bool:
        """Whether the rollouts running ahead may stop waiting: the loop wants them, and ``min_step_groups``
        groups ended."""
        return self.wanted.is_set() and ended_groups >= self.plan.rollouts.min_step_groups
