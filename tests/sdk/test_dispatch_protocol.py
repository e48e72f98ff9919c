"""The dispatch channel's messages: exact round trips, every kind of bad message refused with its kind and a
readable reason, and both ends (a real ``Dispatcher``, a real ``Worker``) ignoring bad messages on real ZeroMQ
sockets and going on serving."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time

import msgpack
import pytest
import zmq

from lit_sdk import _context
from lit_sdk.protocol.codec import MAX_FRAME_BYTES, VERSION, ProtocolError
from lit_sdk.protocol.dispatch import (
    TO_TRAINER,
    TO_WORKER,
    Bye,
    Done,
    Heartbeat,
    Hello,
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
from lit_trainer.rollouts.attempts import RolloutRequest
from lit_trainer.rollouts.dispatcher import DispatchConfig, Dispatcher

LLM_DICT = LLM("http://127.0.0.1:9/v1", "m", temperature=0.0, max_tokens=16).to_dict()
MESSAGES = [
    Hello(4, 1234, "host-a"),
    Hello(1024, 1, "h", "h:1:0123abcd"),
    Heartbeat(0),
    Heartbeat(7),
    Heartbeat(2, ["r0-a1", "r1-a2"]),
    Heartbeat(0, []),
    Done("r0-a1", 1, "succeeded", 0.5, None),
    Done("r0-a2", 2, "failed", None, "RuntimeError: agent bug"),
    Done("r0-a3", 3, "timed_out"),
    Bye("SIGTERM"),
    Welcome("tcp://127.0.0.1:7373", ["http://127.0.0.1:8000/v1", "http://gpu-2:8000/v1"]),
    Welcome("tcp://0.0.0.0:7373"),
    Run("r0-a1", "task0", 1, {"id": 1, "nested": [1, "a", None, {"k": 2.5}], "blob": b"\x00\xff"}, LLM_DICT,
        300.0, "7"),
    Run("r1-a2", "task1", 2, "a plain string task", LLM_DICT, 0.5),
    Who(),
    Stop(),
]


def wire(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_exactly(message):
    data = encode_dispatch(message)
    decoded = decode_dispatch(data)
    assert decoded == message and type(decoded) is type(message)
    frame = msgpack.unpackb(data, raw=False)
    assert frame["v"] == VERSION and frame["t"] == message.TAG
    assert set(frame) == {"v", "t", *(f.name for f in dataclasses.fields(message))}


def test_texts_the_trainer_logs_arrive_without_control_characters():
    """Hole: a worker's host name, its bye and a rollout's error reached the trainer's log as sent, so a peer could
    forge log lines (a carriage return, a newline) or send a terminal its escape sequences. They arrive written out
    now; an error keeps its newlines and tabs (tracebacks)."""
    hello = decode_dispatch(encode_dispatch(Hello(4, 1, "gpu-1\rlit: training finished\n\x1b[2J")))
    assert hello.host == "gpu-1\\x0dlit: training finished\\x0a\\x1b[2J"
    done = decode_dispatch(encode_dispatch(Done("r0-a1", 1, "failed", None, "Traceback:\n\tline\x1b[31m\x9b")))
    assert done.error == "Traceback:\n\tline\\x1b[31m\\x9b"
    assert decode_dispatch(encode_dispatch(Bye("SIGTERM\x07"))).reason == "SIGTERM\\x07"


def test_the_wire_tags_are_those_of_before():
    assert [cls.TAG for cls in TO_TRAINER] == ["hello", "hb", "done", "bye"]
    assert [cls.TAG for cls in TO_WORKER] == ["welcome", "run", "who", "stop"]


def test_optional_fields_may_be_left_out_and_unknown_ones_are_ignored():
    assert decode_dispatch(wire({"v": 1, "t": "done", "rollout_id": "r", "attempt": 1, "status": "failed"})) == \
        Done("r", 1, "failed", None, None)
    assert decode_dispatch(wire({"v": 1, "t": "welcome", "spans_endpoint": "tcp://h:1"})) == Welcome("tcp://h:1", [])
    assert decode_dispatch(wire({"v": 1, "t": "hb", "running": 2, "added_later": {"x": 1}})) == Heartbeat(2)
    # A worker from before worker_id and rollouts: still understood
    assert decode_dispatch(wire({"v": 1, "t": "hello", "slots": 2, "pid": 1, "host": "h"})) == Hello(2, 1, "h", None)
    assert decode_dispatch(wire({"v": 1, "t": "hb", "running": 2})).rollouts is None
    run = decode_dispatch(wire({"v": 1, "t": "run", "rollout_id": "r", "task_id": "t", "attempt": 1, "task": None,
                                "llm": {}, "timeout_s": 300}))
    assert run == Run("r", "t", 1, None, {}, 300.0, None) and type(run.timeout_s) is float


def hello(**changes) -> bytes:
    return wire({"v": 1, "t": "hello", "slots": 2, "pid": 1, "host": "h", **changes})


def run(**changes) -> bytes:
    return wire({"v": 1, "t": "run", "rollout_id": "r", "task_id": "t", "attempt": 1, "task": {}, "llm": {},
                 "timeout_s": 1.0, **changes})


def done(**changes) -> bytes:
    return wire({"v": 1, "t": "done", "rollout_id": "r", "attempt": 1, "status": "succeeded", **changes})


BAD = [
    (b"\xc1 not msgpack", "decode", "not a MessagePack frame"),
    (hello()[:-2], "decode", "not a MessagePack frame"),
    (wire([1, 2]), "shape", "a frame is a map, got list"),
    (wire("hello"), "shape", "a frame is a map, got str 'hello'"),
    (wire({"t": "hb", "running": 0}), "version", "the frame carries no protocol version 'v'"),
    (wire({"v": 2, "t": "hb", "running": 0}), "version", "protocol version 2 is not supported (this side speaks 1)"),
    (wire({"v": "1", "t": "hb", "running": 0}), "version", "protocol version '1' is not supported"),
    (wire({"v": True, "t": "hb", "running": 0}), "version", "protocol version True is not supported"),
    (wire({"v": 1, "t": "bogus"}), "type",
     "unknown dispatch message type 'bogus' (known: hello, hb, done, bye, welcome"),
    (wire({"v": 1}), "type", "unknown dispatch message type None"),
    (wire({"v": 1, "t": "hello", "slots": 2, "pid": 1}), "shape", "a 'hello' message lacks its field 'host'"),
    (hello(slots="x"), "shape", "'hello' field 'slots' must be an integer, got 'x' (a string)"),
    (hello(slots=True), "shape", "'hello' field 'slots' must be an integer, got True (a boolean)"),
    (hello(slots=1.5), "shape", "'slots' must be an integer, got 1.5 (a number)"),
    (hello(slots=0), "shape", "'hello' field 'slots' must be between 1 and 1024, got 0 (an integer)"),
    (hello(slots=-4), "shape", "'slots' must be between 1 and 1024, got -4"),
    (hello(slots=1025), "shape", "'slots' must be between 1 and 1024, got 1025"),
    (hello(slots=2**64 - 1), "shape", "'slots' must be between 1 and 1024, got 18446744073709551615"),
    (hello(pid=-1), "shape", "'pid' must be between 0 and 4294967295, got -1"),
    (hello(host="h" * 256), "shape", "'host' must be 0 to 255 characters long, got 'hhh"),
    (hello(worker_id=""), "shape", "'worker_id' must be 1 to 1024 characters long, got ''"),
    (hello(worker_id=7), "shape", "'worker_id' must be a string or nil, got 7 (an integer)"),
    (hello(pid=None), "shape", "'pid' must be an integer, got nil"),
    (hello(host=b"h"), "shape", "'host' must be a string, got b'h' (binary)"),
    (wire({"v": 1, "t": "hb", "running": -1}), "shape", "'running' must be between 0 and 4096"),
    (wire({"v": 1, "t": "hb", "running": 0, "rollouts": "r-a1"}), "shape",
     "'rollouts' must be a list of strings or nil, got 'r-a1' (a string)"),
    (wire({"v": 1, "t": "hb", "running": 0, "rollouts": ["r-a1", 1]}), "shape", "a list of strings or nil"),
    (wire({"v": 1, "t": "hb", "running": 0, "rollouts": [""]}), "shape",
     "'rollouts' must be at most 4096 ids of 1 to 1024 characters"),
    (wire({"v": 1, "t": "hb", "running": 0, "rollouts": ["r"] * 4097}), "shape", "at most 4096 ids"),
    (done(rollout_id="r" * 1025), "shape", "'rollout_id' must be 1 to 1024 characters long"),
    (done(error="e" * 8193), "shape", "'error' must be 0 to 8192 characters long"),
    (done(attempt=2**31), "shape", "'attempt' must be between 1 and 2147483647"),
    (done(status="ok"), "shape", "'status' must be one of succeeded, failed, timed_out, got 'ok'"),
    (done(status=None), "shape", "'status' must be a string, got nil"),
    (done(attempt=0), "shape", "'attempt' must be between 1 and 2147483647"),
    (done(reward="1.0"), "shape", "'reward' must be a number or nil, got '1.0' (a string)"),
    (done(reward=False), "shape", "'reward' must be a number or nil, got False (a boolean)"),
    (done(error=3), "shape", "'error' must be a string or nil, got 3 (an integer)"),
    (wire({"v": 1, "t": "bye"}), "shape", "a 'bye' message lacks its field 'reason'"),
    (wire({"v": 1, "t": "bye", "reason": "r" * 8193}), "shape", "'reason' must be 0 to 8192 characters long"),
    (wire({"v": 1, "t": "welcome", "spans_endpoint": "x", "llm_base_urls": ["a", 3]}), "shape",
     "'llm_base_urls' must be a list of strings, got a list"),
    (wire({"v": 1, "t": "welcome", "spans_endpoint": "x", "llm_base_urls": "a"}), "shape",
     "'llm_base_urls' must be a list of strings, got 'a' (a string)"),
    (run(llm=[]), "shape", "'run' field 'llm' must be a map, got a list"),
    (run(timeout_s=0), "shape", "'timeout_s' must be positive and finite, got 0"),
    (run(timeout_s=float("inf")), "shape", "'timeout_s' must be positive and finite, got inf"),
    (run(timeout_s=True), "shape", "'timeout_s' must be a number, got True"),
    (run(weight_version=7), "shape", "'weight_version' must be a string or nil, got 7"),
    (wire({"v": 1, "t": "hb", "running": 0, "pad": b"x" * MAX_FRAME_BYTES}), "too_large",
     f"over the {MAX_FRAME_BYTES} byte limit"),
]


@pytest.mark.parametrize(("data", "kind", "words"), BAD, ids=[f"{i}-{kind}" for i, (_, kind, _) in enumerate(BAD)])
def test_bad_messages_are_refused_with_their_kind_and_reason(data, kind, words):
    with pytest.raises(ProtocolError) as info:
        decode_dispatch(data)
    assert info.value.kind == kind
    assert words in str(info.value)


def test_a_message_going_the_other_way_is_refused():
    with pytest.raises(ProtocolError, match="a 'hello' message goes worker → trainer") as info:
        decode_dispatch(encode_dispatch(Hello(1, 1, "h")), accept=TO_WORKER)
    assert info.value.kind == "type"
    with pytest.raises(ProtocolError, match="a 'stop' message goes trainer → worker"):
        decode_dispatch(encode_dispatch(Stop()), accept=TO_TRAINER)


def test_only_dispatch_messages_encode():
    with pytest.raises(TypeError, match="not a dispatch message: dict"):
        encode_dispatch({"t": "hello"})


# -- real sockets --------------------------------------------------------------------------------------------------


def receive(sock: zmq.Socket, timeout_s: float = 10.0):
    assert sock.poll(int(timeout_s * 1000)), "no message within the timeout"
    return decode_dispatch(sock.recv(), accept=TO_WORKER)


def fake_worker(endpoint: str, seen: list) -> None:
    """A well-behaved worker speaking the protocol by hand: runs every rollout, rewarding the task's value."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(encode_dispatch(Hello(2, 4242, "good-host")))
        while True:
            message = receive(sock)
            seen.append(message)
            if isinstance(message, Run):
                sock.send(encode_dispatch(Done(message.rollout_id, message.attempt, "succeeded",
                                               float(message.task["value"]))))
            elif isinstance(message, Stop):
                return
    except BaseException as exc:  # reported to the test thread
        seen.append(exc)
    finally:
        sock.close()


