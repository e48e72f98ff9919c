"""The training loop's answer to vLLM dying (``serving.Engine`` and ``loop.step_rollouts``): during a step's rollouts,
start it again, push the current weights, run the step's rollouts again, at most ``MAX_ENGINE_RESTARTS`` times a
step, then stop loudly; during the update or the weight sync, start it again with the new weights. An error of a
server that is still running is no death: it stops the run. The services and the weight sync are stand-ins that
record what the loop asks of them (the real ones, with a real vLLM killed mid-step, are in tests/e2e/test_chaos.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lit_trainer import loop, serving
from lit_trainer.engine.server import ServerDiedError
from lit_trainer.engine.weight_sync import WeightSyncError


class Server:
    """A stand-in for ``InferenceServer``: dead (its process exited) or alive."""

    def __init__(self, n: int, dead: bool = False):
        self.base_url, self.dead = f"http://127.0.0.1:{n}", dead

    def check_alive(self) -> None:
        if self.dead:
            raise ServerDiedError("vLLM exited with code -9: killed\nlast lines of the log")

    def exited(self, within_s: float = 0.0) -> bool:
        return self.dead


class DyingServices:
    """``rollouts`` raises ServerDiedError ``deaths`` times, then returns one episode list."""

    def __init__(self, deaths: int = 0):
        self.deaths, self.calls, self.restarts = deaths, [], 0
        self.server = Server(1)

    def rollouts(self, tasks, group, temperature, step, label, enough=None):
        self.calls.append(label)
        if len(self.calls) <= self.deaths:
            raise ServerDiedError("vLLM exited with code -9: killed\nlast lines of the log")
        return ["episode"], {"rollouts/succeeded": 1.0}

    @property
    def servers(self) -> list[Server]:
        return [self.server]

    def restart_server(self, index: int = 0) -> None:
        assert index == 0
        self.restarts += 1
        self.server = Server(1 + self.restarts)


class RecordingSync:
    """A stand-in for ``WeightSync``; ``fail`` makes its next push raise it."""

    made: list[RecordingSync] = []

    def __init__(self, base_url, config):
        self.base_url, self.pushed, self.closed, self.fail = base_url, [], False, None
        RecordingSync.made.append(self)

    def push_weights(self, state, version):
        if self.fail is not None:
            raise self.fail
        self.pushed.append(version)
        return SimpleNamespace(total_s=0.5)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def cfg(monkeypatch):
    RecordingSync.made = []
    monkeypatch.setattr(serving, "WeightSync", RecordingSync)
    return SimpleNamespace(train=SimpleNamespace(group_size=2), agent=SimpleNamespace(temperature=1.0),
                           weight_sync=None)


POLICY = SimpleNamespace(state_dict=lambda: {"w": 1})


def test_vllm_dying_twice_in_the_rollouts_is_restarted_twice_with_the_current_weights(cfg, capsys):
    svc = DyingServices(deaths=2)
    engine = serving.Engine(svc, POLICY, cfg)
    engine.version = "4"  # the servers hold the weights of 4 updates
    episodes, metrics = loop.step_rollouts(svc, engine, [{"id": 0}], cfg, step=4)
    assert episodes == ["episode"] and engine.restarts == 2
    assert svc.calls == ["s4", "s4-restart1", "s4-restart2"] and svc.restarts == 2
    first, second, third = RecordingSync.made
    assert first.closed and second.closed and engine.sync is third and not third.closed
    assert [s.pushed for s in RecordingSync.made] == [[], ["4"], ["4"]]  # the weights trained so far, each time
    assert third.base_url == "http://127.0.0.1:3"  # the sync talks to the new server
    assert "vLLM died during the rollouts of step 5" in capsys.readouterr().err


def test_vllm_dying_a_fourth_time_in_one_step_stops_the_run(cfg):
    svc = DyingServices(deaths=loop.MAX_ENGINE_RESTARTS + 1)
    engine = serving.Engine(svc, POLICY, cfg)
    with pytest.raises(ServerDiedError, match="exited with code -9"):
        loop.step_rollouts(svc, engine, [{"id": 0}], cfg, step=0)
    assert loop.MAX_ENGINE_RESTARTS == 3 and svc.restarts == 3 and len(svc.calls) == 4


def test_vllm_that_died_during_the_update_is_started_again_with_the_new_weights(cfg, capsys):
    svc = DyingServices()
    engine = serving.Engine(svc, POLICY, cfg)
    svc.server.dead = True  # killed while the policy was updating: the sync finds it gone
    assert engine.push_weights({"w": 2}, version="3") is None
    assert svc.restarts == 1 and engine.restarts == 1
    assert [s.pushed for s in RecordingSync.made] == [[], ["3"]] and RecordingSync.made[0].closed
    assert engine.base_url == "http://127.0.0.1:2"
    assert "vLLM died before the weights of step 3 reached it" in capsys.readouterr().err


def test_vllm_dying_during_the_push_is_started_again(cfg):
    svc = DyingServices()
    engine = serving.Engine(svc, POLICY, cfg)
    engine.sync.fail = WeightSyncError("cannot reach vLLM at http://127.0.0.1:1 for /pause: is the server running?")
    svc.server.dead = True
    assert engine.push_weights({"w": 2}, version="3") is None
    assert svc.restarts == 1 and RecordingSync.made[1].pushed == ["3"]


def test_a_sync_error_of_a_running_vllm_stops_the_run(cfg):
    svc = DyingServices()
    engine = serving.Engine(svc, POLICY, cfg)
    engine.sync.fail = WeightSyncError("vLLM has no route /pause: start it with VLLM_SERVER_DEV_MODE=1")
    with pytest.raises(WeightSyncError, match="no route /pause"):
        engine.push_weights({"w": 2}, version="3")
    assert svc.restarts == 0 and engine.restarts == 0


def test_a_live_push_returns_the_report(cfg):
    svc = DyingServices()
    engine = serving.Engine(svc, POLICY, cfg)
    assert engine.push_weights({"w": 2}, version="1").total_s == 0.5 and engine.restarts == 0
