"""Several vLLM servers behind the loop (``serving.Engine``): every push reaches every server, a server that died
alone is started again with the current weights while the others are left alone, and the report covers them all.
The servers and the weight syncs are stand-ins that record what the engine asks of them (the real ones, two vLLM
servers trained and synced, are in the ``lora_kl`` run of tests/e2e/test_train_options.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lit_trainer import serving
from lit_trainer.engine.config import WeightSyncConfig
from lit_trainer.engine.server import ServerDiedError
from lit_trainer.engine.weight_sync import SyncReport, WeightSyncError


class Server:
    """A stand-in for ``InferenceServer`` on ``port``: dead (its process exited) or alive."""

    def __init__(self, port: int, dead: bool = False):
        self.port, self.dead = port, dead
        self.base_url = f"http://127.0.0.1:{port}"

    def check_alive(self) -> None:
        if self.dead:
            raise ServerDiedError("vLLM exited with code -9: killed")

    def exited(self, within_s: float = 0.0) -> bool:
        return self.dead


class TwoServers:
    """A stand-in for ``Services`` with two vLLM servers; ``restart_server`` records which it started again."""

    def __init__(self):
        self.servers = [Server(8000), Server(8001)]
        self.restarted: list[int] = []

    def restart_server(self, index: int) -> None:
        self.restarted.append(index)
        self.servers[index] = Server(self.servers[index].port)  # the same port, a new process


class RecordingSync:
    """A stand-in for ``WeightSync``: records the pushes; ``fail`` makes the next one raise it."""

    made: list[RecordingSync] = []

    def __init__(self, base_url, config):
        self.base_url, self.config, self.pushed, self.closed, self.fail = base_url, config, [], False, None
        RecordingSync.made.append(self)

    def push_weights(self, state, version):
        if self.fail is not None:
            raise self.fail
        self.pushed.append((version, state["w"]))
        return SyncReport(version, {"reload": 1.0 if self.base_url.endswith(":8001") else 0.5, "resume": 0.25})

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def engine(monkeypatch):
    RecordingSync.made = []
    monkeypatch.setattr(serving, "WeightSync", RecordingSync)
    policy = SimpleNamespace(state_dict=lambda: {"w": "current"})
    return serving.Engine(TwoServers(), policy, SimpleNamespace(weight_sync=WeightSyncConfig(nccl_master_port=29555)))


def test_a_push_reaches_every_server(engine):
    report = engine.push_weights({"w": "step 1"}, version="1")
    assert [(s.base_url, s.pushed) for s in engine.syncs] == [("http://127.0.0.1:8000", [("1", "step 1")]),
                                                             ("http://127.0.0.1:8001", [("1", "step 1")])]
    assert engine.base_urls == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert [s.config.nccl_master_port for s in engine.syncs] == [29555, 29556]  # a rendezvous port each
    # one after the other: the total is both syncs (0.75 s and 1.25 s), the slowest the second
    assert report.version == "1" and report.total_s == pytest.approx(2.0) and report.slowest_s == pytest.approx(1.25)
    assert [r.version for r in report.reports] == ["1", "1"] and engine.restarts == 0


def test_one_dead_server_of_two_is_restarted_alone_with_the_current_weights(engine, capsys):
    first, second = engine.syncs
    engine.svc.servers[1].dead = True  # killed during the update
    assert engine.push_weights({"w": "step 3"}, version="3") is None
    assert engine.svc.restarted == [1] and engine.restarts == 1
    assert first.pushed == [("3", "step 3")] and not first.closed and engine.syncs[0] is first  # left alone
    assert second.closed and second.pushed == []
    third = engine.syncs[1]
    assert third is RecordingSync.made[2] and third.base_url == "http://127.0.0.1:8001"  # same port
    assert third.pushed == [("3", "current")]  # the policy's weights now, tagged with the step
    assert "vLLM server 1 (http://127.0.0.1:8001) died before the weights of step 3" in capsys.readouterr().err


def test_a_server_dying_during_its_push_is_restarted_after_the_others_got_theirs(engine):
    engine.syncs[0].fail = WeightSyncError("cannot reach vLLM at http://127.0.0.1:8000 for /pause")
    engine.svc.servers[0].dead = True
    assert engine.push_weights({"w": "step 2"}, version="2") is None
    assert engine.svc.restarted == [0] and RecordingSync.made[1].pushed == [("2", "step 2")]
    assert engine.syncs[0].pushed == [("2", "current")]


def test_a_sync_error_of_a_live_server_stops_the_run(engine):
    engine.syncs[1].fail = WeightSyncError("/reset_prefix_cache failed with HTTP 500")
    with pytest.raises(WeightSyncError, match="HTTP 500"):
        engine.push_weights({"w": "step 2"}, version="2")
    assert engine.svc.restarted == [] and engine.restarts == 0


def test_a_death_seen_during_the_rollouts_restarts_the_dead_server_only(engine):
    engine.push_weights({"w": "step 4"}, version="4")
    engine.svc.servers[0].dead = True
    engine.restart("during the rollouts of step 5")
    assert engine.svc.restarted == [0] and engine.restarts == 1
    # the policy's weights, tagged with the version the servers hold
    assert engine.syncs[0].pushed == [("4", "current")] and engine.syncs[1].pushed == [("4", "step 4")]


def test_a_death_with_no_server_seen_exited_restarts_them_all(engine):
    engine.restart("during the rollouts of step 1")  # the error said one died; which is unknown
    assert engine.svc.restarted == [0, 1] and engine.restarts == 2
    assert [s.pushed for s in engine.syncs] == [[("0", "current")], [("0", "current")]]  # the base model's: 0


def test_a_death_seen_by_the_rollouts_waits_for_the_update_and_is_not_restarted_twice(engine):
    """Asynchronous rollouts: their thread sees server 0 die while the loop updates the policy (``hold``). The
    restart waits for the update and its push, which found the server dead and started it again with the new
    weights: nothing is left to do, and no server got weights half updated."""
    import threading

    seen = engine.restarts  # when the rollouts began
    engine.svc.servers[0].dead = True
    with engine.hold():
        restarting = threading.Thread(target=engine.restart, args=("during the rollouts of step 3", seen))
        restarting.start()
        restarting.join(0.2)
        assert restarting.is_alive() and engine.svc.restarted == []  # waits for the update
        assert engine.push_weights({"w": "step 2"}, version="2") is None  # the push finds it dead: restarted
    restarting.join(5)
    assert not restarting.is_alive()
    assert engine.svc.restarted == [0] and engine.restarts == 1 and engine.version == "2"
    assert engine.syncs[0].pushed == [("2", "current")] and engine.syncs[1].pushed == [("2", "step 2")]


def test_close_closes_every_sync(engine):
    engine.close()
    assert all(s.closed for s in engine.syncs)