class SpanlessStore(SqliteStore):
    """The fake worker sends no spans: this store does not check that a rollout's spans are all there."""

    def missing_spans(self, rollout_id: str) -> str | None:
        return None


def test_the_dispatcher_ignores_bad_messages_and_serves_a_good_worker_after_them(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="lit")
    store = SpanlessStore(tmp_path / "lit.sqlite")
    dispatcher = Dispatcher(store, "tcp://127.0.0.1:0", "tcp://127.0.0.1:7373", ["http://127.0.0.1:9/v1"],
                            DispatchConfig(no_worker_timeout_s=20, rollout_timeout_s=20), open_to_local_users=True)
    bad = zmq.Context.instance().socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.connect(dispatcher.endpoint)
    worker = None
    try:
        bad.send(b"\xc1 garbage")
        for slots in (0, "x", True):
            bad.send(hello(slots=slots))
        bad.send_multipart([b"two", b"frames"])  # the ROUTER reads 3 parts: identity and these
        bad.send(encode_dispatch(Welcome("tcp://x:1")))  # a trainer's message, sent to the trainer
        bad.send(wire({"v": 9, "t": "hello", "slots": 1, "pid": 1, "host": "h"}))
        deadline = time.monotonic() + 10
        while sum(dispatcher.rejected.values()) < 7 and time.monotonic() < deadline:
            dispatcher._drain(50)
        assert dispatcher.rejected == {"decode": 1, "shape": 3, "parts": 1, "type": 1, "version": 1}
        assert dispatcher.workers == {}  # no bad hello made a worker
        logged = [r.getMessage() for r in caplog.records if "bad message from a worker" in r.getMessage()]
        assert len(logged) == 5
        assert any("(shape): 'hello' field 'slots' must be between 1 and 1024" in m for m in logged)
        assert any("(parts): a worker's message is one ZeroMQ frame, got 2" in m for m in logged)

        # The refused worker is unknown: its heartbeat is answered with "who".
        bad.send(encode_dispatch(Heartbeat(0)))
        dispatcher._drain(200)
        assert receive(bad, 5) == Who()

        seen: list = []
        worker = threading.Thread(target=fake_worker, args=(dispatcher.endpoint, seen), daemon=True)
        worker.start()
        dispatcher.wait_for_workers(1, timeout_s=10)
        [(_, known)] = dispatcher.workers.items()
        assert known.slots == 2 and known.label == "good-host:4242"
        requests = [RolloutRequest(f"r{i}", f"task{i}", {"value": i / 4}, LLM.from_dict(LLM_DICT), 0)
                    for i in range(5)]
        outcomes = dispatcher.run(requests)
        assert [o.status for o in outcomes] == [RolloutStatus.SUCCEEDED] * 5
        assert [o.reward for o in outcomes] == [i / 4 for i in range(5)]
        assert seen[0] == Welcome("tcp://127.0.0.1:7373", ["http://127.0.0.1:9/v1"])
        runs = [m for m in seen if isinstance(m, Run)]
        assert sorted(r.rollout_id for r in runs) == [f"r{i}-a1" for i in range(5)]
        assert runs[0].llm == LLM_DICT and runs[0].timeout_s == 20.0 and runs[0].attempt == 1
    finally:
        dispatcher.close()
        if worker is not None:
            worker.join(10)
        bad.close()
        store.close()
    assert not worker.is_alive() and isinstance(seen[-1], Stop), seen[-1]


