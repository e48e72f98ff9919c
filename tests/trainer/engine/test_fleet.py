"""The vLLM fleet (``engine/fleet.py``): every server is launched before any is waited for (they load at once), every
push reaches every server, a server that died alone is started again on its port with the current weights while the
others are left alone, an error of a live server stops the run, and a restart from another thread waits for the
loop's ``hold``. The servers and the weight syncs are stand-ins that record what the fleet asks of them: a real
vLLM needs minutes (two real servers trained and synced: the ``lora_kl`` run of tests/e2e/test_train_options.py;
a real vLLM killed mid-run: tests/e2e/test_chaos.py)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from lit_trainer.engine import fleet as fleet_module
from lit_trainer.engine import remote as remote_module
from lit_trainer.engine.config import InferenceConfig, WeightSyncConfig
from lit_trainer.engine.fleet import Fleet
from lit_trainer.engine.logprob_check import Sample
from lit_trainer.engine.server import ServerDiedError
from lit_trainer.engine.weight_sync import Adapters, SyncReport, WeightSyncError


class Server:
    """A stand-in for ``InferenceServer``: its config, port and URLs, dead (its process exited) or alive; every
    stand-in server made is in ``made``, and what was asked of it in ``events``."""

    made: list[Server] = []
    events: list[str] = []

    def __init__(self, config: InferenceConfig, index: int = 0):
        self.config, self.index, self.port, self.dead = config, index, config.port, False
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.model_name, self.api_key = config.served_model_name, f"key-{self.port}"
        self.credentials = SimpleNamespace(api_key=self.api_key, admin_token=f"token-{len(Server.made)}")
        self.process = SimpleNamespace(pid=1000 + len(Server.made))
        Server.made.append(self)

    def launch(self) -> Server:
        Server.events.append(f"launch {self.index} on {self.port}")
        return self

    def wait_ready(self, meanwhile=None) -> Server:
        Server.events.append(f"ready {self.index}" + (" (doing something meanwhile)" if meanwhile else ""))
        return self

    def start(self) -> Server:
        return self.launch().wait_ready()

    def stop(self) -> None:
        Server.events.append(f"stop {self.index}")

    def check_alive(self) -> None:
        if self.dead:
            raise ServerDiedError(f"vLLM on port {self.port} exited with code -9: killed")

    def exited(self, within_s: float = 0.0) -> bool:
        return self.dead


class RecordingSync:
    """A stand-in for ``WeightSync``: records the pushes; ``fail`` makes the next one raise it."""

    made: list[RecordingSync] = []

    def __init__(self, base_url, config, credentials=None):
        self.base_url, self.config, self.credentials = base_url, config, credentials
        self.pushed, self.closed, self.fail = [], False, None
        RecordingSync.made.append(self)

    def push_weights(self, state, version):
        if self.fail is not None:
            raise self.fail
        self.pushed.append((version, state["w"]))
        return SyncReport(version, {"reload": 1.0 if self.base_url.endswith(":8001") else 0.5, "resume": 0.25})

    def push_adapters(self, adapters, version):
        self.pushed.append((version, sorted(adapters.by_name)))
        return SyncReport(version, {"load_adapter": 0.1})

    def sleep(self) -> None:
        Server.events.append(f"sleep {self.base_url}")

    def wake_up(self) -> None:
        Server.events.append(f"wake {self.base_url}")

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def stand_ins(monkeypatch):
    Server.made, Server.events, RecordingSync.made = [], [], []
    monkeypatch.setattr(fleet_module, "InferenceServer", Server)
    monkeypatch.setattr(fleet_module, "WeightSync", RecordingSync)


def fleet_of(servers: int = 2) -> Fleet:
    """A fleet of ``servers`` on ports 8000, 8001, ... whose current weights are ``{"w": "current"}``."""
    return Fleet(InferenceConfig(port=8000, servers=servers), WeightSyncConfig(nccl_master_port=29555),
                 weights=lambda: {"w": "current"})


def started(servers: int = 2) -> Fleet:
    return fleet_of(servers).start()


def test_servers_are_all_launched_before_any_is_waited_for_and_stopped_last_first():
    with fleet_of() as fleet:
        assert [s.index for s in fleet.servers] == [0, 1] and fleet.base_urls == ["http://127.0.0.1:8000",
                                                                                 "http://127.0.0.1:8001"]
        assert fleet.pids == [1000, 1001]
    assert Server.events == ["launch 0 on 8000", "launch 1 on 8001", "ready 0", "ready 1", "stop 1", "stop 0"]
    assert all(s.closed for s in RecordingSync.made)


def test_launch_returns_before_any_server_is_waited_for_and_the_wait_does_what_it_is_given_meanwhile():
    fleet = fleet_of().launch()  # services: the workers start now
    assert Server.events == ["launch 0 on 8000", "launch 1 on 8001"] and fleet.syncs == []
    assert fleet.wait_ready(meanwhile=lambda seconds: None) is fleet and len(fleet.syncs) == 2
    assert Server.events[2:] == ["ready 0 (doing something meanwhile)", "ready 1 (doing something meanwhile)"]


def test_each_sync_gets_its_servers_credentials_and_a_rendezvous_port_of_its_own():
    fleet = started()
    assert [s.base_url for s in fleet.syncs] == fleet.base_urls
    assert [s.credentials for s in fleet.syncs] == [s.credentials for s in fleet.servers]
    assert [s.config.nccl_master_port for s in fleet.syncs] == [29555, 29556]


def test_a_fleet_that_takes_no_weights_opens_no_sync_and_restarts_without_a_push():
    fleet = Fleet(InferenceConfig(port=8000)).start()  # lit eval: serve the config's model
    assert fleet.syncs == []
    fleet.servers[0].dead = True
    fleet.restart("during a validation")
    assert fleet.restarts == 1 and Server.made[1].port == 8000 and RecordingSync.made == []
    with pytest.raises(ValueError, match="needs a WeightSyncConfig"):
        Fleet(InferenceConfig(), weights=lambda: {})


def test_a_server_that_fails_to_start_stops_the_ones_already_launched():
    class Failing(Server):
        def wait_ready(self, meanwhile=None):
            if self.index == 1:
                raise ServerDiedError("vLLM exited with code 1: see the log")
            return super().wait_ready(meanwhile)

    fleet_module.InferenceServer = Failing
    with pytest.raises(ServerDiedError, match="code 1"):
        started()
    assert Server.events == ["launch 0 on 8000", "launch 1 on 8001", "ready 0", "stop 1", "stop 0"]


def test_a_push_reaches_every_server():
    fleet = started()
    report = fleet.push_weights({"w": "step 1"}, version="1")
    assert [(s.base_url, s.pushed) for s in fleet.syncs] == [("http://127.0.0.1:8000", [("1", "step 1")]),
                                                            ("http://127.0.0.1:8001", [("1", "step 1")])]
    # one after the other: the total is both syncs (0.75 s and 1.25 s), the slowest the second
    assert report.version == "1" and report.total_s == pytest.approx(2.0) and report.slowest_s == pytest.approx(1.25)
    assert [r.version for r in report.reports] == ["1", "1"] and fleet.restarts == 0 and fleet.version == "1"


def test_a_roles_adapters_reach_every_server_and_a_server_started_again_gets_them(capsys):
    adapters = Adapters({"policy-writer": ({}, {}), "policy-rewriter": ({}, {})})
    fleet = Fleet(InferenceConfig(port=8000, servers=2), WeightSyncConfig(), weights=lambda: adapters).start()
    fleet.push_weights(adapters, version="1")
    assert [s.pushed for s in fleet.syncs] == [[("1", ["policy-rewriter", "policy-writer"])]] * 2
    fleet.servers[0].dead = True
    assert fleet.push_weights(adapters, version="2") is None  # started again with the current adapters
    assert fleet.syncs[0].pushed == [("2", ["policy-rewriter", "policy-writer"])] and fleet.restarts == 1


def test_one_dead_server_of_two_is_restarted_alone_on_its_port_with_the_current_weights(capsys):
    fleet = started()
    first, second = fleet.syncs
    fleet.servers[1].dead = True  # killed during the update
    assert fleet.push_weights({"w": "step 3"}, version="3") is None
    assert fleet.restarts == 1 and fleet.version == "3"
    assert first.pushed == [("3", "step 3")] and not first.closed and fleet.syncs[0] is first  # left alone
    assert second.closed and second.pushed == []
    third = fleet.syncs[1]
    assert third is RecordingSync.made[2] and third.base_url == "http://127.0.0.1:8001"  # same port
    assert third.credentials is fleet.servers[1].credentials and fleet.servers[1] is Server.made[2]
    assert fleet.servers[1].index == 1  # its own cores or GPUs
    assert third.pushed == [("3", "current")]  # the policy's weights now, tagged with the step
    assert Server.events[-2:] == ["launch 1 on 8001", "ready 1"] and "stop 0" not in Server.events
    assert "vLLM server 1 (http://127.0.0.1:8001) died before the weights of step 3" in capsys.readouterr().err


def test_one_server_dying_during_its_push_is_restarted_after_the_others_got_theirs():
    fleet = started()
    fleet.syncs[0].fail = WeightSyncError("cannot reach vLLM at http://127.0.0.1:8000 for /pause")
    fleet.servers[0].dead = True
    assert fleet.push_weights({"w": "step 2"}, version="2") is None
    assert fleet.restarts == 1 and RecordingSync.made[1].pushed == [("2", "step 2")]
    assert fleet.syncs[0].pushed == [("2", "current")]


def test_the_one_server_dying_during_the_push_is_started_again(capsys):
    fleet = started(servers=1)
    fleet.syncs[0].fail = WeightSyncError("cannot reach vLLM at http://127.0.0.1:8000 for /pause")
    fleet.servers[0].dead = True
    assert fleet.push_weights({"w": 2}, version="3") is None
    assert fleet.restarts == 1 and RecordingSync.made[0].closed and RecordingSync.made[1].pushed == [("3", "current")]
    assert "vLLM died before the weights of step 3 reached it" in capsys.readouterr().err


def test_a_sync_error_of_a_live_server_stops_the_run():
    fleet = started()
    fleet.syncs[1].fail = WeightSyncError("/reset_prefix_cache failed with HTTP 500")
    with pytest.raises(WeightSyncError, match="HTTP 500"):
        fleet.push_weights({"w": "step 2"}, version="2")
    assert fleet.restarts == 0 and len(Server.made) == 2 and fleet.version == "0"


def test_a_death_seen_elsewhere_restarts_the_dead_server_only_with_the_version_the_servers_hold():
    fleet = started()
    fleet.push_weights({"w": "step 4"}, version="4")
    fleet.servers[0].dead = True
    with pytest.raises(ServerDiedError, match="port 8000"):
        fleet.check()
    fleet.restart("during the rollouts of step 5")
    assert fleet.restarts == 1
    # the policy's weights, tagged with the version the servers hold
    assert fleet.syncs[0].pushed == [("4", "current")] and fleet.syncs[1].pushed == [("4", "step 4")]
    fleet.check()


def test_a_death_with_no_server_seen_exited_restarts_them_all():
    fleet = started()
    fleet.restart("during the rollouts of step 1")  # the error said one died; which is unknown
    assert fleet.restarts == 2
    assert [s.pushed for s in fleet.syncs] == [[("0", "current")], [("0", "current")]]  # the base model's: 0


def test_a_death_seen_by_the_rollouts_waits_for_the_update_and_is_not_restarted_twice():
    """Asynchronous rollouts: their thread sees server 0 die while the loop updates the policy (``hold``). The
    restart waits for the update and its push, which found the server dead and started it again with the new
    weights: nothing is left to do, and no server got weights half updated."""
    fleet = started()
    seen = fleet.restarts  # when the rollouts began
    fleet.servers[0].dead = True
    entered = threading.Event()

    def restart() -> None:
        entered.set()
        fleet.restart("during the rollouts of step 3", seen)

    with fleet.hold():
        restarting = threading.Thread(target=restart)
        restarting.start()
        assert entered.wait(5)
        assert fleet.restarts == 0  # it waits for the hold: the loop's push comes first
        assert fleet.push_weights({"w": "step 2"}, version="2") is None  # the push finds it dead: restarted
    restarting.join(5)
    assert not restarting.is_alive()
    assert fleet.restarts == 1 and fleet.version == "2"
    assert fleet.syncs[0].pushed == [("2", "current")] and fleet.syncs[1].pushed == [("2", "step 2")]


def test_logprob_gaps_asks_every_server_with_its_own_key(monkeypatch):
    asked, scored = [], []

    def sample_from_vllm(base_url, model_name, prompts, max_tokens, api_key):
        asked.append((base_url, model_name, api_key, max_tokens))
        return [Sample(list(p), [7], [-0.5]) for p in prompts]

    def score(samples):  # the trainer's logprobs of each server's samples, 0.01 off vLLM's
        scored.append(samples)
        return [torch.tensor([-0.51]) for _ in samples]

    monkeypatch.setattr(fleet_module, "sample_from_vllm", sample_from_vllm)
    gaps = started().logprob_gaps(score, prompts=[[1, 2]], tolerance=0.05)
    assert list(gaps) == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert all(gap.ok and abs(gap.max_abs - 0.01) < 1e-6 and gap.n_tokens == 1 for gap in gaps.values()), gaps
    assert asked == [("http://127.0.0.1:8000", "policy", "key-8000", 8), ("http://127.0.0.1:8001", "policy",
                                                                          "key-8001", 8)]
    assert len(scored) == 2 and scored[0][0].prompt_ids == [1, 2]


def test_a_server_that_died_under_the_sync_check_says_so_with_its_log(monkeypatch):
    """Hole: the logprob check after a push asked a dead vLLM and raised the bare 'Connection refused' of requests,
    with nothing saying vLLM had died; it also ran while the rollouts' thread could be starting a server again."""
    fleet = started()

    def sample_from_vllm(base_url, model_name, prompts, max_tokens, api_key):
        if base_url.endswith(":8001"):
            fleet.servers[1].dead = True  # killed while it answers
        raise ConnectionError(f"{base_url}: Connection refused")

    monkeypatch.setattr(fleet_module, "sample_from_vllm", sample_from_vllm)
    with pytest.raises(ConnectionError, match="8000: Connection refused"):  # a live server's error is its own
        fleet.logprob_gaps(lambda samples: [], prompts=[[1, 2]], tolerance=0.05)
    monkeypatch.setattr(fleet_module, "sample_from_vllm", lambda base_url, *args, **kwargs: (
        [Sample([1, 2], [7], [-0.5])] if base_url.endswith(":8000") else sample_from_vllm(base_url, *args, **kwargs)))
    with pytest.raises(ServerDiedError, match="vLLM on port 8001 exited"):
        fleet.logprob_gaps(lambda samples: [torch.tensor([-0.5])], prompts=[[1, 2]], tolerance=0.05)
    fleet.servers[1].dead = False
    fleet.servers[0].dead = True  # dead before it was asked
    with pytest.raises(ServerDiedError, match="vLLM on port 8000 exited"):
        fleet.logprob_gaps(lambda samples: [], prompts=[[1, 2]], tolerance=0.05)


