"""Asynchronous rollouts (``train.max_staleness``): the next step's rollouts run in a background thread while this
step updates (``loop.Rollouts``), and calls sampled by weights more than ``max_staleness`` versions old are not
trained on (``schedule.drop_stale``). The services here are stand-ins that record when the loop asks for rollouts
(real vLLM and workers: the ``ppo_schedule`` run of tests/e2e/test_train_options.py trains with
``max_staleness = 1`` and checks the staleness of every call it trained on), except in the carry-over test, which
runs real worker processes, dispatcher, collector and store (``train.min_step_groups``)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from lit_trainer import loop
from lit_trainer.intake.episodes import Transition
from lit_trainer.learner.schedule import drop_stale


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


class RecordingServices:
    """A stand-in for ``Services``: ``rollouts`` records its step and thread, and takes ``seconds``."""

    def __init__(self, seconds: float = 0.0, fail_at: int | None = None):
        self.seconds, self.fail_at, self.calls = seconds, fail_at, []

    def rollouts(self, tasks, group, temperature, step, label, enough=None):
        self.calls.append((step, threading.current_thread().name, time.monotonic()))
        time.sleep(self.seconds)
        if step == self.fail_at:
            raise RuntimeError(f"the collector stopped during step {step}")
        return [f"episode of step {step}"], {"rollouts/succeeded": 1.0}


def config(max_staleness: int, steps: int = 3) -> SimpleNamespace:
    return SimpleNamespace(train=SimpleNamespace(max_staleness=max_staleness, steps=steps, seed=0, tasks_per_step=1,
                                                 group_size=2, min_step_groups=0),
                           agent=SimpleNamespace(temperature=1.0))


TASKS = [{"id": i} for i in range(4)]
ENGINE = SimpleNamespace(restarts=0)
"""A stand-in for ``serving.Engine`` that no server death reaches (the restart tests are in test_loop.py)."""


def test_synchronous_rollouts_run_when_the_step_asks_in_the_loop_thread():
    svc = RecordingServices()
    rollouts = loop.Rollouts(svc, ENGINE, config(0), TASKS)
    for step in range(3):
        episodes, _, dispatched = rollouts.take(step)
        assert episodes == [f"episode of step {step}"] and dispatched == step
    assert [(s, name) for s, name, _ in svc.calls] == [(s, threading.current_thread().name) for s in range(3)]
    rollouts.close()


def test_asynchronous_rollouts_of_the_next_step_run_during_this_steps_update():
    svc = RecordingServices(seconds=0.3)
    rollouts = loop.Rollouts(svc, ENGINE, config(1), TASKS)
    episodes, _, dispatched = rollouts.take(0)
    assert episodes == ["episode of step 0"] and dispatched == 0
    updating = time.monotonic()
    time.sleep(0.5)  # "the update of step 1": step 2's rollouts (index 1) run meanwhile, in the background
    started = svc.calls[1]
    assert started[0] == 1 and started[1].startswith("lit-rollouts") and started[2] < updating + 0.2
    t0 = time.monotonic()
    episodes, metrics, dispatched = rollouts.take(1)
    assert episodes == ["episode of step 1"] and time.monotonic() - t0 < 0.2  # finished during the "update"
    # handed out while the engine held the weights of 0 updates, trained on by the policy of 1: one version old
    assert dispatched == 0
    assert metrics["time/rollout"] < 0.2
    episodes, _, dispatched = rollouts.take(2)
    assert episodes == ["episode of step 2"] and dispatched == 1
    rollouts.close()
    assert [c[0] for c in svc.calls] == [0, 1, 2]  # nothing started past the last step


def test_rollouts_running_ahead_are_finished_before_validation_and_kept_for_their_step():
    svc = RecordingServices(seconds=0.2)
    rollouts = loop.Rollouts(svc, ENGINE, config(1), TASKS)
    rollouts.take(0)
    rollouts.finish_ahead()  # validation needs the workers to itself
    assert len(svc.calls) == 2 and rollouts.ahead is None
    episodes, _, dispatched = rollouts.take(1)
    assert episodes == ["episode of step 1"] and dispatched == 0
    rollouts.close()  # waits for step 2's, started by take(1)
    assert [c[0] for c in svc.calls] == [0, 1, 2]


def test_an_error_in_the_rollouts_running_ahead_stops_the_loop_when_it_takes_them():
    svc = RecordingServices(fail_at=1)
    rollouts = loop.Rollouts(svc, ENGINE, config(1), TASKS)
    rollouts.take(0)
    with pytest.raises(RuntimeError, match="collector stopped during step 1"):
        rollouts.take(1)
    rollouts.close()


class UnusedServer:
    """Stands in for the vLLM server: the address the agents are given, which ``returns_after_its_seconds`` never
    calls (real vLLM is in the ``ppo_schedule`` run of tests/e2e/test_train_options.py)."""

    openai_url, model_name, api_key = "http://127.0.0.1:9/v1", "none", None

    def check_alive(self) -> None:
        pass


def test_a_group_still_running_carries_over_to_the_next_step_instead_of_stalling_it(tmp_path):
    """Every step samples both tasks: task 0's rollouts take 4 s, task 1's 50 ms. Steps 1 and 2 (indices) each take
    their fast group as soon as it ended (``min_step_groups = 1``) and their slow groups carry over, running (step
    1's through two steps); step 3, the last, gets both back with its own two groups: the last step waits for every
    group, so that none is left over, and its episodes count from the oldest group's dispatch."""
    import contextlib
    import os
    from pathlib import Path

    from lit_sdk.worker import spawn
    from lit_trainer.config import from_dict
    from lit_trainer.intake.collector import Collector
    from lit_trainer.intake.store import RolloutStatus, SqliteStore
    from lit_trainer.rollouts.dispatcher import Dispatcher
    from lit_trainer.services import Services, stop_workers

    cfg = from_dict({"agent": {"function": "rollout_agents:returns_after_its_seconds"},
                     "train": {"steps": 4, "tasks_per_step": 2, "group_size": 2, "max_staleness": 1,
                               "min_step_groups": 1},
                     "update": {"recompute_old_logprobs": True}, "loss": {"is_correction": "truncate"}})
    tasks = [{"id": 0, "value": 1.0, "seconds": 4.0}, {"id": 1, "value": 0.0, "seconds": 0.05}]
    store = SqliteStore(tmp_path / "lit.sqlite")
    collector = Collector(store, "tcp://127.0.0.1:0").start()
    dispatcher = Dispatcher(store, "tcp://127.0.0.1:0", collector.endpoint, [UnusedServer.openai_url])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "LIT_SPOOL_DIR": str(tmp_path / "spool")}
    workers = [spawn(cfg.agent.function, dispatcher.endpoint, 8, env)]
    try:
        dispatcher.wait_for_workers(1, timeout_s=60)
        svc = Services(cfg, store, collector, [UnusedServer()], dispatcher, "carry", contextlib.ExitStack())
        rollouts = loop.Rollouts(svc, ENGINE, cfg, tasks)
        _, metrics, _ = rollouts.take(0)  # nothing runs ahead of the first step: it waits for both groups
        assert metrics["rollouts/requested"] == 4 and metrics["rollouts/groups_in_flight"] == 0
        _, metrics, dispatched = rollouts.take(1)  # at once: step 1's rollouts have only just started
        assert metrics["rollouts/requested"] == 2 and metrics["rollouts/succeeded"] == 2
        assert metrics["rollouts/carried_groups"] == 0 and metrics["rollouts/groups_in_flight"] == 1
        assert dispatched == 0
        _, metrics, dispatched = rollouts.take(2)  # at once again: step 1's slow group is still running too
        assert metrics["rollouts/requested"] == 2 and metrics["rollouts/carried_groups"] == 0
        assert metrics["rollouts/groups_in_flight"] == 2 and dispatched == 1
        _, metrics, dispatched = rollouts.take(3)
        assert metrics["rollouts/requested"] == 8 and metrics["rollouts/succeeded"] == 8
        assert metrics["rollouts/carried_groups"] == 2 and metrics["rollouts/groups_in_flight"] == 0
        assert dispatched == 0  # step 1's slow group was handed out at version 0
        assert dispatcher.carried == []
        rollouts.close()
        statuses = [(r.task_id, r.status) for r in store.rollouts_of_step(1)]
        assert sorted(statuses) == [("0", RolloutStatus.SUCCEEDED)] * 2 + [("1", RolloutStatus.SUCCEEDED)] * 2
    finally:
        stop_workers(dispatcher, workers)
        collector.stop()
        store.close()
