"""Real worker processes, a real ZeroMQ dispatcher and collector, a real SQLite store: rollouts that succeed,
raise, hang, or take their worker down. The agents (rollout_agents.py) make no LLM call."""

import math
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lit_sdk import semconv as sc
from lit_sdk.protocol import STATUS_ERROR, STATUS_OK, SpanRecord
from lit_sdk.resources import LLM
from lit_sdk.worker import spawn
from lit_trainer.intake.collector import Collector
from lit_trainer.intake.gateway.server import Gateway
from lit_trainer.intake.rows import RolloutStatus
from lit_trainer.intake.store import SqliteStore
from lit_trainer.rollouts.attempts import Outcome, RolloutRequest
from lit_trainer.rollouts.dispatcher import DispatchConfig, Dispatcher, DispatchError
from lit_trainer.rollouts.gather import gather_episodes
from lit_trainer.run.evaluation import accuracy_line
from lit_trainer.run.services import stop_workers

TESTS = Path(__file__).parents[2]
NO_LLM = LLM("http://127.0.0.1:9/v1", "none")


@pytest.fixture
def rig(tmp_path):
    """Start a store, collector and dispatcher; ``rig(target, n_workers, **config)`` starts workers."""
    made = []

    def start(target: str, workers: int = 1, concurrency: int = 4, gateway: bool = False, **config):
        store = SqliteStore(tmp_path / "lit.sqlite")
        collector = Collector(store, "tcp://127.0.0.1:0", open_to_local_users=True).start()
        gateway = Gateway(store, [NO_LLM.base_url]).start() if gateway else None
        dispatcher = Dispatcher(store, "tcp://127.0.0.1:0", collector.endpoint, [NO_LLM.base_url],
                                DispatchConfig(**config), gateway=gateway, open_to_local_users=True)
        env = {**os.environ, "PYTHONPATH": str(TESTS), "LIT_SPOOL_DIR": str(tmp_path / "spool")}
        procs = [spawn(f"rollout_agents:{target}", dispatcher.endpoint, concurrency, env) for _ in range(workers)]
        made.append((store, collector, dispatcher, procs, gateway))
        if workers:
            dispatcher.wait_for_workers(workers, timeout_s=60)
        return store, dispatcher, procs

    yield start
    for store, collector, dispatcher, procs, gateway in made:
        stop_workers(dispatcher, procs)
        collector.stop()
        if gateway is not None:
            gateway.stop()
        store.close()


def requests(n: int, step: int = 0) -> list[RolloutRequest]:
    return [RolloutRequest(f"r{i}", f"task{i % 3}", {"id": i, "value": i / 10}, NO_LLM, step) for i in range(n)]


def test_rollouts_spread_over_workers_and_their_spans_are_stored_first(rig):
    store, dispatcher, _ = rig("returns_task_value", workers=2, concurrency=3)
    outcomes = dispatcher.run(requests(12))
    assert [o.status for o in outcomes] == [RolloutStatus.SUCCEEDED] * 12
    assert [o.reward for o in outcomes] == [i / 10 for i in range(12)]
    assert [o.rollout_id for o in outcomes] == [f"r{i}-a1" for i in range(12)]
    rows = store.rollouts_of_step(0)
    assert len(rows) == 12 and {r.status for r in rows} == {RolloutStatus.SUCCEEDED}
    assert all(r.started_at and r.ended_at for r in rows)
    # The worker flushed before reporting: every root span is in the store when "done" arrives.
    episodes, metrics, why = gather_episodes(store, outcomes, (), 1.0)
    assert episodes == []  # no LLM call: reported as unusable, never an episode with reward 0
    assert metrics["rollouts/unusable_no_llm_calls"] == 12 and metrics["rollouts/failed"] == 0
    assert why == {"no_llm_calls": "no LLM call of the selected agents carries token ids (the first: rollout "
                                   "r0-a1: the rollout made no LLM call that lit recorded (lit.instrument() off, or "
                                   "the engine not called))"}


