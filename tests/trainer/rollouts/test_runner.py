"""``RolloutRunner``: every rollout of one task goes to one vLLM server, a new group to the least loaded
(``pick_server``), every server and the collector are checked while rollouts run, a server's death during the
rollouts restarts it and runs them again at most ``restarts`` times, and the batch says the weight version its
oldest rollouts were handed out with. The fleet, the collector and the dispatcher are stand-ins that record what
they are asked (real servers and workers: the ``lora_kl`` run of tests/e2e/test_train_options.py, which checks in
each vLLM's log which calls it served; a vLLM killed during the rollouts: tests/e2e/test_chaos.py; how the fleet
restarts a server: tests/trainer/engine/test_fleet.py)."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest

from lit_sdk.resources import LLM
from lit_trainer.engine.server import ServerDiedError
from lit_trainer.intake.episodes import Episode
from lit_trainer.intake.rows import RolloutStatus
from lit_trainer.rollouts.attempts import Outcome, RolloutRequest, pick_server
from lit_trainer.rollouts.runner import AgentConfig, RolloutRunner


def test_a_group_keeps_its_server_and_a_new_group_takes_the_least_loaded():
    a, b, c = "http://a/v1", "http://b/v1", "http://c/v1"
    given: dict = {}
    running = collections.Counter({a: 3, b: 1, c: 1})
    assert pick_server((0, "t1"), [a, b, c], given, running) == b  # fewest running; b before c in order
    running[b] += 5
    assert pick_server((0, "t1"), [a, b, c], given, running) == b  # kept while b serves (its prefix cache)
    assert pick_server((0, "t2"), [a, b, c], given, running) == c
    assert pick_server((0, "t1"), [a, c], given, running) == c  # b dropped: t1 moves to the least loaded
    assert given == {(0, "t1"): c, (0, "t2"): c}
    assert pick_server((1, "t1"), [a], given, running) == a  # another step's group of the same task: its own


class Server:
    """A stand-in for one vLLM server: its port, its URL, and whether it is dead."""

    def __init__(self, port: int):
        self.port, self.dead = port, False

    def llm(self, temperature: float, max_tokens: int | None) -> LLM:
        return LLM(f"http://127.0.0.1:{self.port}/v1", "policy", temperature=temperature, max_tokens=max_tokens)


class Fleet:
    """A stand-in for the vLLM fleet: its servers, a server that can be dead, and the restarts asked."""

    def __init__(self, servers: int):
        self.servers = [Server(8000 + i) for i in range(servers)]
        self.restarts, self.restarted = 0, []

    @property
    def serving(self) -> list[Server]:
        return self.servers

    def check(self) -> None:
        for server in self.servers:
            if server.dead:
                raise ServerDiedError(f"vLLM on port {server.port} exited with code -9")

    def drop_silent_remotes(self, when: str) -> bool:
        return False  # no remote server here

    def restart(self, when: str, restarts_seen: int | None = None) -> None:
        self.restarted.append((when, restarts_seen))
        self.restarts += 1


class Dispatcher:
    """A stand-in for the dispatcher: records the requests and fails them all (no store needed); its first
    ``deaths`` runs raise as a vLLM that died would; ``carried`` come back first, as the dispatcher's do."""

    gateway = None  # no gateway in front of the servers: nothing to settle

    def __init__(self, deaths: int = 0, carried: list[RolloutRequest] = ()):
        self.requests, self.carried, self.runs, self.deaths = [], list(carried), 0, deaths

    def run(self, requests, progress, check, enough=None):
        check()
        self.runs += 1
        if self.runs <= self.deaths:
            raise ServerDiedError("vLLM exited with code -9: killed\nlast lines of the log")
        self.requests += requests
        returned, self.carried = self.carried + list(requests), []
        return [Outcome(r, RolloutStatus.FAILED, f"{r.key}-a1", 1) for r in returned]


def runner(servers: int = 1, dispatcher: Dispatcher | None = None) -> RolloutRunner:
    return RolloutRunner(None, SimpleNamespace(check=lambda: None), Fleet(servers), dispatcher or Dispatcher(),
                         AgentConfig(max_tokens=16), success_reward=1.0, session="sess")