def test_a_stopped_fleet_starts_no_server_again():
    """Hole: the rollouts' thread could start vLLM again after the run had stopped the fleet."""
    fleet = started()
    fleet.servers[0].dead = True
    fleet.stop()
    with pytest.raises(ServerDiedError, match="while the run was stopping: it is not started again"):
        fleet.restart("during the rollouts of step 3")
    assert fleet.restarts == 0 and len(Server.made) == 2


def test_weights_travel_in_the_servers_dtype():

    from lit_trainer.engine.fleet import for_serving

    embed = torch.randn(4, 3)
    state = {"embed.weight": embed, "head.weight": embed, "norm.weight": torch.ones(3, dtype=torch.bfloat16),
             "steps": torch.tensor([3])}
    served = for_serving(state, "bfloat16")  # float32 master weights, a bfloat16 server: half the bytes travel
    assert {k: v.dtype for k, v in served.items()} == {"embed.weight": torch.bfloat16, "head.weight": torch.bfloat16,
                                                      "norm.weight": torch.bfloat16, "steps": torch.int64}
    assert served["embed.weight"] is served["head.weight"]  # tied names still share one tensor
    assert served["norm.weight"] is state["norm.weight"]  # already in the dtype: not copied
    assert torch.equal(served["embed.weight"], embed.to(torch.bfloat16))
    assert for_serving(state, "float32")["norm.weight"].dtype == torch.float32  # a frozen bfloat16 base, fp32 server
    assert all(a is b for a, b in zip(for_serving(state, "auto").values(), state.values(), strict=True))
    # the fleet pushes them so, to every server
    fleet = Fleet(InferenceConfig(port=8000, servers=2, dtype="bfloat16"), WeightSyncConfig(),
                  weights=lambda: {"w": torch.zeros(2)}).start()
    fleet.push_weights({"w": torch.ones(2)}, version="1")
    assert [s.pushed[0][1].dtype for s in fleet.syncs] == [torch.bfloat16, torch.bfloat16]
    fleet.servers[0].dead = True
    fleet.restart("during a test")
    assert fleet.syncs[0].pushed[0][1].dtype == torch.bfloat16  # a server started again gets the same dtype


