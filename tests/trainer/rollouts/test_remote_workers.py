"""Workers on other hosts (issue #16): real ``lit worker`` processes reach the trainer's dispatcher and collector
over TCP with the CURVE keys of ``lit keys generate``, and peers without them are refused and store nothing.

The trainer's side (a real SQLite store, collector and dispatcher) runs in this process. The workers run in a
network namespace each test makes, joined to this one by a veth pair: the trainer binds the address of the pair's
end on this side, and the namespace has no other way out (the host's 127.0.0.1 and other addresses are out of its
reach, which the first test checks), so for the network they are on another host.

Where no namespace can be made (not root, no ``ip``, a container without the capability), or when
``LIT_TEST_NO_NETNS=1``, the same tests run the workers as plain processes that connect to this machine's
non-loopback address (127.0.0.1 when it has none) on a port the system picks. The test id says which was used
(``[netns]`` or ``[host-tcp]``), and a log line why.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import Network, machine_address, other_host, transport

from lit_sdk import semconv as sc
from lit_sdk.processes import start_child, stop_children, wait_children
from lit_sdk.protocol import security
from lit_sdk.resources import LLM
from lit_trainer import cli
from lit_trainer.intake.collector import Collector
from lit_trainer.intake.rows import RolloutStatus
from lit_trainer.intake.store import SqliteStore
from lit_trainer.rollouts.attempts import RolloutRequest
from lit_trainer.rollouts.dispatcher import DispatchConfig, Dispatcher, DispatchError

TESTS = Path(__file__).parents[2]
AGENT = "rollout_agents:rewards_where_it_runs"
NO_LLM = LLM("http://127.0.0.1:9/v1", "none")

PROBE = """
import socket, sys
port = int(sys.argv[1])
for host in sys.argv[2:]:
    try:
        socket.create_connection((host, port), timeout=2).close()
        print(host, "connected")
    except OSError as exc:
        print(host, type(exc).__name__)
"""
"""Run where the workers run: tries a TCP connection to each host given, at one port."""

INTRUDER = """
import sys, zmq
from lit_sdk import protocol, semconv
dispatch, spans = sys.argv[1:]
socks = []
for endpoint in (dispatch, spans):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    socks.append(sock)
socks[0].send(protocol.encode_dispatch(protocol.Hello(1024, 1, "intruder", "intruder")))
root = protocol.SpanRecord(trace_id="a" * 32, span_id="b" * 16, parent_id=None, name=semconv.ROLLOUT_SPAN,
                           start_ns=1, end_ns=2, rollout_id="forged", attributes={semconv.ROLLOUT_RETURN_REWARD: 1.0})
socks[1].send(protocol.encode_spans("forged-batch", "intruder", [root]))
print("answers:", sum(bool(sock.poll(3000)) for sock in socks))
"""
"""A peer without keys, run where the workers run: says hello to the dispatcher with 1024 slots, sends the collector
a forged root span with reward 1, and prints how many of the two answered within 3 s."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "network" in metafunc.fixturenames:
        metafunc.parametrize("network", [transport()[0]], indirect=True)


@pytest.fixture
def network(request: pytest.FixtureRequest) -> Iterator[Network]:
    with other_host("remote workers") as network:
        yield network


def make_keys(tmp_path: Path) -> tuple[Path, Path]:
    """``lit keys generate`` on the trainer's host, and the worker host's folder: only ``client.key_secret`` and
    ``server.key`` copied into it (the README's steps)."""
    trainer_keys, worker_keys = tmp_path / "trainer-keys", tmp_path / "worker-keys"
    assert cli.main(["keys", "generate", str(trainer_keys)]) == 0
    copy_keys(trainer_keys / security.CLIENT_SECRET, trainer_keys / security.SERVER_PUBLIC, worker_keys)
    return trainer_keys, worker_keys


def copy_keys(client_secret: Path, server_public: Path, folder: Path) -> Path:
    folder.mkdir(mode=0o700)
    shutil.copy(client_secret, folder / security.CLIENT_SECRET)  # shutil.copy keeps the 0600
    shutil.copy(server_public, folder / security.SERVER_PUBLIC)
    return folder