def test_each_group_goes_to_the_least_loaded_server_when_it_is_handed_out(rig):
    """Balanced requests: a group's rollouts all call one server, and a server that ends its rollouts sooner gets
    more groups (round-robin would give each 6); a server that stops serving gets no new group."""
    slow, fast = "http://slow:8000/v1", "http://fast:8000/v1"
    serving = [slow, fast]
    store, dispatcher, _ = rig("slower_on_a_slow_server", concurrency=4)
    dispatcher.serving = lambda: serving
    asked = [RolloutRequest(f"r{t}-{g}", f"t{t}", {}, LLM(fast, "policy"), 0, balanced=True)
             for t in range(12) for g in range(2)]
    outcomes = dispatcher.run(asked)
    on_slow = {o.request.task_id: o.reward for o in outcomes}
    assert all(on_slow[o.request.task_id] == o.reward for o in outcomes)  # a group stays on its server
    # The first group took the slow one (listed first, both idle); it gets another only when one of its rollouts
    # ends, every 2 s, while the fast one ends its own in 0.05 s plus the dispatch's round trips (a busy machine
    # slows those: 4 groups of 12 went to a 0.6 s slow server under CI's load)
    groups_on_slow = sum(on_slow.values())
    assert 1 <= groups_on_slow < 6, on_slow
    serving.remove(slow)
    outcomes = dispatcher.run([RolloutRequest(f"s{t}", f"u{t}", {}, LLM(fast, "policy"), 1, balanced=True)
                               for t in range(4)])
    assert [o.reward for o in outcomes] == [0.0] * 4


def test_an_ended_attempts_url_is_refused_at_the_gateway(rig):
    """The dispatcher tells lit's gateway when an attempt ends: the URL its agent used while it ran is refused
    afterwards (410), though the gateway admitted it before and would not ask the store again."""
    store, dispatcher, _ = rig("posts_a_reward_to_its_url", gateway=True)
    gateway = dispatcher.gateway
    [outcome] = dispatcher.run(requests(1))
    gateway.settle()
    assert outcome.status is RolloutStatus.SUCCEEDED and gateway.recorded == 1 and gateway.refused == {}
    url = gateway.rollout_url(NO_LLM.base_url, outcome.rollout_id, store.get_rollout(outcome.rollout_id).secret)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(url.removesuffix("/v1") + "/reward", b'{"value": 1}'))
    assert refused.value.code == 410 and gateway.refused == {"ended_rollout": 1}


def test_groups_not_ended_carry_over_to_the_next_run_still_running(rig):
    """``enough`` ends the wait once one group ended: the slow group goes on running on the worker meanwhile,
    and the next ``run`` returns it (first) with its own requests."""
    store, dispatcher, _ = rig("returns_after_its_seconds", concurrency=6)

    def request(key: str, task_id: str, seconds: float, step: int) -> RolloutRequest:
        return RolloutRequest(key, task_id, {"id": key, "value": seconds, "seconds": seconds}, NO_LLM, step)

    slow = [request(f"slow{g}", "slow", 1.5, 1) for g in range(2)]
    fast = [request(f"fast{g}", "fast", 0.05, 1) for g in range(2)]
    seen = []
    outcomes = dispatcher.run(slow + fast, enough=lambda groups: seen.append(groups) or groups >= 1)
    assert [o.request.key for o in outcomes] == ["fast0", "fast1"] and seen[-1] == 1
    assert all(o.status is RolloutStatus.SUCCEEDED for o in outcomes)
    assert dispatcher.carried == slow
    running = {r.rollout_id: r.status for r in store.rollouts_of_step(1)}
    assert running["slow0-a1"] is RolloutStatus.RUNNING and running["slow1-a1"] is RolloutStatus.RUNNING

    later = [request(f"next{g}", "next", 0.05, 2) for g in range(2)]
    progress = []
    outcomes = dispatcher.run(later, progress.append)
    assert [o.request.key for o in outcomes] == ["slow0", "slow1", "next0", "next1"]
    assert [o.reward for o in outcomes] == [1.5, 1.5, 0.05, 0.05] and len(progress) == 4
    assert dispatcher.carried == [] and outcomes[0].rollout_id == "slow0-a1"  # the same attempt, not a retry