class Remote(fleet_module.RemoteServer):
    """A stand-in for a server of ``lit serve`` on another host: answers (``up``) or not, records the pushes."""

    def __init__(self, endpoint: str):
        self.endpoint, self.host, self.port, self.model_name, self.api_key = endpoint, "10.0.0.2", 8000, "policy", "k"
        self.up, self.pushed, self.closed = True, [], 0

    def connect(self, timeout_s=None):
        if not self.up:
            raise ServerDiedError(f"lit serve at {self.endpoint} did not answer hello within {timeout_s:.0f} s")
        return self

    def is_healthy(self) -> bool:
        return self.up

    check_alive = fleet_module.RemoteServer.check_alive
    _healthy_at = 0.0

    def push_weights(self, state, version):
        if not self.up:
            raise ServerDiedError(f"the vLLM server at {self.base_url} stopped answering")
        self.pushed.append((version, state["w"]))
        return SyncReport(version, {"remote_reload": 0.5, "send": 1.0})

    def close(self) -> None:
        self.closed += 1


def test_a_remote_server_takes_every_push_is_dropped_when_it_stops_answering_and_taken_back(monkeypatch, capsys):
    remote = Remote("tcp://10.0.0.2:7400")
    monkeypatch.setattr(remote_module, "HEALTH_EVERY_S", 0.0)  # every check asks
    asked = []
    monkeypatch.setattr(fleet_module, "connect_remotes", lambda *args: asked.append(args) or [remote])
    monkeypatch.setattr(fleet_module.RemoteServer, "exited", lambda self, within_s=0.0: not self.up)
    weights = {"w": "step 0"}
    fleet = Fleet(InferenceConfig(port=8000, remote=["tcp://10.0.0.2:7400"], api_key="k"), WeightSyncConfig(),
                  weights=lambda: dict(weights), keys_dir="/keys").start()
    assert asked == [(["tcp://10.0.0.2:7400"], "/keys", "k", "policy", 300.0)]
    assert fleet.servers[1] is remote and fleet.syncs[1] is remote and fleet.pids == [1000]
    assert remote.pushed == [("0", "step 0")]  # it may hold another run's weights: it gets this one's at once
    fleet.push_weights({"w": "step 1"}, version="1")
    assert remote.pushed[-1] == ("1", "step 1") and RecordingSync.made[0].pushed == [("1", "step 1")]

    remote.up = False  # lit serve's host went away during the rollouts of step 2
    with pytest.raises(ServerDiedError, match="stopped answering"):
        fleet.check()
    assert fleet.drop_silent_remotes("during the rollouts of step 2")  # what the rollouts do when one dies
    assert not fleet.drop_silent_remotes("again")
    assert fleet.dropped == {1} and fleet.serving == [fleet.servers[0]] and fleet.restarts == 1
    assert len(Server.made) == 1  # the local server was left alone, the remote one is not started here
    assert "stopped answering during the rollouts of step 2; the run goes on without it" in capsys.readouterr().err
    fleet.check()  # the dropped server is no longer checked
    weights["w"] = "step 2"
    assert fleet.push_weights({"w": "step 2"}, version="2").version == "2"  # it does not answer: still out
    assert fleet.dropped == {1} and remote.pushed[-1][0] == "1"

    remote.up = True  # lit serve started again there
    fleet.push_weights({"w": "step 3"}, version="3")
    assert fleet.dropped == set() and remote.pushed[-1] == ("3", "step 3") and len(remote.pushed) == 3
    assert "answers again: taken back with this push" in capsys.readouterr().err


