"""Several vLLM servers in ``Services``: every rollout of one task goes to one server and the tasks are dealt
round-robin (``server_of``, ``Services.rollouts``), every server is checked while rollouts run, the servers are
launched before any is waited for (they load at once), and a dead one is started again alone on its port. The
servers and the dispatcher are stand-ins that record what they are asked (real servers and workers: the
``lora_kl`` run of tests/e2e/test_train_options.py, which checks in each vLLM's log which calls it served)."""

from __future__ import annotations

import collections
import contextlib
from types import SimpleNamespace

import pytest

from lit_trainer import services
from lit_trainer.engine.config import InferenceConfig
from lit_trainer.engine.server import ServerDiedError
from lit_trainer.intake.store import RolloutStatus
from lit_trainer.rollouts.dispatcher import Outcome
from lit_trainer.services import Services, server_of, start_servers


def test_tasks_are_dealt_round_robin_going_on_from_the_previous_step():
    assert [server_of(k, 2, 0, 2) for k in range(2)] == [0, 1]
    assert [server_of(k, 3, 0, 2) for k in range(3)] == [0, 1, 0]
    assert [server_of(k, 3, 1, 2) for k in range(3)] == [1, 0, 1]  # step 1 starts where step 0 stopped
    assert [server_of(0, 1, step, 2) for step in range(4)] == [0, 1, 0, 1]  # one task a step: both servers serve
    assert [server_of(k, 5, 2, 3) for k in range(5)] == [1, 2, 0, 1, 2]  # (2 * 5 + k) % 3
    assert {server_of(k, 7, 3, 1) for k in range(7)} == {0}


class Server:
    """A stand-in for ``InferenceServer``: its URLs, and dead or alive."""

    def __init__(self, config: InferenceConfig, index: int = 0):
        self.config, self.index, self.port, self.dead = config, index, config.port, False
        self.openai_url, self.model_name, self.api_key = f"http://127.0.0.1:{self.port}/v1", "policy", None
        self.calls: list[str] = []

    def check_alive(self) -> None:
        if self.dead:
            raise ServerDiedError(f"vLLM on port {self.port} exited with code -9")

    def stop(self) -> None:
        self.calls.append("stop")


class Dispatcher:
    """A stand-in for the dispatcher: records the requests and fails them all (no store needed)."""

    def __init__(self):
        self.requests, self.carried = [], []

    def run(self, requests, progress, check, enough=None):
        check()
        self.requests += requests
        return [Outcome(r, RolloutStatus.FAILED, f"{r.key}-a1", 1) for r in requests]


def make_services(n: int) -> Services:
    cfg = SimpleNamespace(agent=SimpleNamespace(max_tokens=16, agents=()), train=SimpleNamespace(success_reward=1.0),
                          inference=InferenceConfig(servers=n))
    servers = [Server(InferenceConfig(port=8000 + i), i) for i in range(n)]
    return Services(cfg, None, SimpleNamespace(check=lambda: None), servers, Dispatcher(), "sess",
                    contextlib.ExitStack())


def test_every_rollout_of_a_task_goes_to_one_server_and_the_tasks_are_spread():
    svc = make_services(2)
    tasks = [{"id": i} for i in range(5)]
    _, metrics = svc.rollouts(tasks, group=4, temperature=0.7, step=3, label="s3")
    assert metrics["rollouts/requested"] == 20
    urls_of = collections.defaultdict(set)
    for request in svc.dispatcher.requests:
        urls_of[request.task_id].add(request.llm.base_url)
        assert request.llm.temperature == 0.7 and request.llm.max_tokens == 16
    # (3 * 5 + k) % 2 for tasks k = 0..4: servers 1, 0, 1, 0, 1
    assert urls_of == {"0": {"http://127.0.0.1:8001/v1"}, "1": {"http://127.0.0.1:8000/v1"},
                       "2": {"http://127.0.0.1:8001/v1"}, "3": {"http://127.0.0.1:8000/v1"},
                       "4": {"http://127.0.0.1:8001/v1"}}


def test_a_dead_server_among_several_stops_the_rollouts():
    svc = make_services(3)
    svc.servers[2].dead = True
    with pytest.raises(ServerDiedError, match="port 8002"):
        svc.rollouts([{"id": 0}], group=2, temperature=1.0, step=0, label="s0")


def test_a_dead_server_is_started_again_alone_on_its_port(monkeypatch):
    started = []

    class Restarted(Server):
        def start(self):
            started.append((self.index, self.port))
            return self

    monkeypatch.setattr(services, "InferenceServer", Restarted)
    svc = make_services(2)
    first, dead = svc.servers
    svc.restart_server(1)
    assert dead.calls == ["stop"] and started == [(1, 8001)]  # the server's own index: its cores or GPUs
    assert svc.servers[0] is first and first.calls == [] and svc.servers[1].port == 8001


def test_servers_are_all_launched_before_any_is_waited_for(monkeypatch):
    events = []

    class Launched(Server):
        def launch(self):
            events.append(f"launch {self.index} on {self.port}")
            return self

        def wait_ready(self):
            events.append(f"ready {self.index}")
            return self

        def stop(self):
            events.append(f"stop {self.index}")

    monkeypatch.setattr(services, "InferenceServer", Launched)
    with contextlib.ExitStack() as stack:
        servers = start_servers(InferenceConfig(port=9000, servers=2), stack, "smollm2-135m")
        assert [s.index for s in servers] == [0, 1]
    assert events == ["launch 0 on 9000", "launch 1 on 9001", "ready 0", "ready 1", "stop 1", "stop 0"]