def test_groups_carried_over_when_the_trainer_stops_end_failed_in_the_store(rig):
    store, dispatcher, _ = rig("hangs")
    held = [RolloutRequest("h0", "held", {"id": 0}, NO_LLM, 3)]
    assert dispatcher.run(held, enough=lambda groups: True) == []  # enough at once: nothing had ended
    assert dispatcher.carried == held
    dispatcher.close()
    [row] = store.rollouts_of_step(3)
    assert row.status is RolloutStatus.FAILED and "carried over to a step that did not come" in row.error


def test_an_agent_that_raises_is_retried_then_failed_never_reward_zero(rig):
    store, dispatcher, _ = rig("raises", max_attempts=2)
    [outcome] = dispatcher.run(requests(1))
    assert outcome.status is RolloutStatus.FAILED and outcome.attempts == 2 and outcome.reward is None
    assert all("agent bug on purpose" in e for e in outcome.errors) and len(outcome.errors) == 2
    rows = store.rollouts_of_step(0)
    assert [(r.rollout_id, r.attempt, r.status) for r in rows] == [
        ("r0-a1", 1, RolloutStatus.FAILED), ("r0-a2", 2, RolloutStatus.FAILED)]
    assert "RuntimeError: agent bug on purpose" in rows[0].error
    episodes, metrics, _ = gather_episodes(store, [outcome], (), 1.0)
    assert episodes == [] and metrics["rollouts/failed"] == 1 and metrics["accuracy"] == 0.0


def test_a_tool_that_raises_is_recorded_and_the_agent_goes_on(rig):
    store, dispatcher, _ = rig("tool_raises_and_agent_goes_on", max_attempts=2)
    outcomes = dispatcher.run(requests(2))
    assert [(o.status, o.attempts, o.reward) for o in outcomes] == [(RolloutStatus.SUCCEEDED, 1, 1.0)] * 2
    for outcome in outcomes:
        assert store.missing_spans(outcome.rollout_id) is None  # every span the rollout declared is stored
        [tool_span] = [s for s in store.spans_of_rollout(outcome.rollout_id) if s.name == "lookup"]
        assert tool_span.status == STATUS_ERROR and "the tool failed on purpose" in tool_span.status_message


def test_a_tool_error_the_agent_does_not_catch_fails_the_rollout(rig):
    store, dispatcher, _ = rig("tool_raises_through_the_agent", max_attempts=2)
    [outcome] = dispatcher.run(requests(1))
    assert outcome.status is RolloutStatus.FAILED and outcome.attempts == 2 and outcome.reward is None
    assert all("LookupError: the tool failed on purpose" in e for e in outcome.errors)


def test_a_retry_that_succeeds_wins(rig):
    store, dispatcher, _ = rig("fails_first_attempt", max_attempts=3)
    [outcome] = dispatcher.run(requests(1))
    assert outcome.status is RolloutStatus.SUCCEEDED and outcome.attempts == 2 and outcome.reward == 1.0
    assert "ConnectionError" in outcome.errors[0]
    assert [r.status for r in store.rollouts_of_step(0)] == [RolloutStatus.FAILED, RolloutStatus.SUCCEEDED]


def test_a_hanging_rollout_times_out(rig):
    store, dispatcher, _ = rig("hangs", max_attempts=2, rollout_timeout_s=1.0)
    [outcome] = dispatcher.run(requests(1))
    assert outcome.status is RolloutStatus.TIMED_OUT and outcome.attempts == 2
    assert [r.status for r in store.rollouts_of_step(0)] == [RolloutStatus.TIMED_OUT] * 2