@contextlib.contextmanager
def trainer(store: SqliteStore, host: str, keys: security.ServerKeys) -> Iterator[tuple[Collector, Dispatcher]]:
    """The trainer's collector and dispatcher with ``keys``, on ports of ``host`` that the system picks."""
    with Collector(store, f"tcp://{host}:0", keys=keys) as collector:
        config = DispatchConfig(rollout_timeout_s=30, no_worker_timeout_s=30)
        with Dispatcher(store, f"tcp://{host}:0", collector.endpoint, [NO_LLM.base_url], config,
                        keys=keys) as dispatcher:
            yield collector, dispatcher


def start_worker(network: Network, endpoint: str, keys: Path | None, output: Path, processes: int = 1
                 ) -> tuple[subprocess.Popen, Path]:
    """``lit worker`` where the workers run, with ``$LIT_KEYS_DIR`` set to ``keys`` (unset for None); its output goes
    to ``output``."""
    env = {**os.environ, "PYTHONPATH": str(TESTS), "LIT_SPOOL_DIR": str(output.with_suffix(".spool")),
           "LIT_FRAMEWORKS": "none"}
    env.pop(security.KEYS_ENV, None)
    if keys is not None:
        env[security.KEYS_ENV] = str(keys)
    cmd = network.command(sys.executable, "-m", "lit_trainer.cli", "worker", "--connect", endpoint,
                          "--processes", str(processes), "--concurrency", "2", AGENT)
    with output.open("w") as sink:
        return start_child(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT), output


def stop_workers(dispatcher: Dispatcher, procs: list[subprocess.Popen]) -> list[int | None]:
    """Tell the workers to stop, give them 15 s, end those that did not; their exit codes."""
    dispatcher.close()
    wait_children(procs, 15)
    return stop_children(procs, grace_s=5, name="remote workers")


