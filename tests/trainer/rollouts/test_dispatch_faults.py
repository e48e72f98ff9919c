"""The dispatch channel under faults, on real ZeroMQ sockets: junk from whoever reaches the port, a worker that
reconnects, a ``run`` message that is lost, sync agents that fill or outlive their threads, spans that do not reach
the collector, and a rollout reported succeeded whose spans the store lacks.

The "workers" on the trainer's side are raw DEALER sockets speaking the protocol by hand (written as plain maps, so
that the fields they send are exactly those under test); the worker under test runs in a thread of this process
against a raw ROUTER standing in for the trainer."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import zmq
from waiting import wait_until

import lit_sdk as lit
from lit_sdk.protocol import decode_frame, encode_nack
from lit_sdk.protocol.dispatch import (
    TO_TRAINER,
    TO_WORKER,
    Done,
    Heartbeat,
    Run,
    Stop,
    Welcome,
    Who,
    decode_dispatch,
    encode_dispatch,
)
from lit_sdk.resources import LLM
from lit_sdk.worker import Worker
from lit_trainer.intake.rows import RolloutStatus
from lit_trainer.intake.store import SqliteStore
from lit_trainer.rollouts.attempts import Outcome, RolloutRequest
from lit_trainer.rollouts.dispatcher import DispatchConfig, Dispatcher

NO_LLM = LLM("http://127.0.0.1:9/v1", "none")
FAST = 5.0
"""Seconds within which a fault must be recovered from; the timeouts that recovered from it on their own are set
above this (``worker_timeout_s``, ``rollout_timeout_s``), so only the fix can pass."""


def wire(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def hello(slots: int = 1, **fields: Any) -> bytes:
    return wire({"v": 1, "t": "hello", "slots": slots, "pid": 4242, "host": "raw-host", **fields})


def beat(rollouts: list[str] | None) -> bytes:
    return wire({"v": 1, "t": "hb", "running": len(rollouts or []), "rollouts": rollouts})


def done(rollout_id: str, attempt: int = 1, status: str = "succeeded", **fields: Any) -> bytes:
    return wire({"v": 1, "t": "done", "rollout_id": rollout_id, "attempt": attempt, "status": status, **fields})


def requests(n: int) -> list[RolloutRequest]:
    return [RolloutRequest(f"r{i}", f"task{i}", {"value": i / 4}, NO_LLM, 0) for i in range(n)]


def dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def receive(sock: zmq.Socket, cls: type, timeout_s: float = 10.0) -> Any:
    """The next message of type ``cls`` this raw worker receives (welcomes and the like skipped)."""
    deadline = time.monotonic() + timeout_s
    while sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        message = decode_dispatch(sock.recv(), accept=TO_WORKER)
        if isinstance(message, cls):
            return message
    raise AssertionError(f"no {cls.__name__} within {timeout_s} s")


class SpanlessStore(SqliteStore):
    """The raw workers send no spans: this store takes a rollout's spans as complete."""

    def missing_spans(self, rollout_id: str) -> str | None:
        return None