def test_a_worker_keeps_its_place_while_it_instruments(rig, monkeypatch):
    """A worker sets up lit.instrument() when the trainer welcomes it: about 3 s of imports on a free core, more on a
    busy one, and a worker that sent no heartbeat meanwhile was taken for dead (on CI, 2026-11-29, with
    worker_timeout_s = 5 s). Stretched here by 6 s, twice worker_timeout_s: the heartbeats go on, the rollout sent
    meanwhile waits for it, runs once and is traced."""
    monkeypatch.setenv("LIT_TEST_INSTRUMENT_DELAY_S", "6")
    store, dispatcher, _ = rig("returns_task_value", max_attempts=1, worker_timeout_s=3.0)
    [outcome] = dispatcher.run(requests(1))
    assert (outcome.status, outcome.attempts, outcome.errors) == (RolloutStatus.SUCCEEDED, 1, [])
    assert len(dispatcher.workers) == 1 and store.missing_spans(outcome.rollout_id) is None


def test_a_worker_killed_mid_rollout_leads_to_a_retry_then_failed(rig):
    # worker_timeout_s leaves a busy machine slack: a live worker taken for dead would be served the retry itself
    store, dispatcher, procs = rig("kills_its_worker", workers=2, max_attempts=2, worker_timeout_s=5.0)
    [outcome] = dispatcher.run(requests(1))
    assert outcome.status is RolloutStatus.FAILED and outcome.attempts == 2 and outcome.reward is None
    assert all("died or went silent" in e for e in outcome.errors)
    assert [p.wait(10) for p in procs] == [-9, -9]  # each attempt took one worker down
    assert not dispatcher.workers
    episodes, metrics, _ = gather_episodes(store, [outcome], (), 1.0)
    assert episodes == [] and metrics["rollouts/failed"] == 1


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_a_worker_stopped_mid_rollout_hands_it_back_and_another_runs_it_at_once(rig, stop):
    """Ctrl-C or SIGTERM on a worker (a container's stop, a scheduler's) used to leave its rollout to the trainer's
    worker_timeout_s (here 120 s) of silence before a retry; SIGTERM ended it on the spot. The worker now says
    ``bye`` as it stops: the trainer fails its rollout, hands it nothing more, and the retry runs on another
    worker at once."""
    store, dispatcher, procs = rig("returns_after_its_seconds", workers=1, max_attempts=2, worker_timeout_s=120.0)
    request = RolloutRequest("r0", "task0", {"id": 0, "value": 1.0, "seconds": 2.0}, NO_LLM, 0)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(dispatcher.run, [request])
        deadline = time.monotonic() + 60
        while [r.status for r in store.rollouts_of_step(0)] != [RolloutStatus.RUNNING]:
            assert time.monotonic() < deadline and not running.done(), "the rollout never started"
            time.sleep(0.05)
        procs[0].send_signal(stop)
        stopped_at = time.monotonic()
        assert procs[0].wait(30) == (130 if stop == signal.SIGINT else 143)
        procs.append(spawn("rollout_agents:returns_after_its_seconds", dispatcher.endpoint, 4,
                           {**os.environ, "PYTHONPATH": str(TESTS)}))
        [outcome] = running.result(timeout=90)
        waited = time.monotonic() - stopped_at
    why = "Ctrl-C" if stop == signal.SIGINT else "SIGTERM"
    stopped = f"worker {socket.gethostname()}:{procs[0].pid} stopped before it ended ({why})"
    assert (outcome.status, outcome.attempts, outcome.reward) == (RolloutStatus.SUCCEEDED, 2, 1.0)
    assert outcome.errors == [f"attempt 1: {stopped}"] and waited < 60, (outcome.errors, waited)
    assert [(r.status, r.error) for r in store.rollouts_of_step(0)] == [
        (RolloutStatus.FAILED, stopped), (RolloutStatus.SUCCEEDED, None)]
    print(f"retried and done {waited:.1f} s after the stop (worker_timeout_s 120)")


