"""The span sender against a real ZeroMQ ack server: nothing is lost while the trainer is up, down, silent or
restarting, or when the process dies with spans in its spool; whatever must be dropped is counted and logged."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from ack_server import NACK, NACK_REASON, SILENT, AckServer

from lit_sdk import protocol
from lit_sdk._spool_files import scan
from lit_sdk.delivery import DeliveryCounts
from lit_sdk.sender import SpanSender

pytestmark = pytest.mark.timeout(30)


def span(i: int) -> dict:
    return protocol.SpanRecord(
        trace_id=f"{i // 10 + 1:032x}", span_id=f"{i + 1:016x}", parent_id=None, name=f"step-{i}",
        start_ns=i, end_ns=i + 1, rollout_id="r1", attributes={"lit.test.i": i},
    ).to_wire()


def ids(indices: range) -> set[str]:
    return {f"{i + 1:016x}" for i in indices}


def counts(**changes: int) -> DeliveryCounts:
    fields = ("submitted", "sent", "acknowledged", "duplicates", "spooled", "rejected", "dropped", "pending")
    return DeliveryCounts(**{**dict.fromkeys(fields, 0), **changes})


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def segments(spool: Path) -> list[Path]:
    return sorted(spool.glob("*.seg")) if spool.is_dir() else []


def spans_on_disk(spool: Path) -> int:
    """Records left in the spool's segments (a live sender keeps the one it writes, emptied once settled)."""
    return sum(len(scan(path)[0]) for path in segments(spool))


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    return int(child.stdout)


def orphan(files: list[Path], pid: int) -> None:
    """Make spool segments (of a sender that shut down) look left behind by process ``pid`` of this host."""
    for path in files:
        host, _, token, seq = path.name.rsplit("-", 3)
        path.rename(path.with_name(f"{host}-{pid}-{token}-{seq}"))


@pytest.fixture
def server():
    srv = AckServer().start()
    yield srv
    srv.stop()


@pytest.fixture
def down_server():
    """A server that has a port but is not running (start() brings it up)."""
    srv = AckServer().start()
    srv.stop()
    yield srv
    srv.stop()


@pytest.fixture
def spool(tmp_path) -> Path:
    return tmp_path / "spool"


@pytest.fixture
def make_sender(spool):
    senders: list[SpanSender] = []

    def make(endpoint: str, **settings) -> SpanSender:
        settings = {"spool_dir": spool, "linger_s": 0.01, "ack_timeout_s": 0.2, **settings}
        sender = SpanSender(endpoint, **settings)
        senders.append(sender)
        return sender

    yield make
    for sender in senders:
        sender.shutdown(timeout=0)


