"""The dispatcher's bounds against a flood of connections, on real sockets: the cap on its connections within the
process's descriptors (shared with the collector), and the handshake timeout.

A dispatcher that needs a low open-files limit runs in a child process beside a collector, as in the trainer
(``trainer_process``); the worker there is a real ``lit worker`` process, whose rollouts succeed only when their
spans reached that collector. Hostile peers are raw TCP connections that never say a word (``raw_peers.flood``,
``raw_peers.flood_until``).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from raw_peers import closed_by_peer, flood, flood_until, send_message, zmtp_connect
from test_dispatch_faults import FakeWorker, hello, make_dispatcher, requests, run_in_thread  # noqa: F401 (a fixture)
from waiting import wait_until

from lit_sdk.processes import stop_child
from lit_sdk.protocol import security
from lit_sdk.worker import spawn
from lit_trainer.intake.connections import RESERVE_FDS
from lit_trainer.intake.rows import RolloutStatus

TESTS = Path(__file__).parents[2]
NOFILE = 512
"""The open-files limit of the trainer process that a flood of up to 700 connections meets."""
WORKER_S = 20.0
"""How long ``run`` waits for the worker during the flood (``no_worker_timeout_s``): below the 30 s after which
ZeroMQ's own default handshake timeout would have closed the flood."""

IDLE = 90
"""Idle connections that all fit the listen backlog (ZeroMQ's 100) at once: none waits for its SYN to be sent again,
so each is accepted, and closed ``handshake_s`` later, within the test's deadline."""

_CHILD = textwrap.dedent("""
    import json, sys
    from lit_sdk.protocol import security
    from lit_sdk.resources import LLM
    from lit_trainer.intake.collector import Collector
    from lit_trainer.intake.store import SqliteStore
    from lit_trainer.rollouts.attempts import RolloutRequest
    from lit_trainer.rollouts.dispatcher import DispatchConfig, Dispatcher
    db, keys_dir, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    keys = security.load_server_keys(keys_dir) if keys_dir else None
    llm = LLM("http://127.0.0.1:9/v1", "none")
    local = keys is None  # the test without keys
    with SqliteStore(db) as store, \\
            Collector(store, "tcp://127.0.0.1:0", keys=keys, max_peers=64, open_to_local_users=local) as collector, \\
            Dispatcher(store, "tcp://127.0.0.1:0", collector.endpoint, [llm.base_url], DispatchConfig(**config),
                       keys=keys, open_to_local_users=local) as dispatcher:
        print(dispatcher.endpoint, flush=True)
        for line in sys.stdin:
            command = line.split()
            if command == ["counts"]:
                limit = getattr(dispatcher, "_limit", None)
                print(json.dumps({"connections": getattr(dispatcher, "connections", None),
                                  "evicted": getattr(dispatcher, "evicted", None),
                                  "cap": limit.cap if limit else None,
                                  "collector_cap": collector._limit.cap,
                                  "refused_peers": dispatcher.refused_peers}), flush=True)
            elif command[:1] == ["run"]:
                reqs = [RolloutRequest(f"r{i}", f"task{i}", {"value": i / 4}, llm, 0) for i in range(int(command[1]))]
                try:
                    outcomes = dispatcher.run(reqs)
                    print(json.dumps([[o.status.value, o.errors[-1:]] for o in outcomes]), flush=True)
                except Exception as exc:
                    print(json.dumps(f"{type(exc).__name__}: {exc}"), flush=True)
            else:
                break
""")