class FakeWorker(threading.Thread):
    """A raw worker in a thread: says hello (with ``worker_id``), heartbeats every 0.2 s listing what it runs, and
    answers each ``Run`` with ``Done`` succeeded, except the first ``drop_runs`` ones, which it never receives.
    ``carried``: attempts it ran before reconnecting, listed once and then reported done. ``stuck``: ids it lists
    as busy (a timed-out call's thread) until ``stuck_until``."""

    def __init__(self, endpoint: str, worker_id: str | None = None, drop_runs: int = 0,
                 carried: tuple[str, ...] = (), stuck: tuple[str, ...] = (), stuck_until: float = 0.0):
        super().__init__(daemon=True)
        self.sock = dealer(endpoint)
        self.worker_id, self.drop_runs, self.carried = worker_id, drop_runs, list(carried)
        self.stuck, self.stuck_until = list(stuck), stuck_until
        self.runs: list[tuple[float, Run]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.sock.send(hello(2, **({"worker_id": self.worker_id} if self.worker_id else {})))
            next_beat = 0.0
            while True:
                if time.monotonic() >= next_beat:
                    listed = self.carried + (self.stuck if time.monotonic() < self.stuck_until else [])
                    self.sock.send(beat(listed))
                    for rid in self.carried:  # listed once as running, now reported done
                        self.sock.send(done(rid, reward=0.5))
                    self.carried = []
                    next_beat = time.monotonic() + 0.2
                if not self.sock.poll(20):
                    continue
                message = decode_dispatch(self.sock.recv(), accept=TO_WORKER)
                if isinstance(message, Stop):
                    return
                if isinstance(message, Run):
                    self.runs.append((time.monotonic(), message))
                    if len(self.runs) > self.drop_runs:
                        self.sock.send(done(message.rollout_id, message.attempt, reward=message.task["value"]))
        except BaseException as exc:  # reported to the test
            self.error = exc
        finally:
            self.sock.close()


@pytest.fixture
def make_dispatcher(tmp_path):
    made: list[tuple[Dispatcher, SqliteStore]] = []

    def make(store_class: type[SqliteStore] = SpanlessStore, **config: Any) -> Dispatcher:
        store = store_class(tmp_path / f"lit{len(made)}.sqlite")
        dispatcher = Dispatcher(store, "tcp://127.0.0.1:0", "tcp://127.0.0.1:7373", [NO_LLM.base_url],
                                DispatchConfig(**{"no_worker_timeout_s": 20, **config}), open_to_local_users=True)
        made.append((dispatcher, store))
        return dispatcher

    yield make
    for dispatcher, store in made:
        dispatcher.close()
        store.close()


def run_in_thread(dispatcher: Dispatcher, reqs: list[RolloutRequest]) -> Callable[[], list[Outcome]]:
    """Start ``dispatcher.run(reqs)`` in a thread; the returned function waits for its outcomes."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(_outcomes_or_error(dispatcher, reqs)), daemon=True)
    thread.start()

    def outcomes(timeout_s: float = 30.0) -> list[Outcome]:
        thread.join(timeout_s)
        assert result, f"the dispatcher did not finish within {timeout_s} s"
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    return outcomes


def _outcomes_or_error(dispatcher: Dispatcher, reqs: list[RolloutRequest]) -> Any:
    try:
        return dispatcher.run(reqs)
    except BaseException as exc:
        return exc


# -- hole 1: junk from anyone who reaches the port -----------------------------------------------------------------


def test_junk_from_anyone_is_counted_and_a_good_worker_is_served_after_it(make_dispatcher):
    dispatcher = make_dispatcher(rollout_timeout_s=20)
    bad = dealer(dispatcher.endpoint)
    junk = [
        hello()[:-3],  # truncated MessagePack
        b"",
        wire({"v": 2, "t": "hello", "slots": 1, "pid": 1, "host": "h"}),
        wire({"v": 1, "t": "bogus"}),
        *(hello(slots) for slots in ("4", 1.5, True, 1025, 2**40, 2**64 - 1)),
        hello(host="h" * 100_000),
        hello(pid=-1),
        beat(["x" * 2000]),
        done("r0-a1", error="e" * 100_000),
    ]
    try:
        for frame in junk:
            bad.send(frame)
        bad.send_multipart([b"three", b"part", b"message"])
        deadline = time.monotonic() + 10
        while sum(dispatcher.rejected.values()) < len(junk) + 1 and time.monotonic() < deadline:
            dispatcher._drain(50)
        assert dispatcher.rejected == {"decode": 2, "version": 1, "type": 1, "shape": 10, "parts": 1}
        assert dispatcher.workers == {}  # no hello of these made a worker
        bad.send(wire({"v": 1, "t": "hb", "running": 0}))
        dispatcher._drain(200)
        assert receive(bad, Who, 5) == Who()

        good = FakeWorker(dispatcher.endpoint, worker_id="good")
        good.start()
        dispatcher.wait_for_workers(1, timeout_s=10)
        outcomes = dispatcher.run(requests(4))
        assert [(o.status, o.attempts, o.reward) for o in outcomes] == [
            (RolloutStatus.SUCCEEDED, 1, i / 4) for i in range(4)]
        assert good.error is None
    finally:
        bad.close()


def test_a_message_over_1_mib_is_cut_off_before_the_dispatcher_reads_it(make_dispatcher):
    """zmq.MAXMSGSIZE on the dispatch socket: ZeroMQ drops the connection of a peer whose message is over
    MAX_MESSAGE_BYTES, so the dispatcher never receives (never allocates) it; the next worker is served."""
    from lit_trainer.rollouts.dispatcher import MAX_MESSAGE_BYTES

    dispatcher = make_dispatcher(rollout_timeout_s=20)
    big = dealer(dispatcher.endpoint)
    try:
        big.send(hello(host="h" * (MAX_MESSAGE_BYTES + 1)))
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            dispatcher._drain(50)
        assert dispatcher.rejected == {} and dispatcher.workers == {}  # nothing of it was read
        good = FakeWorker(dispatcher.endpoint, worker_id="good")
        good.start()
        dispatcher.wait_for_workers(1, timeout_s=10)
        [outcome] = dispatcher.run(requests(1))
        assert (outcome.status, outcome.reward) == (RolloutStatus.SUCCEEDED, 0.0) and good.error is None
    finally:
        big.close()


def test_a_done_for_a_rollout_not_running_on_its_sender_is_rejected(make_dispatcher):
    dispatcher = make_dispatcher(rollout_timeout_s=20)
    a, b = dealer(dispatcher.endpoint), dealer(dispatcher.endpoint)
    try:
        a.send(hello())
        b.send(hello())
        dispatcher.wait_for_workers(2, timeout_s=10)
        outcomes = run_in_thread(dispatcher, requests(2))
        run_a, run_b = receive(a, Run), receive(b, Run)
        a.send(done(run_b.rollout_id))  # another worker's rollout
        a.send(done("ghost-a1"))  # no such rollout
        a.send(done(run_a.rollout_id, attempt=2))  # its own rollout, another attempt
        b.send(done(run_b.rollout_id, reward=run_b.task["value"]))
        a.send(done(run_a.rollout_id, reward=run_a.task["value"]))
        assert [(o.status, o.attempts, o.errors) for o in outcomes()] == [(RolloutStatus.SUCCEEDED, 1, [])] * 2
        assert dispatcher.rejected == {"stale": 3}
    finally:
        a.close()
        b.close()


# -- hole 2: a worker that reconnects ------------------------------------------------------------------------------


def test_a_reconnected_worker_keeps_its_running_rollout(make_dispatcher):
    dispatcher = make_dispatcher(worker_timeout_s=2 * FAST, rollout_timeout_s=4 * FAST)
    first = dealer(dispatcher.endpoint)
    first.send(hello(worker_id="w-1"))
    dispatcher.wait_for_workers(1, timeout_s=10)
    outcomes = run_in_thread(dispatcher, requests(1))
    assert receive(first, Run).rollout_id == "r0-a1"
    first.close()  # its next connection has a new ZeroMQ identity
    gone = time.monotonic()
    again = FakeWorker(dispatcher.endpoint, worker_id="w-1", carried=("r0-a1",))
    again.start()
    [outcome] = outcomes()
    assert time.monotonic() - gone < FAST
    assert (outcome.status, outcome.rollout_id, outcome.reward, outcome.errors) == (
        RolloutStatus.SUCCEEDED, "r0-a1", 0.5, [])
    assert [w.worker_id for w in dispatcher.workers.values()] == ["w-1"] and again.runs == []
    assert again.error is None


def test_a_rollout_a_reconnected_worker_no_longer_runs_is_retried_at_once(make_dispatcher):
    dispatcher = make_dispatcher(worker_timeout_s=2 * FAST, rollout_timeout_s=4 * FAST)
    first = dealer(dispatcher.endpoint)
    first.send(hello(worker_id="w-1"))
    dispatcher.wait_for_workers(1, timeout_s=10)
    outcomes = run_in_thread(dispatcher, requests(1))
    assert receive(first, Run).rollout_id == "r0-a1"
    first.send(beat(["r0-a1"]))  # it runs it... then its connection breaks, and its report with it
    wait_until(lambda: any(w.listed == {"r0-a1"} for w in list(dispatcher.workers.values())),
               "the dispatcher read the heartbeat that lists the rollout")
    first.close()
    gone = time.monotonic()
    again = FakeWorker(dispatcher.endpoint, worker_id="w-1")
    again.start()
    [outcome] = outcomes()
    assert time.monotonic() - gone < FAST
    assert (outcome.status, outcome.rollout_id, outcome.attempts) == (RolloutStatus.SUCCEEDED, "r0-a2", 2)
    assert "no longer runs it and sent no result" in outcome.errors[0]
    assert [r.rollout_id for _, r in again.runs] == ["r0-a2"] and again.error is None


class Proxy(threading.Thread):
    """A TCP forwarder in front of the dispatcher; ``cut()`` breaks every connection through it, as a network blip
    does (the listener stays, so the worker's socket reconnects, and the dispatcher sees a new ZeroMQ identity)."""

    def __init__(self, endpoint: str):
        super().__init__(daemon=True)
        self.target = ("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections: list[socket.socket] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            client.settimeout(None)
            upstream = socket.create_connection(self.target)
            self.connections += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()
        self.listener.close()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass

    def cut(self) -> None:
        for sock in self.connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self.connections = []


async def sleeps_then_returns(task, llm):
    await asyncio.sleep(1.5)
    return 1.0


def test_a_real_worker_whose_connection_breaks_mid_rollout_reports_it_done(make_dispatcher, monkeypatch, tmp_path):
    monkeypatch.setenv("LIT_SPOOL_DIR", str(tmp_path / "spool"))
    monkeypatch.setenv("LIT_FRAMEWORKS", "none")
    monkeypatch.setenv("LIT_FLUSH_TIMEOUT", "0.1")
    dispatcher = make_dispatcher(worker_timeout_s=2 * FAST, rollout_timeout_s=4 * FAST)
    proxy = Proxy(dispatcher.endpoint)
    proxy.start()
    worker = Worker(sleeps_then_returns, proxy.endpoint, concurrency=1, heartbeat_s=0.1)
    thread = threading.Thread(target=lambda: asyncio.run(worker.run()), daemon=True)
    thread.start()
    try:
        dispatcher.wait_for_workers(1, timeout_s=10)
        [before] = dispatcher.workers
        outcomes = run_in_thread(dispatcher, requests(1))
        wait_until(lambda: any(w.listed for w in list(dispatcher.workers.values())),
                   "the worker's heartbeat lists the rollout it runs")
        proxy.cut()
        cut = time.monotonic()
        [outcome] = outcomes()
        assert time.monotonic() - cut < FAST
        assert (outcome.status, outcome.rollout_id, outcome.reward, outcome.errors) == (
            RolloutStatus.SUCCEEDED, "r0-a1", 1.0, [])
        [(after, known)] = dispatcher.workers.items()
        assert after != before and known.worker_id == worker.worker_id  # the same worker, on a new connection
    finally:
        dispatcher.close()
        thread.join(10)
        lit.uninstrument()
        proxy.stopped.set()
        proxy.cut()
    assert not thread.is_alive()


# -- hole 3: a lost run message ------------------------------------------------------------------------------------


def test_a_lost_run_message_is_retried_within_a_few_heartbeats(make_dispatcher):
    dispatcher = make_dispatcher(rollout_timeout_s=2 * FAST)
    worker = FakeWorker(dispatcher.endpoint, worker_id="w-1", drop_runs=1)
    worker.start()
    dispatcher.wait_for_workers(1, timeout_s=10)
    start = time.monotonic()
    [outcome] = dispatcher.run(requests(1))
    assert time.monotonic() - start < FAST
    assert (outcome.status, outcome.rollout_id, outcome.attempts) == (RolloutStatus.SUCCEEDED, "r0-a2", 2)
    assert "never started it (3 heartbeats did not list it" in outcome.errors[0]
    rows = dispatcher.store.rollouts_of_step(0)
    assert [(r.rollout_id, r.status) for r in rows] == [("r0-a1", RolloutStatus.FAILED),
                                                         ("r0-a2", RolloutStatus.SUCCEEDED)]


async def hogs_the_event_loop(task, llm):
    time.sleep(0.3)  # an async agent working without awaiting: the worker's event loop runs nothing else meanwhile
    return 1.0


def test_runs_a_busy_worker_has_not_read_yet_are_not_taken_for_lost(make_dispatcher, monkeypatch, tmp_path):
    """Run messages wait in the worker's socket while its event loop runs agents; its heartbeats must not say it
    lacks them (measured on calc: the last of 32 Runs failed as "never started" while the worker ran it)."""
    monkeypatch.setenv("LIT_SPOOL_DIR", str(tmp_path / "spool"))
    monkeypatch.setenv("LIT_FRAMEWORKS", "none")
    monkeypatch.setenv("LIT_FLUSH_TIMEOUT", "0.1")
    dispatcher = make_dispatcher(rollout_timeout_s=30)
    worker = Worker(hogs_the_event_loop, dispatcher.endpoint, concurrency=6, heartbeat_s=0.05)
    thread = threading.Thread(target=lambda: asyncio.run(worker.run()), daemon=True)
    thread.start()
    try:
        dispatcher.wait_for_workers(1, timeout_s=10)
        outcomes = dispatcher.run(requests(6))
        assert [(o.status, o.attempts, o.errors) for o in outcomes] == [(RolloutStatus.SUCCEEDED, 1, [])] * 6
        assert dispatcher.rejected == {}
    finally:
        dispatcher.close()
        thread.join(10)
        lit.uninstrument()
    assert not thread.is_alive()


def test_a_slot_a_worker_lists_as_busy_gets_no_rollout_until_freed(make_dispatcher):
    """A timed-out sync call's thread still runs on the worker: the trainer does not hand that slot out."""
    dispatcher = make_dispatcher()
    free_at = time.monotonic() + 1.5
    worker = FakeWorker(dispatcher.endpoint, worker_id="w-1", stuck=("old-a1", "old-a2"), stuck_until=free_at)
    worker.start()
    dispatcher.wait_for_workers(1, timeout_s=10)
    [known] = dispatcher.workers.values()
    while not known.listed:
        dispatcher._drain(50)
    [outcome] = dispatcher.run(requests(1))
    assert outcome.status is RolloutStatus.SUCCEEDED
    [(received, _)] = worker.runs
    assert received >= free_at


# -- hole 4: sync agents get threads of their own ------------------------------------------------------------------


class TrainerStandIn:
    """A raw ROUTER playing the trainer for one in-process ``Worker``: sends it messages, collects its own."""

    def __init__(self, fn: Callable[..., Any], **worker_args: Any):
        self.router = zmq.Context.instance().socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.worker = Worker(fn, f"tcp://127.0.0.1:{port}", heartbeat_s=0.1, **worker_args)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.worker.run()), daemon=True)
        self.thread.start()
        assert self.router.poll(10_000), "the worker did not say hello"
        self.identity, _ = self.router.recv_multipart()
        self.beats: list[Heartbeat] = []

    def send(self, message: Any) -> None:
        self.router.send_multipart([self.identity, encode_dispatch(message)])

    def dones(self, n: int, timeout_s: float) -> list[Done]:
        out: list[Done] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < n and self.router.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            message = decode_dispatch(self.router.recv_multipart()[1], accept=TO_TRAINER)
            if isinstance(message, Done):
                out.append(message)
            elif isinstance(message, Heartbeat):
                self.beats.append(message)
        return out

    def close(self) -> None:
        self.send(Stop())
        self.thread.join(10)
        self.router.close()
        assert not self.thread.is_alive()


def run_message(rid: str, task: Any, timeout_s: float) -> Run:
    return Run(rid, "t", 1, task, NO_LLM.to_dict(), timeout_s)


def test_sync_agents_get_concurrency_threads_and_queue_time_is_not_timed():
    n = min(32, (os.cpu_count() or 1) + 4) + 2  # more than asyncio's default executor has threads

    def sleeps(task, llm):
        time.sleep(1.0)
        return 1.0

    trainer = TrainerStandIn(sleeps, concurrency=n)
    try:
        for i in range(n):
            trainer.send(run_message(f"r{i}-a1", {}, 1.5))
        dones = trainer.dones(n, timeout_s=20)
        assert sorted((d.rollout_id, d.status) for d in dones) == sorted((f"r{i}-a1", "succeeded") for i in range(n))
    finally:
        trainer.close()


def test_a_timed_out_sync_call_keeps_its_thread_and_is_listed_until_it_ends():
    lock, active, peak = threading.Lock(), [0], [0]

    def sleeps(task, llm):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            time.sleep(task["s"])
        finally:
            with lock:
                active[0] -= 1
        return 1.0

    trainer = TrainerStandIn(sleeps, concurrency=2)
    try:
        trainer.send(run_message("slow-a1", {"s": 2.0}, 0.3))
        [slow] = trainer.dones(1, timeout_s=5)
        assert (slow.status, slow.error) == ("timed_out", "the rollout ran past its timeout of 0.3 s")
        trainer.beats.clear()
        sent = time.monotonic()
        trainer.send(run_message("q1-a1", {"s": 0.5}, 5.0))
        trainer.send(run_message("q2-a1", {"s": 0.5}, 5.0))
        quick = trainer.dones(2, timeout_s=10)
        assert sorted((d.rollout_id, d.status) for d in quick) == [("q1-a1", "succeeded"), ("q2-a1", "succeeded")]
        assert peak[0] == 2  # the stuck thread and one quick call at a time: the other waited for the thread,
        assert time.monotonic() - sent >= 0.95  # and its wait did not count against its timeout
        assert all("slow-a1" in (b.rollouts or ()) for b in trainer.beats)  # listed while its thread runs...
        trainer.dones(1, timeout_s=1.5)  # (more heartbeats, past the end of its thread)
        assert "slow-a1" not in (trainer.beats[-1].rollouts or ())  # ...and not once it ended
    finally:
        trainer.close()


# -- hole 5: the worker reports what its flush says ----------------------------------------------------------------


class CollectorStandIn(threading.Thread):
    """A collector that never acknowledges (``answer=False``) or refuses every frame (``answer=True``)."""

    def __init__(self, answer: bool):
        super().__init__(daemon=True)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.answer, self.frames, self.stopped = answer, 0, threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            if self.sock.poll(20):
                identity, *_, data = self.sock.recv_multipart()
                self.frames += 1
                if self.answer:
                    self.sock.send_multipart([identity, encode_nack(decode_frame(data).batch, "refused on purpose")])
        self.sock.close()


@lit.trace
def traced_agent(task, llm):
    return 1.0


@pytest.mark.parametrize(("answer", "worker_args", "words"), [
    (False, {"flush_timeout_s": 0.5}, "the agent returned, but its spans were not all delivered within 0.5 s"),
    (True, {}, "the agent returned, but spans of this process were dropped or refused by the collector "
     "while it ran (1 of them"),
], ids=["never_acked", "refused"])
def test_a_rollout_whose_spans_are_not_delivered_is_failed(answer, worker_args, words, monkeypatch, tmp_path,
                                                           caplog):
    caplog.set_level(logging.CRITICAL, logger="lit")
    monkeypatch.setenv("LIT_SPOOL_DIR", str(tmp_path / "spool"))
    monkeypatch.setenv("LIT_FRAMEWORKS", "none")
    monkeypatch.setenv("LIT_FLUSH_TIMEOUT", "0.1")
    collector = CollectorStandIn(answer)
    collector.start()
    trainer = TrainerStandIn(traced_agent, concurrency=1, **worker_args)
    try:
        trainer.send(Welcome(collector.endpoint))
        trainer.send(run_message("r0-a1", {}, 5.0))
        [report] = trainer.dones(1, timeout_s=10)
        assert (report.rollout_id, report.status, report.reward) == ("r0-a1", "failed", None)
        assert report.error is not None and report.error.startswith(words), report.error
        assert collector.frames >= 1
    finally:
        trainer.close()
        lit.uninstrument()
        collector.stopped.set()
        collector.join(5)


# -- hole 6: a rollout whose spans the store lacks -----------------------------------------------------------------


class GappyStore(SqliteStore):
    """A store that finds spans of every first attempt missing."""

    def missing_spans(self, rollout_id: str) -> str | None:
        return "3 of 5 spans stored" if rollout_id.endswith("-a1") else None


def test_a_succeeded_rollout_with_spans_missing_is_failed_and_retried(make_dispatcher):
    dispatcher = make_dispatcher(GappyStore, max_attempts=2)
    worker = FakeWorker(dispatcher.endpoint, worker_id="w-1")
    worker.start()
    dispatcher.wait_for_workers(1, timeout_s=10)
    outcomes = dispatcher.run(requests(2))
    assert [(o.status, o.rollout_id, o.reward) for o in outcomes] == [
        (RolloutStatus.SUCCEEDED, "r0-a2", 0.0), (RolloutStatus.SUCCEEDED, "r1-a2", 0.25)]
    assert outcomes[0].errors == ["attempt 1: the worker reported success, but 3 of 5 spans stored"]
    rows = {r.rollout_id: r for r in dispatcher.store.rollouts_of_step(0)}
    assert rows["r0-a1"].status is RolloutStatus.FAILED and rows["r0-a1"].error.endswith("3 of 5 spans stored")
    assert rows["r0-a2"].status is RolloutStatus.SUCCEEDED


def test_what_check_raises_stops_run(make_dispatcher):
    dispatcher = make_dispatcher(rollout_timeout_s=20)
    silent = dealer(dispatcher.endpoint)  # a worker that takes the rollout and never answers
    silent.send(hello())
    dispatcher.wait_for_workers(1, timeout_s=10)
    calls = []

    def check() -> None:
        calls.append(time.monotonic())
        if len(calls) == 5:
            raise RuntimeError("the collector stopped: disk full")

    try:
        with pytest.raises(RuntimeError, match="disk full"):
            dispatcher.run(requests(1), check=check)
        assert all(not w.running for w in dispatcher.workers.values())
    finally:
        silent.close()


# -- only workers with the client key connect ---------------------------------------------------------------------

def test_with_keys_only_workers_holding_the_client_key_take_rollouts(tmp_path):
    """Hole: anyone reaching the dispatch port could say hello with many slots and take every task. With keys a
    real worker process holding the client key runs the rollouts; a peer without it is refused at the handshake,
    counted, and never becomes a worker."""
    from pathlib import Path

    from lit_sdk.protocol import security
    from lit_sdk.worker import spawn
    from lit_trainer.intake.collector import Collector
    from lit_trainer.run.services import stop_workers

    security.generate_keys(tmp_path / "keys")
    keys = security.load_server_keys(tmp_path / "keys")
    tests = Path(__file__).parents[2]
    with SqliteStore(tmp_path / "lit.sqlite") as store, \
            Collector(store, "tcp://127.0.0.1:0", keys=keys) as collector:
        dispatcher = Dispatcher(store, "tcp://127.0.0.1:0", collector.endpoint, [NO_LLM.base_url], keys=keys)
        rogue = zmq.Context.instance().socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(dispatcher.endpoint)
        rogue.send(hello(slots=1024))
        env = {**os.environ, "PYTHONPATH": str(tests), "LIT_SPOOL_DIR": str(tmp_path / "spool"),
               "LIT_KEYS_DIR": str(tmp_path / "keys")}
        procs = [spawn("rollout_agents:returns_task_value", dispatcher.endpoint, 4, env)]
        try:
            dispatcher.wait_for_workers(1, timeout_s=60)
            requests = [RolloutRequest(f"r{i}", f"t{i}", {"value": i}, NO_LLM, 0) for i in range(8)]
            outcomes = dispatcher.run(requests)
            assert [o.status for o in outcomes] == [RolloutStatus.SUCCEEDED] * 8
            assert len(dispatcher.workers) == 1 and not rogue.poll(100), "the rogue peer got in"
            assert sum(dispatcher.refused_peers.values()) >= 1, dispatcher.refused_peers
            assert all(store.missing_spans(o.rollout_id) is None for o in outcomes)  # spans came over CURVE too
        finally:
            rogue.close()
            stop_workers(dispatcher, procs)