def test_all_spans_from_several_threads_arrive_and_are_acknowledged(server, make_sender):
    # acks may take longer than the fixture's 0.2 s on a busy machine (the suite runs two workers), and a batch sent
    # again arrives twice; the collector's dropping of such duplicates has its own test, this one wants none sent
    sender = make_sender(server.endpoint, max_batch_spans=64, ack_timeout_s=5.0)
    threads = [
        threading.Thread(target=lambda k=k: [sender.submit(span(i)) for i in range(k * 250, (k + 1) * 250)])
        for k in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sender.flush(timeout=5) == counts(submitted=1000, sent=1000, acknowledged=1000)
    assert server.span_ids() == ids(range(1000))
    assert server.duplicates == 0
    assert sorted(server.spans(), key=lambda s: s["span_id"]) == [span(i) for i in range(1000)]


def test_flush_sends_without_waiting_for_the_linger(server, make_sender):
    sender = make_sender(server.endpoint, linger_s=60.0, max_batch_spans=100)
    for i in range(30):
        sender.submit(span(i))
    assert sender.counts == counts(submitted=30, pending=30)
    assert sender.flush(timeout=5) == counts(submitted=30, sent=30, acknowledged=30)
    assert server.frames == 1
    assert spans_on_disk(sender.spool_dir) == 0


def test_a_trainer_that_comes_up_later_gets_every_span_once(down_server, make_sender):
    sender = make_sender(down_server.endpoint, max_batch_spans=10)
    for i in range(55):
        sender.submit(span(i))
    assert sender.flush(timeout=0.3) == counts(submitted=55, pending=55, timed_out=True)
    down_server.start()
    assert sender.flush(timeout=5) == counts(submitted=55, sent=55, acknowledged=55)
    assert down_server.span_ids() == ids(range(55))
    assert down_server.duplicates == 0


def test_lost_acks_are_resent_and_the_collector_drops_the_duplicates(server, make_sender):
    sender = make_sender(server.endpoint, max_batch_spans=10, ack_timeout_s=0.1)
    for i in range(20):
        sender.submit(span(i))
    sender.flush(timeout=5)
    server.mode = SILENT
    for i in range(20, 50):
        sender.submit(span(i))
    assert server.wait_for(50)
    assert sender.flush(timeout=0.3).pending == 30  # received, never acknowledged
    server.mode = "ack"
    assert sender.flush(timeout=5) == counts(submitted=50, sent=50, acknowledged=50, duplicates=30)
    assert server.span_ids() == ids(range(50))
    assert server.duplicates >= 30  # each unacknowledged batch came at least twice


def test_a_trainer_that_restarts_mid_stream_loses_nothing(server, make_sender):
    sender = make_sender(server.endpoint, max_batch_spans=10)
    for i in range(30):
        sender.submit(span(i))
    sender.flush(timeout=5)
    server.stop()
    for i in range(30, 60):
        sender.submit(span(i))
    server.start()
    assert sender.flush(timeout=5) == counts(submitted=60, sent=60, acknowledged=60)
    assert server.span_ids() == ids(range(60))


def test_beyond_the_memory_bound_spans_wait_on_disk_and_are_delivered_later(down_server, make_sender):
    sender = make_sender(down_server.endpoint, max_batch_spans=10, max_memory_spans=50, linger_s=60.0)
    for i in range(200):
        sender.submit(span(i))
    assert wait_until(lambda: sender.counts.spooled == 150)
    assert sender.counts == counts(submitted=200, spooled=150, pending=200)
    assert segments(sender.spool_dir)
    down_server.start()
    assert sender.flush(timeout=10) == counts(submitted=200, sent=200, acknowledged=200, spooled=150)
    assert down_server.span_ids() == ids(range(200))
    assert down_server.duplicates == 0
    assert spans_on_disk(sender.spool_dir) == 0


def test_shutdown_spools_what_is_left_and_a_new_process_delivers_it(down_server, spool, caplog):
    script = (
        "import json, sys; from pathlib import Path; from lit_sdk.sender import SpanSender; "
        "s = SpanSender(sys.argv[1], spool_dir=Path(sys.argv[2]), max_batch_spans=10); "
        "[s.submit(span) for span in json.loads(sys.argv[3])]; print(s.shutdown(timeout=0.2))"
    )
    spans = json.dumps([span(i) for i in range(45)])
    child = subprocess.run([sys.executable, "-c", script, down_server.endpoint, str(spool), spans],
                           capture_output=True, text=True, timeout=20, check=False)
    assert child.returncode == 0, child.stderr
    assert "spooled=45" in child.stdout and "pending=45" in child.stdout
    assert f"45 spans kept in the spool at {spool}; they will be delivered by the next lit process" in child.stderr
    assert len(segments(spool)) == 1
    down_server.start()
    with caplog.at_level(logging.INFO, logger="lit"):
        sender = SpanSender(down_server.endpoint, spool_dir=spool)
        try:
            assert sender.flush(timeout=5) == counts(submitted=45, sent=45, acknowledged=45)
        finally:
            sender.shutdown(timeout=0)
    assert down_server.span_ids() == ids(range(45))
    assert segments(spool) == []
    assert "adopted 45 spans in 1 spool segments" in caplog.text


def test_shutdown_in_this_process_is_picked_up_by_the_next_sender(down_server, make_sender, caplog):
    first = make_sender(down_server.endpoint, max_batch_spans=10)
    for i in range(25):
        first.submit(span(i))
    with caplog.at_level(logging.WARNING, logger="lit"):
        assert first.shutdown(timeout=0.1) == counts(submitted=25, spooled=25, pending=25)
        assert first.shutdown(timeout=0.1) == counts(submitted=25, spooled=25, pending=25)  # idempotent
    assert caplog.text.count("25 spans kept in the spool") == 1
    down_server.start()
    second = make_sender(down_server.endpoint)
    assert second.flush(timeout=5) == counts(submitted=25, sent=25, acknowledged=25)
    assert down_server.span_ids() == ids(range(25))
    assert segments(second.spool_dir) == []


def test_a_torn_last_record_costs_only_that_record(down_server, make_sender, caplog):
    first = make_sender(down_server.endpoint, max_batch_spans=10)
    for i in range(30):
        first.submit(span(i))
    first.shutdown(timeout=0.1)
    (path,) = segments(first.spool_dir)
    path.write_bytes(path.read_bytes()[:-7])  # killed in the middle of writing the last span
    orphan([path], dead_pid())
    down_server.start()
    with caplog.at_level(logging.WARNING, logger="lit"):
        second = make_sender(down_server.endpoint)
        assert second.flush(timeout=5) == counts(submitted=29, sent=29, acknowledged=29)
    assert down_server.span_ids() == ids(range(29))
    assert segments(second.spool_dir) == []
    assert "torn record at the end of the spool segment" in caplog.text


def test_segments_of_a_live_sender_are_left_alone(down_server, make_sender):
    first = make_sender(down_server.endpoint, max_batch_spans=10)
    for i in range(10):
        first.submit(span(i))
    (path,) = segments(first.spool_dir)
    down_server.start()
    second = make_sender(down_server.endpoint)
    assert second.flush(timeout=0.5) == counts()
    assert len(scan(path)[0]) == 10 and second.counts.submitted == 0  # not adopted: the first holds its lock
    assert first.flush(timeout=5) == counts(submitted=10, sent=10, acknowledged=10)
    assert down_server.span_ids() == ids(range(10)) and down_server.duplicates == 0


def test_two_adopters_never_take_the_same_segment(down_server, make_sender):
    first = make_sender(down_server.endpoint, max_batch_spans=10)
    for i in range(100):
        first.submit(span(i))
    first.shutdown(timeout=0)
    files = segments(first.spool_dir)
    orphan(files, dead_pid())
    down_server.start()
    a, b = make_sender(down_server.endpoint), make_sender(down_server.endpoint)
    totals = [s.flush(timeout=5) for s in (a, b)]
    assert sum(c.acknowledged for c in totals) == sum(c.submitted for c in totals) == 100
    assert down_server.span_ids() == ids(range(100))
    assert down_server.duplicates == 0


def test_a_nack_counts_the_batch_as_rejected_and_is_logged_once(server, make_sender, caplog):
    server.mode = NACK
    sender = make_sender(server.endpoint, max_batch_spans=10)
    with caplog.at_level(logging.WARNING, logger="lit"):
        for i in range(25):
            sender.submit(span(i))
        assert sender.flush(timeout=5) == counts(submitted=25, sent=25, rejected=25)
    assert server.frames == 3
    assert caplog.text.count(NACK_REASON) == 1


def test_a_long_batch_goes_in_parts_and_one_answered_busy_is_sent_again_soon(server, make_sender):
    """A frame longer than ``protocol.PART_BYTES`` is sent as parts; a ``busy`` answer (the collector had no room for
    it) neither loses nor refuses it: it goes again after a short back-off, well before its ack timeout."""
    server.busy = 3
    sender = make_sender(server.endpoint, ack_timeout_s=30.0)
    large = {**span(0), "attributes": {"lit.test.pad": "x" * (2 * protocol.PART_BYTES)}}
    sender.submit(large)
    assert sender.flush(timeout=10) == counts(submitted=1, sent=1, acknowledged=1)
    assert server.busy == 0 and server.spans() == [large]


@pytest.mark.parametrize("problem", ["unwritable", "over_max_spool_bytes"])
def test_spans_the_spool_cannot_keep_are_counted_and_logged(down_server, spool, make_sender, caplog, problem):
    settings = {"max_batch_spans": 10, "max_memory_spans": 20, "linger_s": 60.0}
    if problem == "unwritable":
        spool.parent.mkdir(parents=True, exist_ok=True)
        (spool.parent / "a-file").write_text("")
        settings["spool_dir"] = spool.parent / "a-file" / "spool"
    else:
        settings["max_spool_bytes"] = 100
    sender = make_sender(down_server.endpoint, **settings)
    with caplog.at_level(logging.WARNING, logger="lit"):
        for i in range(50):
            sender.submit(span(i))  # does not raise
        assert wait_until(lambda: sender.counts.dropped == 30)
        assert sender.counts == counts(submitted=50, dropped=30, pending=20)
        assert sender.shutdown(timeout=0) == counts(submitted=50, dropped=50)
    logged = [int(n) for n in re.findall(r"dropped (\d+) spans", caplog.text)]
    assert sum(logged) == 50  # every drop is in the log, some lines summing several
    assert "(50 in all)" in caplog.text


def test_submit_after_shutdown_is_a_counted_drop_with_one_warning(server, make_sender, caplog):
    sender = make_sender(server.endpoint)
    sender.submit(span(0))
    sender.shutdown(timeout=5)
    with caplog.at_level(logging.WARNING, logger="lit"):
        sender.submit(span(1))
        sender.submit(span(2))
    assert sender.counts == counts(submitted=3, sent=1, acknowledged=1, dropped=2)
    assert caplog.text.count("submitted after the span sender was shut down") == 1
    assert server.span_ids() == ids(range(1))


def test_submit_returns_while_the_trainer_is_down(down_server, make_sender):
    sender = make_sender(down_server.endpoint)
    for i in range(100_000):
        sender.submit(span(i % 1000))
    assert sender.counts == counts(submitted=100_000, pending=100_000)
    assert sender.shutdown(timeout=0) == counts(submitted=100_000, spooled=100_000, pending=100_000)


def test_garbage_replies_are_ignored_and_logged_once(make_sender, caplog):
    import zmq

    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    sender = make_sender(f"tcp://127.0.0.1:{port}", max_batch_spans=10)
    try:
        with caplog.at_level(logging.WARNING, logger="lit"):
            for i in range(20):
                sender.submit(span(i))
            for _ in range(2):
                assert router.poll(5000)
                identity, data = router.recv_multipart()
                batch = protocol.decode_frame(data).batch
                router.send_multipart([identity, b"\xc1 not msgpack"])
                router.send_multipart([identity, b"\xc1 still not"])
                router.send_multipart([identity, protocol.encode_ack(batch, 10, 0)])
            assert sender.flush(timeout=5) == counts(submitted=20, sent=20, acknowledged=20)
    finally:
        router.close(linger=0)
    assert caplog.text.count("not a valid frame") == 1


def test_a_collector_on_another_machine_without_keys_is_refused_with_the_fix(tmp_path):
    from lit_sdk.protocol.security import SecurityError

    with pytest.raises(SecurityError, match="LIT_KEYS_DIR"):
        SpanSender("tcp://10.1.2.3:5555", spool_dir=tmp_path)
    assert not any(tmp_path.iterdir())  # refused before it made a spool file
