"""Each training step's rollouts (``rollouts/feed.py``): synchronous ones run when the loop takes them; with
``max_staleness`` the next step's run in a background thread while this step updates, and a step's batch says the
weight version its oldest rollouts were handed out with. The runner is a stand-in that records when it is asked and
waits for the test's word where the test needs a rollout still running (real vLLM and workers: the
``ppo_schedule`` run of tests/e2e/test_train_options.py trains with ``max_staleness = 1`` and checks the staleness
of every call it trained on), except in the carry-over test, which runs real worker processes, dispatcher,
collector and store (``rollouts.min_step_groups``). Nothing here sleeps and then asserts a duration: each test waits
for events, with a deadline."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from lit_sdk.resources import LLM
from lit_trainer.intake.episodes import Episode
from lit_trainer.rollouts.curriculum import Curriculum
from lit_trainer.rollouts.feed import MAX_ENGINE_RESTARTS, StepFeed, StepPlan, groups_in_order, groups_with_signal
from lit_trainer.rollouts.runner import RolloutBatch
from lit_trainer.rollouts.sampling import RolloutsConfig
from lit_trainer.rollouts.tasks import sample_tasks

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
    return StepPlan(RolloutsConfig(tasks_per_step=1, group_size=2, max_staleness=max_staleness), steps=steps, seed=0,
                    temperature=1.0)


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

    servers = [SimpleNamespace(openai_url="http://127.0.0.1:9/v1",
                               llm=lambda temperature, max_tokens: LLM("http://127.0.0.1:9/v1", "none",
                                                                       temperature=temperature,
                                                                       max_tokens=max_tokens))]
    serving = servers
    restarts = 0

    def check(self) -> None:
        pass


@contextlib.contextmanager
def real_runner(tmp_path: Path, function: str, session: str):
    """A ``RolloutRunner`` on a real store, collector, dispatcher and one worker process running ``function``:
    (the store, the runner)."""
    from lit_sdk.worker import spawn
    from lit_trainer.intake.collector import Collector
    from lit_trainer.intake.store import SqliteStore
    from lit_trainer.rollouts.dispatcher import Dispatcher
    from lit_trainer.rollouts.runner import AgentConfig, RolloutRunner
    from lit_trainer.run.services import stop_workers

    agent = AgentConfig(function=function)
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(SqliteStore(tmp_path / "store.sqlite"))
        collector = stack.enter_context(Collector(store, "tcp://127.0.0.1:0", open_to_local_users=True))
        dispatcher = Dispatcher(store, "tcp://127.0.0.1:0", collector.endpoint,
                                [s.openai_url for s in UnusedFleet.servers], open_to_local_users=True)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "LIT_SPOOL_DIR": str(tmp_path / "spool")}
        workers = [spawn(agent.function, dispatcher.endpoint, 8, env)]
        stack.callback(stop_workers, dispatcher, workers)
        dispatcher.wait_for_workers(1, timeout_s=60)
        yield store, RolloutRunner(store, collector, UnusedFleet(), dispatcher, agent, 1.0, session=session)


def test_a_group_still_running_carries_over_to_the_next_step_instead_of_stalling_it(tmp_path: Path):
    """Every step samples both tasks: task 0's rollouts take 4 s, task 1's 50 ms. Steps 1 and 2 (indices) each take
    their fast group as soon as it ended (``min_step_groups = 1``) and their slow groups carry over, running (step
    1's through two steps); step 3, the last, gets both back with its own two groups: the last step waits for every
    group, so that none is left over, and its episodes count from the oldest group's dispatch."""
    from lit_trainer.intake.rows import RolloutStatus

    tasks = [{"id": 0, "value": 1.0, "seconds": 4.0}, {"id": 1, "value": 0.0, "seconds": 0.05}]
    with real_runner(tmp_path, "rollout_agents:returns_after_its_seconds", "carry") as (store, runner):
        dispatcher = runner.dispatcher
        feed = StepFeed(runner, tasks, StepPlan(RolloutsConfig(tasks_per_step=2, group_size=2, max_staleness=1,
                                                                       min_step_groups=1), steps=4, seed=0,
                                                        temperature=1.0))
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


# Dynamic sampling (rollouts.extra_rollouts). The runner stands in for the rollouts (as above): each task's group gets
# returns fixed by the task, so which groups have signal is known; the real path runs in lit train
# (tests/e2e/test_train_options.py, the dynamic_sampling option).

def _episode(task: dict, g: int, value: float) -> Episode:
    return Episode(f"{task['id']}-g{g}", str(task["id"]), 1, [], value, value)


class GroupRunner:
    """``run`` gives each rollout of a task the return ``returns(task, g)`` (g: its place in the group), records
    the tasks and labels it was asked for, and fails every rollout when ``failing``."""

    def __init__(self, returns, failing: bool = False):
        self.returns, self.failing = returns, failing
        self.asked: list[tuple[str, list]] = []

    def run(self, tasks, group, temperature, step, label, version, enough=None, restarts=0):
        self.asked.append((label, [t["id"] for t in tasks]))
        n = len(tasks) * group
        if self.failing:
            return RolloutBatch([], {"rollouts/requested": float(n), "rollouts/succeeded": 0.0}, version,
                                ["ValueError: broken"] * n)
        episodes = [_episode(t, g, self.returns(t, g)) for t in tasks for g in range(group)]
        return RolloutBatch(episodes, {"rollouts/requested": float(n), "rollouts/succeeded": float(n),
                                       "accuracy": 0.5}, version)


def solved_when_even(task: dict, g: int) -> float:
    """Even tasks: every rollout solves it (no signal); odd ones: half of the group does."""
    return 1.0 if task["id"] % 2 == 0 else float(g % 2)


def dynamic_plan(extra: int, tasks_per_step: int = 4) -> StepPlan:
    return StepPlan(RolloutsConfig(tasks_per_step=tasks_per_step, group_size=2, extra_rollouts=extra), steps=2, seed=0,
                    temperature=1.0)


def test_groups_with_signal_are_those_whose_returns_differ_with_enough_episodes():
    tasks = {"a": [1.0, 0.0], "b": [1.0, 1.0], "c": [0.0], "d": [0.5, 0.5, 0.7]}
    episodes = [_episode({"id": k}, g, v) for k, values in tasks.items() for g, v in enumerate(values)]
    assert groups_with_signal(episodes, 2) == {"a", "d"}
    assert groups_with_signal(episodes, 3) == {"d"}
    assert groups_with_signal(episodes, 1) == {"a", "d"}  # one episode alone has nothing to differ from


def test_a_step_short_of_signal_draws_fresh_tasks_until_it_has_enough():
    tasks = [{"id": i} for i in range(40)]
    runner = GroupRunner(solved_when_even)
    batch = StepFeed(runner, tasks, dynamic_plan(extra=40)).take(0)
    first = runner.asked[0][1]
    assert runner.asked[0][0] == "s0" and first == [t["id"] for t in sample_tasks(tasks, 0, 0, 4)]
    drawn = [i for _, ids in runner.asked for i in ids]
    assert len(drawn) == len(set(drawn)), "a task ran twice in one step"
    assert [label for label, _ in runner.asked[1:]] == [f"s0-more{k}" for k in range(1, len(runner.asked))]
    signal = {str(i) for i in drawn if i % 2}
    assert groups_with_signal(batch.episodes, 2) == signal and len(signal) >= 4  # enough, within 40 extra
    assert len(batch.episodes) == 2 * len(drawn)  # every draw's groups train, those without signal too (advantage 0)
    extra = 2 * (len(drawn) - 4)
    assert batch.metrics == {"rollouts/requested": 8.0, "rollouts/succeeded": 8.0, "accuracy": 0.5,  # first draw
                             "sampling/draws": float(len(runner.asked) - 1), "sampling/extra_rollouts": extra,
                             "sampling/extra_succeeded": extra, "sampling/groups_with_signal": float(len(signal)),
                             "time/rollout": batch.metrics["time/rollout"]}
    # seed 0, step 0 draws tasks 37, 36, 6, 16: one odd task, one group with signal of the 4 run; 3 more groups
    # needed at that share take 3 * 4 / 1 = 12 tasks (24 rollouts, within the 40), which hold 8 odd ones
    assert first == [37, 36, 6, 16] and [len(ids) for _, ids in runner.asked] == [4, 12] and len(signal) == 9
    again = GroupRunner(solved_when_even)
    StepFeed(again, tasks, dynamic_plan(extra=40)).take(0)
    assert again.asked == runner.asked  # the same draws for the same seed and step, as after --resume


def test_the_extra_draws_stop_at_the_budget():
    tasks = [{"id": i} for i in range(40)]
    runner = GroupRunner(lambda task, g: 1.0)  # every group solved: no signal anywhere
    batch = StepFeed(runner, tasks, dynamic_plan(extra=10)).take(0)
    # without any signal the first extra draw takes all the budget affords: 10 rollouts = 5 groups of 2
    assert [len(ids) for _, ids in runner.asked] == [4, 5]
    assert batch.metrics["sampling/extra_rollouts"] == 10 and batch.metrics["sampling/groups_with_signal"] == 0


def test_the_extra_draws_stop_when_every_task_has_run():
    tasks = [{"id": i} for i in range(6)]
    runner = GroupRunner(lambda task, g: 1.0)
    StepFeed(runner, tasks, dynamic_plan(extra=100)).take(0)
    assert sorted(i for _, ids in runner.asked for i in ids) == list(range(6))


def test_a_step_whose_rollouts_all_failed_draws_no_more():
    runner = GroupRunner(solved_when_even, failing=True)
    batch = StepFeed(runner, [{"id": i} for i in range(40)], dynamic_plan(extra=40)).take(0)
    assert len(runner.asked) == 1 and batch.nothing_to_train().startswith("all 8 rollouts failed")
    assert "sampling/draws" not in batch.metrics


def test_a_step_with_enough_signal_draws_no_more():
    runner = GroupRunner(lambda task, g: float(g % 2))  # every group differs
    batch = StepFeed(runner, [{"id": i} for i in range(40)], dynamic_plan(extra=40)).take(0)
    assert len(runner.asked) == 1
    assert batch.metrics["sampling/draws"] == 0 and batch.metrics["sampling/groups_with_signal"] == 4


# The curriculum (rollouts.rest_after): a category solved by every rollout of its groups sits out the next steps.

def test_a_resting_category_is_not_drawn_by_the_step_nor_by_its_extra_draws():
    tasks = [{"id": i, "op": "even" if i % 2 == 0 else "odd"} for i in range(40)]
    runner = GroupRunner(solved_when_even)
    curriculum = Curriculum(RolloutsConfig(rest_by="op", rest_after=1, rest_steps=5), success_reward=1.0)
    feed = StepFeed(runner, tasks, dynamic_plan(extra=40), curriculum)
    first = feed.take(0)
    assert first.metrics["curriculum/resting"] == 0 and curriculum.resting(1) == {"even"}
    runner.asked.clear()
    second = feed.take(1)
    drawn = [i for _, ids in runner.asked for i in ids]
    assert drawn and all(i % 2 for i in drawn), drawn  # odd tasks only: every group has signal, no extra draw
    assert second.metrics["curriculum/resting"] == 1 and second.metrics["curriculum/resting_tasks"] == 20
    assert second.metrics["sampling/draws"] == 0


OPS = [{"id": f"t{i}", "op": "add" if i < 3 else "div"} for i in range(6)]


def test_groups_come_in_the_order_of_the_training_tasks_whatever_order_the_episodes_ended_in():
    episodes = [Episode(f"r{k}", task, 1, [], value, value)
                for k, (task, value) in enumerate([("t3", 1.0), ("t0", 0.0), ("t3", 1.0), ("t0", 1.0)])]
    assert groups_in_order(OPS, episodes) == [(OPS[0], [0.0, 1.0]), (OPS[3], [1.0, 1.0])]


def test_a_loop_leaving_on_an_error_ends_the_rollouts_running_ahead_before_the_services_stop(tmp_path: Path):
    """Hole: the loop left on an error (a failed sync check, a CUDA out-of-memory, Ctrl-C) with the next step's
    rollouts still running ahead in their thread, which went on polling the dispatcher's socket while the services
    closed it (a ZeroMQ socket is not for two threads) and could start vLLM again after the fleet stopped. Now
    the feed, leaving on an error, ends them (their attempts fail in the store) and waits for its thread."""
    from waiting import wait_until

    from lit_trainer.intake.rows import RolloutStatus

    with real_runner(tmp_path, "rollout_agents:hangs", "abort") as (store, runner):
        with pytest.raises(MemoryError, match="the update ran out"):
            with StepFeed(runner, TASKS, plan(1)) as feed:
                feed.finished[0] = RolloutBatch([], {}, 0)  # step 0 ran ahead before; step 1's start now
                feed.take(0)
                _, ahead = feed.ahead
                wait_until(lambda: store.rollouts_of_step(1), "step 1's rollouts handed out")
                raise MemoryError("the update ran out of memory")
        assert ahead.done() and isinstance(ahead.exception(), RuntimeError)  # ended, not left polling
        assert "the run is stopping" in str(ahead.exception())
        rows = store.rollouts_of_step(1)
        assert rows and all(r.status is RolloutStatus.FAILED and "the run is stopping" in r.error for r in rows)


def test_a_validation_with_failed_rollouts_says_why_the_first_failed(tmp_path: Path, capsys):
    """Hole: a validation whose rollouts failed printed only their count ('accuracy 0.000 on 64 held-out tasks
    (failed 64 ...)'), and the cause (a corpus the agent could not read, say) was in the store alone."""
    from lit_trainer.run.evaluation import validate

    class Log:
        def log(self, step, metrics, kind="train"):
            assert kind == "validation"

    with real_runner(tmp_path, "rollout_agents:raises", "val") as (_, runner):
        metrics = validate(runner, [{"id": "v0"}], Log(), step=0, minutes=0.0)
    assert metrics["rollouts/failed"] == 1
    out, err = capsys.readouterr()
    assert "accuracy 0.000 on 1 held-out tasks (failed 1" in out
    assert "lit: the first held-out rollout that failed: attempt 2: RuntimeError: agent bug on purpose" in err, err