class trainer_process:
    """A collector and a dispatcher (``config``) in one child process, as in the trainer, with an open-files limit
    of ``nofile`` (soft and hard). Commands: ``counts`` (the dispatcher's, and the caps) and ``run n`` (the status
    and last error of each of ``n`` rollouts, or the error that stopped ``run``)."""

    def __init__(self, db: Path, nofile: int, keys_dir: Path | None, **config: object):
        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(db), str(keys_dir or ""), json.dumps(config)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=limit,
                                     env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        self.endpoint = self.proc.stdout.readline().strip()
        assert self.endpoint.startswith("tcp://"), "the trainer process did not start"

    def ask(self, command: str) -> object:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def open_fds(self) -> int:
        return psutil.Process(self.proc.pid).num_fds()

    def stop(self) -> None:
        try:
            self.proc.communicate("stop\n", timeout=30)
        finally:
            self.proc.kill()


def start_worker(endpoint: str, tmp_path: Path, keys_dir: Path | None) -> subprocess.Popen:
    """A real ``lit worker`` process running ``rollout_agents:returns_task_value``, with the client keys if given."""
    env = {k: v for k, v in os.environ.items() if k != security.KEYS_ENV}
    env.update(PYTHONPATH=os.pathsep.join([str(TESTS), *sys.path]), LIT_SPOOL_DIR=str(tmp_path / "spool"))
    if keys_dir is not None:
        env[security.KEYS_ENV] = str(keys_dir)
    return spawn("rollout_agents:returns_task_value", endpoint, 2, env)


@pytest.mark.parametrize("with_keys", [False, True], ids=["no keys", "CURVE keys"])
def test_a_flood_of_idle_connections_on_the_dispatch_port_leaves_room_for_workers(tmp_path, with_keys):
    """Hole: nothing capped the dispatcher's connections, so a flood of idle TCP connections on the dispatch port
    (no handshake, so keys do not stop it) used up the trainer process's file descriptors: no worker could connect,
    and the collector beside it could take no agent either. Now the dispatcher keeps at most what the open-files
    limit leaves beside the collector's room, closing the oldest connection that has not sent a valid message: a
    worker connecting during the flood runs its rollouts, and their spans reach the collector. The handshake
    timeout is set above the test's length, so only the cap can make that room."""
    keys_dir = None
    if with_keys:
        keys_dir = tmp_path / "keys"
        security.generate_keys(keys_dir)
    child = trainer_process(tmp_path / "lit.db", NOFILE, keys_dir, no_worker_timeout_s=WORKER_S, handshake_s=60.0)
    flooders, worker = [], None
    try:
        def full():
            return child.ask("counts")["evicted"] or child.open_fds() > NOFILE - RESERVE_FDS

        def accepted():
            counts = child.ask("counts")
            return counts["connections"] + counts["evicted"]

        flooders = flood_until(child.endpoint, full, accepted)
        wait_until(full, "the flood filling the dispatcher's room (connections closed), or without a cap the reserve")
        worker = start_worker(child.endpoint, tmp_path, keys_dir)
        outcomes = child.ask("run 6")
        counts = child.ask("counts")
        fds = child.open_fds()
    finally:
        child.stop()
        if worker is not None:
            stop_child(worker, grace_s=10)
        for sock in flooders:
            sock.close()
    assert isinstance(outcomes, list) and [status for status, _ in outcomes] == ["succeeded"] * 6, outcomes
    assert counts["evicted"] > 0 and counts["connections"] <= counts["cap"], counts
    # what the flood left: the collector's room and the reserve (less the few descriptors the listeners and the
    # worker's connections opened since their caps were set)
    assert NOFILE - fds - counts["collector_cap"] >= RESERVE_FDS - 16, (fds, counts)


def test_idle_connections_are_closed_after_the_handshake_timeout(make_dispatcher):  # noqa: F811
    """Raw connections that never finish the handshake are closed after ``handshake_s`` (counted as refused
    ``handshake``), while a worker that said hello is served and stays."""
    dispatcher = make_dispatcher(handshake_s=1.0, rollout_timeout_s=20)
    idle = flood(dispatcher.endpoint, IDLE)
    worker = FakeWorker(dispatcher.endpoint)
    worker.start()
    try:
        outcomes = run_in_thread(dispatcher, requests(4))
        wait_until(lambda: all(closed_by_peer(s) for s in idle), "the idle connections closed", timeout_s=15)
        assert [o.status for o in outcomes()] == [RolloutStatus.SUCCEEDED] * 4
        wait_until(lambda: dispatcher.connections == 1, "only the worker's connection left")
        assert dispatcher.refused_peers.get("handshake", 0) >= IDLE, dispatcher.refused_peers
        assert worker.error is None and worker.is_alive()
    finally:
        for sock in idle:
            sock.close()