def test_a_worker_stopped_while_a_sync_agent_call_never_returns_exits_at_once(rig, tmp_path):
    """Python joins the agents' threads at exit, and one stuck in a call never ends: a stopped worker used to wait
    for it (until the trainer's grace ran out and SIGKILL came). It exits now, saying what it left running."""
    store, dispatcher, procs = rig("sync_hangs", workers=1, max_attempts=2, worker_timeout_s=120.0)
    mark = tmp_path / "in-the-call"
    request = RolloutRequest("r0", "task0", {"id": 0, "value": 1.0, "mark": str(mark)}, NO_LLM, 0)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(dispatcher.run, [request])
        deadline = time.monotonic() + 60
        while not mark.exists():
            assert time.monotonic() < deadline and not running.done(), "the agent's call never started"
            time.sleep(0.05)
        procs[0].send_signal(signal.SIGTERM)
        procs.append(spawn("rollout_agents:returns_task_value", dispatcher.endpoint, 4,
                           {**os.environ, "PYTHONPATH": str(TESTS)}))  # takes the retry: the dispatcher's run ends
        code = procs[0].wait(30)
        [outcome] = running.result(timeout=90)
    assert code == 143
    assert (outcome.status, outcome.attempts) == (RolloutStatus.SUCCEEDED, 2)  # handed back, then run elsewhere


def test_no_worker_is_a_clear_error(rig):
    _, dispatcher, _ = rig("returns_task_value", workers=0, no_worker_timeout_s=0.5)
    with pytest.raises(DispatchError, match="lit worker --connect"):
        dispatcher.run(requests(1))


def test_a_busy_dispatch_port_is_a_clear_error(rig, tmp_path):
    _, dispatcher, _ = rig("returns_task_value", workers=0)
    with pytest.raises(DispatchError, match="cannot listen for workers") as raised:
        Dispatcher(SqliteStore(tmp_path / "other.sqlite"), dispatcher.endpoint, "tcp://127.0.0.1:1", [],
                   open_to_local_users=True)
    assert "set dispatch_endpoint.endpoint to a free port" in str(raised.value)  # the key a config has


def test_a_bad_agent_target_is_named(tmp_path, monkeypatch):
    from lit_sdk.targets import load_agent, load_target

    with pytest.raises(ValueError, match="module:function"):
        load_target("no_colon")
    with pytest.raises(ValueError, match="cannot import the agent module"):
        load_target("no_such_module_xyz:fn")
    (tmp_path / "user_agents.py").write_text(
        "import functools\nimport lit_sdk as lit\n\n"
        "def plain(task, llm):\n    return 1.0\n\n"
        "@lit.trace\ndef one_argument(task):\n    return 1.0\n\n"
        "@lit.trace\nasync def good(task, llm):\n    return 1.0\n\n"
        "@functools.wraps(good)\nasync def wrapped(*args):\n    return await good(*args)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"user_agents:plain is not decorated with @lit.trace: .*Put @lit.trace on "
                                         r"the line above `def plain`"):
        load_agent("user_agents:plain")
    with pytest.raises(ValueError, match=r"must take \(task, llm\), as lit calls it; its signature is \(task\)"):
        load_agent("user_agents:one_argument")
    assert load_agent("user_agents:good").__name__ == "good"
    assert load_agent("user_agents:wrapped") is not None  # a wrapper of a traced function is traced


def rollout_spans(rollout_id: str, reward: float, task_id: str = "t") -> list[SpanRecord]:
    """A finished rollout of ``task_id`` (its first attempt): its root span returning ``reward`` and one LLM call
    with token ids."""
    attrs = {sc.ROLLOUT_ID: rollout_id, sc.TASK_ID: task_id, sc.ATTEMPT: 1}
    root = SpanRecord("ab" * 16, "1" * 16, None, sc.ROLLOUT_SPAN, 0, 100, STATUS_OK, "", rollout_id,
                      {**attrs, sc.ROLLOUT_RETURN_REWARD: reward})
    call = SpanRecord("ab" * 16, "2" * 16, root.span_id, sc.LLM_SPAN, 10, 20, STATUS_OK, "", rollout_id,
                      {**attrs, sc.LLM_PROMPT_TOKEN_IDS: [1, 2], sc.LLM_RESPONSE_TOKEN_IDS: [3],
                       sc.LLM_RESPONSE_LOGPROBS: [-0.5]})
    return [root, call]