def test_a_remote_server_that_dies_during_a_push_is_dropped_and_the_others_get_theirs(monkeypatch):
    remote = Remote("tcp://10.0.0.2:7400")
    monkeypatch.setattr(fleet_module, "connect_remotes", lambda *args: [remote])
    monkeypatch.setattr(fleet_module.RemoteServer, "exited", lambda self, within_s=0.0: not self.up)
    fleet = Fleet(InferenceConfig(port=8000, remote=["tcp://10.0.0.2:7400"], api_key="k"), WeightSyncConfig(),
                  weights=lambda: {"w": "now"}, keys_dir="/keys").start()
    remote.up = False
    assert fleet.push_weights({"w": "step 1"}, version="1") is None  # a server was dropped: no report
    assert fleet.dropped == {1} and RecordingSync.made[0].pushed[-1] == ("1", "step 1")
    assert fleet.restarts == 1 and len(Server.made) == 1


def test_a_resumed_runs_remote_server_gets_its_weights_once_with_their_version(monkeypatch):
    remote = Remote("tcp://10.0.0.2:7400")
    monkeypatch.setattr(fleet_module, "connect_remotes", lambda *args: [remote])
    fleet = Fleet(InferenceConfig(port=8000, remote=["tcp://10.0.0.2:7400"], api_key="k"), WeightSyncConfig(),
                  weights=lambda: {"w": "step 4"}, keys_dir="/keys", version="4").start()
    assert remote.pushed == [("4", "step 4")]  # when it joined
    report = fleet.push_weights({"w": "step 4"}, version="4")  # the loop's push of the resumed weights
    assert remote.pushed == [("4", "step 4")] and RecordingSync.made[0].pushed == [("4", "step 4")]
    assert [r.version for r in report.reports] == ["4"]  # the local server's only
    fleet.push_weights({"w": "step 5"}, version="5")
    assert remote.pushed[-1] == ("5", "step 5") and RecordingSync.made[0].pushed[-1] == ("5", "step 5")