def test_the_worker_ignores_bad_messages_and_runs_the_good_one(caplog):
    caplog.set_level(logging.WARNING, logger="lit")
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    assigned = []

    def agent(task, llm):
        assigned.append((_context._assigned.get(), llm))
        return task["x"] * 2

    result: list = []
    thread = threading.Thread(target=lambda: result.append(
        asyncio.run(Worker(agent, f"tcp://127.0.0.1:{port}", concurrency=3, heartbeat_s=0.2).run())), daemon=True)
    thread.start()
    try:
        assert router.poll(10_000)
        identity, data = router.recv_multipart()
        hello_ = decode_dispatch(data)
        assert isinstance(hello_, Hello) and (hello_.slots, hello_.pid) == (3, os.getpid())
        for junk in (b"\xc1", encode_dispatch(Hello(1, 1, "h")), run(llm=[]), wire({"v": 1, "t": "run"})):
            router.send_multipart([identity, junk])
        router.send_multipart([identity, encode_dispatch(Run("r-a1", "t7", 2, {"x": 1.25}, LLM_DICT, 5.0, "w3"))])
        deadline = time.monotonic() + 10
        while True:
            assert router.poll(max(1, int((deadline - time.monotonic()) * 1000))), "no done within 10 s"
            message = decode_dispatch(router.recv_multipart()[1], accept=TO_TRAINER)
            if isinstance(message, Done):
                break
            assert isinstance(message, Heartbeat)
        assert message == Done("r-a1", 2, "succeeded", 2.5, None)
        [(rollout, llm)] = assigned
        assert (rollout.rollout_id, rollout.task_id, rollout.attempt, rollout.weight_version) == ("r-a1", "t7", 2, "w3")
        assert llm == LLM.from_dict(LLM_DICT)
        router.send_multipart([identity, encode_dispatch(Stop())])
        thread.join(10)
        assert result == [1]
    finally:
        router.close()
    logged = [r.getMessage() for r in caplog.records if "bad message from the trainer" in r.getMessage()]
    assert len(logged) == 4
    assert "(type): a 'hello' message goes worker → trainer" in logged[1]
    assert "(shape): 'run' field 'llm' must be a map, got a list" in logged[2]
