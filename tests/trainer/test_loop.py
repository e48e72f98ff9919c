"""The training loop's answer to vLLM dying during a step's rollouts (``loop.step_rollouts``): start it again, push
the current weights, run the step's rollouts again; at most ``MAX_ENGINE_RESTARTS`` times a step, then stop loudly.
The services and the weight sync are stand-ins that record what the loop asks of them (the real ones, with a real
vLLM killed mid-step, are in tests/e2e/test_chaos.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lit_trainer import loop
from lit_trainer.engine.server import ServerDiedError


class DyingServices:
    """``rollouts`` raises ServerDiedError ``deaths`` times, then returns one episode list."""

    def __init__(self, deaths: int):
        self.deaths, self.calls, self.restarts = deaths, [], 0
        self.server = SimpleNamespace(base_url="http://127.0.0.1:1/v1")

    def rollouts(self, tasks, group, temperature, step, label):
        self.calls.append(label)
        if len(self.calls) <= self.deaths:
            raise ServerDiedError("vLLM exited with code -9: killed\nlast lines of the log")
        return ["episode"], {"rollouts/succeeded": 1.0}

    def restart_server(self) -> None:
        self.restarts += 1


class RecordingSync:
    made: list[RecordingSync] = []

    def __init__(self, base_url, config):
        self.pushed, self.closed = [], False
        RecordingSync.made.append(self)

    def push_weights(self, state, version):
        self.pushed.append(version)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def cfg(monkeypatch):
    RecordingSync.made = []
    monkeypatch.setattr(loop, "WeightSync", RecordingSync)
    return SimpleNamespace(train=SimpleNamespace(group_size=2), agent=SimpleNamespace(temperature=1.0),
                           weight_sync=None)


POLICY = SimpleNamespace(state_dict=lambda: {"w": 1})


def test_vllm_dying_twice_is_restarted_twice_with_the_current_weights(cfg):
    svc, first = DyingServices(deaths=2), RecordingSync("", None)
    episodes, metrics, sync = loop.step_rollouts(svc, first, POLICY, [{"id": 0}], cfg, step=4)
    assert episodes == ["episode"] and metrics["engine/restarts"] == 2.0
    assert svc.calls == ["s4", "s4-restart1", "s4-restart2"] and svc.restarts == 2
    assert first.closed and RecordingSync.made[1].closed and sync is RecordingSync.made[2] and not sync.closed
    assert [s.pushed for s in RecordingSync.made] == [[], ["4"], ["4"]]  # the weights trained so far, each time


def test_vllm_dying_a_fourth_time_in_one_step_stops_the_run(cfg):
    svc = DyingServices(deaths=loop.MAX_ENGINE_RESTARTS + 1)
    with pytest.raises(ServerDiedError, match="exited with code -9"):
        loop.step_rollouts(svc, RecordingSync("", None), POLICY, [{"id": 0}], cfg, step=0)
    assert loop.MAX_ENGINE_RESTARTS == 3 and svc.restarts == 3 and len(svc.calls) == 4