def test_every_rollout_asks_for_a_server_of_the_fleet_chosen_when_it_is_handed_out():
    run = runner(servers=2)
    tasks = [{"id": i} for i in range(5)]
    batch = run.run(tasks, group=4, temperature=0.7, step=3, label="s3", version=3)
    assert batch.metrics["rollouts/requested"] == 20 and batch.metrics["rollouts/failed"] == 20
    assert batch.episodes == [] and batch.dispatched_version == 3
    for request in run.dispatcher.requests:  # the dispatcher picks each group's server (pick_server)
        assert request.balanced and request.llm.base_url == "http://127.0.0.1:8000/v1"
        assert request.llm.temperature == 0.7 and request.llm.max_tokens == 16 and request.llm.api_key == "EMPTY"
        assert request.step == 3 and request.version == 3 and request.key.startswith("sess-s3-t")
    teacher = LLM("http://teacher/v1", "big")
    run.run(tasks[:1], group=2, temperature=0.7, step=4, label="s4", version=3, llm=teacher)
    assert [(r.llm, r.balanced) for r in run.dispatcher.requests[-2:]] == [(teacher, False)] * 2


def test_a_dead_server_among_several_stops_the_rollouts():
    run = runner(servers=3)
    run.fleet.servers[2].dead = True
    with pytest.raises(ServerDiedError, match="port 8002"):
        run.run([{"id": 0}], group=2, temperature=1.0, step=0, label="s0", version=0)
    assert run.fleet.restarted == []  # restarts=0 (validation): the error goes up


def test_vllm_dying_twice_in_the_rollouts_is_restarted_twice_and_they_run_again(capsys):
    run = runner(dispatcher=Dispatcher(deaths=2))
    batch = run.run([{"id": 0}], group=2, temperature=1.0, step=4, label="s4", version=4, restarts=3)
    assert batch.metrics["rollouts/requested"] == 2 and run.dispatcher.runs == 3
    assert [r.key for r in run.dispatcher.requests] == ["sess-s4-restart2-t0-g0", "sess-s4-restart2-t0-g1"]
    assert run.fleet.restarted == [
        ("during the rollouts of step 5 (vLLM exited with code -9: killed); the step's rollouts run again", 0),
        ("during the rollouts of step 5 (vLLM exited with code -9: killed); the step's rollouts run again", 1)]


def test_vllm_dying_once_more_than_allowed_stops_the_run():
    run = runner(dispatcher=Dispatcher(deaths=4))
    with pytest.raises(ServerDiedError, match="exited with code -9"):
        run.run([{"id": 0}], group=2, temperature=1.0, step=0, label="s0", version=0, restarts=3)
    assert len(run.fleet.restarted) == 3 and run.dispatcher.runs == 4


def test_groups_carried_over_make_the_batch_as_old_as_their_dispatch():
    llm = SimpleNamespace(base_url="http://127.0.0.1:8000/v1")
    older = [RolloutRequest(f"sess-s1-t9-g{g}", "9", {"id": 9}, llm, step=1, version=0) for g in range(2)]
    run = runner(dispatcher=Dispatcher(carried=older))
    batch = run.run([{"id": 0}], group=2, temperature=1.0, step=2, label="s2", version=1, enough=lambda n: False)
    assert batch.metrics["rollouts/requested"] == 4 and batch.dispatched_version == 0
    assert batch.metrics["rollouts/carried_groups"] == 1 and batch.metrics["rollouts/groups_in_flight"] == 0


def test_a_batch_with_nothing_to_train_on_says_why_with_the_first_of_each_cause():
    from lit_trainer.rollouts.runner import RolloutBatch

    failed = RolloutBatch([], {"rollouts/requested": 4.0, "rollouts/succeeded": 0.0}, 0,
                          ["RuntimeError: agent bug", "timed_out"])
    assert failed.nothing_to_train() == "all 4 rollouts failed; the first: RuntimeError: agent bug"
    unusable = {"no_reward": "the rollout gave no reward (the first: rollout r2)",
                "no_llm_calls": "no LLM call (the first: rollout r3: its LLM calls are by other agents: 'calc' x1)"}
    mixed = RolloutBatch([], {"rollouts/requested": 4.0, "rollouts/succeeded": 3.0, "rollouts/unusable_no_reward": 1.0,
                              "rollouts/unusable_no_llm_calls": 2.0}, 0, ["RuntimeError: agent bug"], unusable)
    assert mixed.nothing_to_train() == (
        "none of the 4 rollouts gave an episode to train on: 1 gave no episode: the rollout gave no reward (the "
        "first: rollout r2); 2 gave no episode: no LLM call (the first: rollout r3: its LLM calls are by other "
        "agents: 'calc' x1); 1 failed; the first: RuntimeError: agent bug")
    one_episode = RolloutBatch([Episode("r4", "t", 1, [], 1.0, 1.0)], mixed.metrics, 0, ["x"], unusable)
    assert one_episode.nothing_to_train() is None  # something to train on: the step goes on
    assert RolloutBatch([], {"rollouts/requested": 0.0, "rollouts/succeeded": 0.0}, 0).nothing_to_train() is None