def test_accuracy_and_reward_per_task_kind(tmp_path):
    """Hand-made outcomes: failed and unusable rollouts count as wrong in accuracy/<kind>; reward/<kind> averages
    the episodes of that kind; tasks without a (string) kind only count in the totals."""
    # (kind, status, episode return or None for a rollout that gives no episode)
    cases = [("in_template", RolloutStatus.SUCCEEDED, 1.0), ("in_template", RolloutStatus.SUCCEEDED, 0.0),
             ("in_template", RolloutStatus.FAILED, None), ("out_of_template", RolloutStatus.SUCCEEDED, 1.0),
             ("out_of_template", RolloutStatus.SUCCEEDED, None),  # succeeded, but no spans: unusable
             ("out_of_template", RolloutStatus.SUCCEEDED, 0.5), (None, RolloutStatus.SUCCEEDED, 1.0),
             (7, RolloutStatus.SUCCEEDED, 0.0), ("mean", RolloutStatus.TIMED_OUT, None)]  # fmt: skip
    with SqliteStore(tmp_path / "lit.sqlite") as store:
        outcomes = []
        for i, (kind, status, reward) in enumerate(cases):
            task = {"id": i, "question": "?"} | ({} if kind is None else {"kind": kind})
            if reward is not None:
                store.add_spans(rollout_spans(f"r{i}-a1", reward, str(i)))
            outcomes.append(Outcome(RolloutRequest(f"r{i}", str(i), task, NO_LLM, 0), status, f"r{i}-a1", 1))
        episodes, metrics, _ = gather_episodes(store, outcomes, (), 1.0)
    assert len(episodes) == 6 and metrics["rollouts/unusable"] == 1
    assert metrics["accuracy"] == 3 / 9 and metrics["reward/mean"] == 3.5 / 6
    assert metrics["accuracy/in_template"] == 1 / 3 and metrics["reward/in_template"] == 0.5
    assert metrics["accuracy/out_of_template"] == 1 / 3 and metrics["reward/out_of_template"] == 0.75
    assert metrics["accuracy/mean"] == 0.0  # a kind named "mean" leaves reward/mean alone
    assert not [k for k in metrics if k.endswith("/7")]  # a kind must be a string
    per_kind = {k: v for k, v in metrics.items() if k.startswith(("accuracy/", "reward/")) and k != "reward/mean"}
    assert list(per_kind) == ["accuracy/in_template", "reward/in_template", "accuracy/out_of_template",
                              "reward/out_of_template", "accuracy/mean"]
    assert accuracy_line(metrics) == "accuracy 0.333 (in_template 0.333, out_of_template 0.333, mean 0.000)"
    without_kinds = {k: v for k, v in metrics.items() if k not in per_kind}
    assert accuracy_line(without_kinds) == "accuracy 0.333"
    with SqliteStore(tmp_path / "other.sqlite") as store:
        _, plain, _ = gather_episodes(store, [], (), 1.0)
    assert math.isnan(plain["accuracy"]) and not [k for k in plain if k.startswith("accuracy/")]


def test_stopping_waits_for_the_workers_that_said_hello_and_ends_one_still_starting_at_once(
        rig, tmp_path, monkeypatch):
    """A run stopped while a local worker starts (not connected yet: it holds no rollout) used to wait the whole
    grace for it to leave on the trainer's word, which it never hears; it is ended at once now."""
    import lit_trainer.run.services as services

    _, dispatcher, [greeted] = rig("returns_task_value")
    env = {**os.environ, "PYTHONPATH": str(TESTS), "LIT_SPOOL_DIR": str(tmp_path / "spool")}
    starting = spawn("rollout_agents:returns_task_value", dispatcher.endpoint, 1, env)  # its hello is never read
    waited = []

    def wait_children(procs, timeout_s):
        waited.append([proc.pid for proc in procs])
        return real(procs, timeout_s)

    real = services.wait_children
    monkeypatch.setattr(services, "wait_children", wait_children)
    stop_workers(dispatcher, [greeted, starting])
    assert waited == [[greeted.pid]]
    assert greeted.returncode == 0 and starting.returncode is not None  # left on the trainer's word; ended
