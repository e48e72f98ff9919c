"""Each training step's rollouts (``rollouts/feed.py``): synchronous ones run when the loop takes them; with
``max_staleness`` the next step's run in a background thread while this step updates, and a step's batch says the
weight version its oldest rollouts were handed out with. The runner is a stand-in that records when it is asked and
waits for the test's word where the test needs a rollout still running (real vLLM and workers: the
``ppo_schedule`` run of tests/e2e/test_train_options.py trains with ``max_staleness = 1`` and checks the staleness
of every call it trained on), except in the carry-over test, which runs real worker processes, dispatcher,
collector and store (``train.min_step_groups``). Nothing here sleeps and then asserts a duration: each test waits
for events, with a deadline."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from lit_trainer.rollouts.feed import MAX_ENGINE_RESTARTS, StepFeed, StepPlan
from lit_trainer.rollouts.runner import RolloutBatch

DEADLINE_S = 30.0
TASKS = [{"id": i} for i in range(4)]


class Runner:
    """A stand-in for ``RolloutRunner``: ``run`` records its step, version and thread, and returns one episode
    named after its step. A step in ``gated`` sets ``started[step]`` and waits for ``release[step]`` before it
    returns; ``fail_at``: the step whose rollouts raise, as a stopped collector would."""

    def __init__(self, gated: tuple[int, ...] = (), fail_at: int | None = None):
        self.calls: list[tuple[int, int, str]] = []
        self.started = {step: threading.Event() for step in gated}
        self.release = {step: threading.Event() for step in gated}
        self.fail_at = fail_at

    def run(self, tasks, group, temperature, step, label, version, enough=None, restarts=0):
        assert label == f"s{step}" and restarts == MAX_ENGINE_RESTARTS and len(tasks) == 1 and group == 2
        self.calls.append((step, version, threading.current_thread().name))
        if step in self.started:
            self.started[step].set()
            assert self.release[step].wait(DEADLINE_S), f"the test never let step {step}'s rollouts end"
        if step == self.fail_at:
            raise RuntimeError(f"the collector stopped during step {step}")
        return RolloutBatch([f"episode of step {step}"], {"rollouts/succeeded": 1.0}, version)


def plan(max_staleness: int, steps: int = 3) -> StepPlan:
    return StepPlan(steps=steps, tasks_per_step=1, group_size=2, seed=0, temperature=1.0,
                    max_staleness=max_staleness)


def test_synchronous_rollouts_run_when_the_step_asks_in_the_loop_thread():
    runner = Runner()
    feed = StepFeed(runner, TASKS, plan(0))
    for step in range(3):
        batch = feed.take(step)
        assert batch.episodes == [f"episode of step {step}"] and batch.dispatched_version == step
        assert batch.metrics["time/rollout"] >= 0
    assert runner.calls == [(s, s, threading.current_thread().name) for s in range(3)]
    feed.close()


def test_asynchronous_rollouts_of_the_next_step_run_during_this_steps_update():
    runner = Runner(gated=(1,))
    feed = StepFeed(runner, TASKS, plan(1))
    assert feed.take(0).episodes == ["episode of step 0"]
    # "the update of step 1": step 2's rollouts (index 1) start in the background before the loop asks for them
    assert runner.started[1].wait(DEADLINE_S)
    step, version, thread = runner.calls[1]
    assert (step, version) == (1, 0) and thread.startswith("lit-rollouts")  # handed out under the weights of step 0
    runner.release[1].set()
    feed.ahead[1].result(timeout=DEADLINE_S)  # they ended during the "update"
    batch = feed.take(1)
    assert batch.episodes == ["episode of step 1"]
    assert [c[0] for c in runner.calls].count(1) == 1  # taken as it ran ahead, not run again
    # handed out while the engine held the weights of 0 updates, trained on by the policy of 1: one version old
    assert batch.dispatched_version == 0
    batch = feed.take(2)
    assert batch.episodes == ["episode of step 2"] and batch.dispatched_version == 1
    feed.close()
    assert [c[0] for c in runner.calls] == [0, 1, 2]  # nothing started past the last step


def test_rollouts_running_ahead_are_finished_before_validation_and_kept_for_their_step():
    runner = Runner()
    feed = StepFeed(runner, TASKS, plan(1))
    feed.take(0)
    feed.finish_ahead()  # validation needs the workers to itself
    assert len(runner.calls) == 2 and feed.ahead is None
    batch = feed.take(1)
    assert batch.episodes == ["episode of step 1"] and batch.dispatched_version == 0
    feed.close()  # waits for step 2's, started by take(1)
    assert [c[0] for c in runner.calls] == [0, 1, 2]


def test_an_error_in_the_rollouts_running_ahead_stops_the_loop_when_it_takes_them():
    feed = StepFeed(Runner(fail_at=1), TASKS, plan(1))
    feed.take(0)
    with pytest.raises(RuntimeError, match="collector stopped during step 1"):
        feed.take(1)
    feed.close()


class UnusedFleet:
    """Stands in for the vLLM fleet: the address the agents are given, which ``returns_after_its_seconds`` never
    calls (real vLLM is in the ``ppo_schedule`` run of tests/e2e/test_train_options.py)."""

    servers = [SimpleNamespace(openai_url="http://127.0.0.1:9/v1", model_name="none", api_key=None)]
    restarts = 0

    def check(self) -> None:
        pass


def test_a_group_still_running_carries_over_to_the_next_step_instead_of_stalling_it(tmp_path: Path):
    """Every step samples both tasks: task 0's rollouts take 4 s, task 1's 50 ms. Steps 1 and 2 (indices) each take
    their fast group as soon as it ended (``min_step_groups = 1``) and their slow groups carry over, running (step
    1's through two steps); step 3, the last, gets both back with its own two groups: the last step waits for every
    group, so that none is left over, and its episodes count from the oldest group's dispatch."""
    from lit_sdk.worker import spawn
    from lit_trainer.intake.collector import Collector
    from lit_trainer.intake.store import RolloutStatus, SqliteStore
    from lit_trainer.rollouts.dispatcher import Dispatcher
    from lit_trainer.rollouts.runner import AgentConfig, RolloutRunner
    from lit_trainer.services import stop_workers

    agent = AgentConfig(function="rollout_agents:returns_after_its_seconds")
    tasks = [{"id": 0, "value": 1.0, "seconds": 4.0}, {"id": 1, "value": 0.0, "seconds": 0.05}]
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(SqliteStore(tmp_path / "store.sqlite"))
        collector = stack.enter_context(Collector(store, "tcp://127.0.0.1:0"))
        dispatcher = Dispatcher(store, "tcp://127.0.0.1:0", collector.endpoint,
                                [s.openai_url for s in UnusedFleet.servers])
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "LIT_SPOOL_DIR": str(tmp_path / "spool")}
        workers = [spawn(agent.function, dispatcher.endpoint, 8, env)]
        stack.callback(stop_workers, dispatcher, workers)
        dispatcher.wait_for_workers(1, timeout_s=60)
        runner = RolloutRunner(store, collector, UnusedFleet(), dispatcher, agent, 1.0, session="carry")
        feed = StepFeed(runner, tasks, StepPlan(steps=4, tasks_per_step=2, group_size=2, seed=0, temperature=1.0,
                                               max_staleness=1, min_step_groups=1))
        metrics = feed.take(0).metrics  # nothing runs ahead of the first step: it waits for both groups
        assert metrics["rollouts/requested"] == 4 and metrics["rollouts/groups_in_flight"] == 0
        batch = feed.take(1)  # at once: step 1's rollouts have only just started
        assert batch.metrics["rollouts/requested"] == 2 and batch.metrics["rollouts/succeeded"] == 2
        assert batch.metrics["rollouts/carried_groups"] == 0 and batch.metrics["rollouts/groups_in_flight"] == 1
        assert batch.dispatched_version == 0
        batch = feed.take(2)  # at once again: step 1's slow group is still running too
        assert batch.metrics["rollouts/requested"] == 2 and batch.metrics["rollouts/carried_groups"] == 0
        assert batch.metrics["rollouts/groups_in_flight"] == 2 and batch.dispatched_version == 1
        batch = feed.take(3)
        assert batch.metrics["rollouts/requested"] == 8 and batch.metrics["rollouts/succeeded"] == 8
        assert batch.metrics["rollouts/carried_groups"] == 2 and batch.metrics["rollouts/groups_in_flight"] == 0
        assert batch.dispatched_version == 0  # step 1's slow group was handed out at version 0
        assert dispatcher.carried == []
        feed.close()
        statuses = [(r.task_id, r.status) for r in store.rollouts_of_step(1)]
        assert sorted(statuses) == [("0", RolloutStatus.SUCCEEDED)] * 2 + [("1", RolloutStatus.SUCCEEDED)] * 2