def test_peers_that_said_hello_and_went_silent_do_not_lock_workers_out(make_dispatcher):  # noqa: F811
    """A peer that said hello is not closed for the cap, so ``max_peers`` peers that said hello and went silent
    would close every newcomer (the newest connection that has not said hello) for good. A worker silent for
    ``worker_timeout_s`` loses its place: its connection is the first closed for the cap, and a new worker gets in
    and runs the rollouts that the silent ones failed."""
    dispatcher = make_dispatcher(max_peers=8, worker_timeout_s=1.0, rollout_timeout_s=20)
    silent = [zmtp_connect(dispatcher.endpoint) for _ in range(8)]
    worker = None
    try:
        for sock in silent:
            send_message(sock, hello())
        dispatcher.wait_for_workers(8, timeout_s=10)
        assert dispatcher.connections == 8
        wait_until(lambda: dispatcher._expire(time.monotonic()) or not dispatcher.workers,
                   "the silent peers declared dead (as run does while it waits)")
        worker = FakeWorker(dispatcher.endpoint)
        worker.start()
        done = run_in_thread(dispatcher, requests(4))()
        assert [o.status for o in done] == [RolloutStatus.SUCCEEDED] * 4, [o.errors for o in done]
        assert dispatcher.evicted >= 1 and worker.error is None
    finally:
        for sock in silent:
            sock.close()


_SHARE = textwrap.dedent("""
    import json, os, sys
    from lit_trainer.intake.collector import Collector
    from lit_trainer.intake.store import SqliteStore
    from lit_trainer.rollouts.dispatcher import DispatchConfig, Dispatcher
    with SqliteStore(sys.argv[1]) as store:
        collector = Collector(store, "tcp://127.0.0.1:0", max_peers=1024, open_to_local_users=True).start()
        fds = len(os.listdir("/proc/self/fd"))
        first = Dispatcher(store, "tcp://127.0.0.1:0", collector.endpoint, [], DispatchConfig(max_peers=2000),
                           open_to_local_users=True)
        caps = {"collector": collector._limit.cap, "beside": first._limit.cap, "fds": fds}
        first.close()
        collector.stop()
        alone = Dispatcher(store, "tcp://127.0.0.1:0", collector.endpoint, [], DispatchConfig(max_peers=2000),
                           open_to_local_users=True)
        caps["alone"] = alone._limit.cap
        alone.close()
        print(json.dumps(caps))
""")


def test_the_collector_and_the_dispatcher_share_the_process_descriptors_with_one_reserve(tmp_path):
    """Each listener's cap leaves the room of those opened before it (their cap less their open connections) and
    one reserve for the rest of the trainer, so that a flood on the dispatch port cannot take the collector's
    descriptors; a closed listener gives its room back."""
    nofile = 2048

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    out = subprocess.run([sys.executable, "-c", _SHARE, str(tmp_path / "lit.db")], capture_output=True, text=True,
                         preexec_fn=limit, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=60)
    assert out.returncode == 0, out.stderr
    caps = json.loads(out.stdout)
    assert caps["collector"] == 1024, caps
    # the descriptors open before the dispatcher, the reserve, and both caps fit the limit
    assert 0 < caps["fds"] + RESERVE_FDS + caps["collector"] + caps["beside"] <= nofile, caps
    assert caps["beside"] > 512 and caps["alone"] >= caps["beside"] + 1000, caps