def assert_only_the_link_reaches_the_trainer(network: Network) -> None:
    """From the namespace, this host answers at the veth address only: its 127.0.0.1 is the namespace's own
    loopback, and its other addresses have no route."""
    address = machine_address()
    others = [address] if address != "127.0.0.1" else []
    with socket.create_server(("0.0.0.0", 0)) as listener:
        port = listener.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # from here, loopback reaches it
        done = subprocess.run(network.command(sys.executable, "-c", PROBE, str(port), "127.0.0.1",
                                              network.trainer_host, *others),
                              capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["127.0.0.1 ConnectionRefusedError", f"{network.trainer_host} connected",
                                        *(f"{a} OSError" for a in others)]


def test_workers_on_another_host_with_the_keys_run_rollouts_and_every_span_is_stored(network, tmp_path):
    trainer_keys, worker_keys = make_keys(tmp_path)
    if network.kind == "netns":
        assert_only_the_link_reaches_the_trainer(network)
    requests = [RolloutRequest(f"r{i}", f"t{i}", {"value": i / 8}, NO_LLM, 0) for i in range(8)]
    with SqliteStore(tmp_path / "lit.sqlite") as store:
        with trainer(store, network.trainer_host, security.load_server_keys(trainer_keys)) as (collector, dispatcher):
            assert dispatcher.endpoint.startswith(f"tcp://{network.trainer_host}:")
            proc, output = start_worker(network, dispatcher.endpoint, worker_keys, tmp_path / "worker.log",
                                        processes=2)
            try:
                dispatcher.wait_for_workers(2, timeout_s=30)
                outcomes = dispatcher.run(requests)
            finally:
                [code] = stop_workers(dispatcher, [proc])
            counts = collector.counts
        assert code == 0, output.read_text()
        assert [(o.status, o.attempts, o.errors) for o in outcomes] == [(RolloutStatus.SUCCEEDED, 1, [])] * 8
        assert (counts.spans_stored, counts.rejected, counts.refused_peers) == (16, {}, {})
        assert dispatcher.refused_peers == {} and dispatcher.rejected == {}
        ran_at = []
        for request, outcome in zip(requests, outcomes, strict=True):
            assert store.missing_spans(outcome.rollout_id) is None
            spans = {s.name: s for s in store.spans_of_rollout(outcome.rollout_id)}
            assert sorted(spans) == [sc.REWARD_SPAN, sc.ROLLOUT_SPAN]
            assert spans[sc.REWARD_SPAN].attributes[sc.REWARD_VALUE] == request.task["value"]
            root = spans[sc.ROLLOUT_SPAN].attributes
            assert root[sc.ROLLOUT_SPANS] == 2 and root[sc.ROLLOUT_ID] == outcome.rollout_id
            ran_at.append(json.loads(root[sc.ROLLOUT_OUTPUT]))
    assert len({r["pid"] for r in ran_at}) == 2 and os.getpid() not in {r["pid"] for r in ran_at}
    here = os.readlink("/proc/self/ns/net")
    there = f"net:[{os.stat(f'/run/netns/{network.namespace}').st_ino}]" if network.namespace else here
    assert {r["net"] for r in ran_at} == {there}


def test_peers_without_the_keys_are_refused_and_store_nothing(network, tmp_path):
    trainer_keys, _ = make_keys(tmp_path)
    other_keys = tmp_path / "another-trainer"
    security.generate_keys(other_keys)
    wrong_client = copy_keys(other_keys / security.CLIENT_SECRET, trainer_keys / security.SERVER_PUBLIC,
                             tmp_path / "wrong-client")
    wrong_trainer = copy_keys(other_keys / security.CLIENT_SECRET, other_keys / security.SERVER_PUBLIC,
                              tmp_path / "wrong-trainer")
    loopback = security.is_loopback_host(network.trainer_host)
    with SqliteStore(tmp_path / "lit.sqlite") as store:
        if not loopback:  # without keys the trainer does not even listen where other hosts reach it
            with pytest.raises(security.SecurityError, match="lit keys generate"):
                Collector(store, f"tcp://{network.trainer_host}:0", open_to_local_users=True).start()
            with pytest.raises(security.SecurityError, match="lit keys generate"):
                Dispatcher(store, f"tcp://{network.trainer_host}:0", "tcp://127.0.0.1:7373", [NO_LLM.base_url],
                           open_to_local_users=True)
        with trainer(store, network.trainer_host, security.load_server_keys(trainer_keys)) as (collector, dispatcher):
            workers = {name: start_worker(network, dispatcher.endpoint, keys, tmp_path / f"{name}.log")
                       for name, keys in (("wrong-client", wrong_client), ("wrong-trainer", wrong_trainer),
                                          ("no-keys", None))}
            intruder = subprocess.Popen(network.command(sys.executable, "-c", INTRUDER, dispatcher.endpoint,
                                                        collector.endpoint), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
            try:
                with pytest.raises(DispatchError, match="0 of 1 workers connected"):
                    dispatcher.wait_for_workers(1, timeout_s=8)
                said, _ = intruder.communicate(timeout=30)
                # a worker the trainer refused stops by itself, naming the fix (the keyless one is never let in)
                exited = {name: workers[name][0].wait(timeout=120) for name in ("wrong-client", "wrong-trainer")}
            finally:
                intruder.kill()
                # the dispatcher knows none of them to tell it to stop
                codes = dict(zip(workers, stop_children([p for p, _ in workers.values()], grace_s=5), strict=True))
            refused = dispatcher.refused_peers
            counts = collector.counts
        outputs = {name: output.read_text() for name, (_, output) in workers.items()}
        assert said.splitlines()[-1] == "answers: 0", said
        # A keyless peer finds the mechanisms mismatched too and drops the connection: the trainer counts it as
        # no_key, or as a failed handshake when the drop comes first (across the veth link, usually so).
        keyless = {"no_key", "handshake"}
        assert {"unknown_key", "bad_key"} <= refused.keys() <= {"unknown_key", "bad_key", *keyless}, refused
        assert sum(refused[k] for k in keyless & refused.keys()) >= (2 if loopback else 1), refused
        assert counts.refused_peers and counts.refused_peers.keys() <= keyless, counts.refused_peers
        assert (counts.frames, counts.spans_stored, counts.rejected) == (0, 0, {})
        assert store.counts()["spans"] == 0 and store.spans_of_rollout("forged") == []
        assert dispatcher.workers == {} and dispatcher.rejected == {}
    for name in ("wrong-client", "wrong-trainer"):
        assert exited[name] == 1, outputs[name]
        assert "lit worker: error: the trainer refused this process's keys" in outputs[name], outputs[name]
    if not loopback:  # the worker refuses to go on without keys, before it sends anything
        assert codes["no-keys"] == 1 and "without keys" in outputs["no-keys"], outputs["no-keys"]