def test_a_fleet_that_only_serves_leaves_the_remote_servers_out(monkeypatch):
    monkeypatch.setattr(fleet_module, "connect_remotes", lambda *args: pytest.fail("lit eval asked a remote"))
    fleet = Fleet(InferenceConfig(port=8000, remote=["tcp://10.0.0.2:7400"], api_key="k")).start()
    assert len(fleet.servers) == 1  # lit eval: its checkpoint's weights are only in the local servers


def test_colocated_servers_sleep_through_the_block_and_wake_even_when_it_fails(monkeypatch):
    remote = Remote("tcp://10.0.0.2:7400")
    monkeypatch.setattr(fleet_module, "connect_remotes", lambda *args: [remote])
    fleet = Fleet(InferenceConfig(port=8000, servers=2, device="cuda", layout="colocated", remote=["tcp://x:1"],
                                  api_key="k"), WeightSyncConfig(), weights=lambda: {"w": "now"},
                  keys_dir="/keys").start()
    Server.events.clear()
    with pytest.raises(RuntimeError, match="out of memory"), fleet.asleep():
        Server.events.append("update")
        raise RuntimeError("CUDA out of memory")
    assert Server.events == ["sleep http://127.0.0.1:8000", "sleep http://127.0.0.1:8001", "update",
                             "wake http://127.0.0.1:8000", "wake http://127.0.0.1:8001"]  # the remote one serves on
    shared = started()
    Server.events.clear()
    with shared.asleep():
        Server.events.append("update")
    assert Server.events == ["update"]  # layout "shared": vLLM keeps its memory
