"""What the span sender promises beyond a clean exit: spans that ended survive a ``kill -9`` of the agent process and
are delivered by the next process; a live owner's spool files are never taken, whatever host or pid it claims; a
batch never outgrows a frame; memory is bounded in bytes; and ``flush`` says whether it finished."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from ack_server import AckServer

from lit_sdk import protocol
from lit_sdk.delivery import DeliveryCounts
from lit_sdk.sender import SpanSender

pytestmark = pytest.mark.timeout(120)

SDK_TESTS = Path(__file__).resolve().parent

CHILD = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_durability import span
from lit_sdk.sender import SpanSender

endpoint, spool, n, pad = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sender = SpanSender(endpoint, spool_dir=spool, linger_s=30.0, max_batch_spans=64)
for i in range(n):
    sender.submit(span(i, pad))
print("ended", flush=True)
time.sleep(120)
"""

INSTRUMENTED_CHILD = """
import sys, time
import lit_sdk as lit

lit.instrument(endpoint=sys.argv[1], spool_dir=sys.argv[2], frameworks=[])

@lit.trace
def agent(i):
    lit.reward(1.0, name="done")

for i in range(int(sys.argv[3]) // 2):  # two spans each: the rollout and its reward
    with lit.assign_rollout("r-agent-%d" % i):  # as the trainer's worker does (the trainer stores what it handed out)
        agent(i)
print("ended", flush=True)
time.sleep(120)
"""


def span(i: int, pad: int = 0, rollout: str = "r1") -> dict:
    return protocol.SpanRecord(
        trace_id=f"{i // 10 + 1:032x}", span_id=f"{i + 1:016x}", parent_id=None, name=f"step-{i}",
        start_ns=i, end_ns=i + 1, rollout_id=rollout, attributes={"lit.test.i": i, "lit.test.pad": "x" * pad},
    ).to_wire()


def ids(n: int) -> set[str]:
    return {f"{i + 1:016x}" for i in range(n)}


def spool_files(spool: Path) -> list[Path]:
    return sorted(p for p in spool.iterdir() if not p.name.startswith(".")) if spool.is_dir() else []


def start_child(code: str, endpoint: str, spool: Path, n: int, pad: int = 0) -> subprocess.Popen:
    """An agent process that submits ``n`` spans, says "ended" and waits to be killed."""
    child = subprocess.Popen([sys.executable, "-c", code.format(tests=str(SDK_TESTS)), endpoint, str(spool),
                              str(n), str(pad)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = child.stdout.readline()
    if line.strip() != "ended":
        child.kill()
        pytest.fail(f"the agent process did not end its spans: {line!r} {child.communicate()[1]}")
    return child


def kill_9(child: subprocess.Popen) -> None:
    os.kill(child.pid, signal.SIGKILL)
    child.wait(10)


def dead_pid() -> int:
    out = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                         check=True)
    return int(out.stdout)


def move_owner(spool: Path, host: str, pid: int) -> None:
    """Rename every file of the spool's one owner as if written by ``pid`` on ``host`` (a held lock stays held:
    the renamed file is the same open file). Names: ``{host}-{pid}-{token}[-{seq}]``, or ``{pid}-{token}-{seq}.seg``
    before hosts were named."""
    for path in spool_files(spool):
        stem, dot, ext = path.name.partition(".")
        if stem.count("-") == 2 and ext == "seg":
            name = "-".join([str(pid), *stem.split("-")[1:]])
        else:
            parts = stem.rsplit("-", 3 if ext == "seg" else 2)
            parts[0], parts[1] = host, str(pid)
            name = "-".join(parts)
        path.rename(path.with_name(name + dot + ext))


@pytest.fixture
def collector(tmp_path):
    """The trainer's real collector, storing into a real SQLite store."""
    from handed_out import hand_out

    from lit_trainer.intake.collector import Collector
    from lit_trainer.intake.store import SqliteStore

    with SqliteStore(tmp_path / "lit.db") as store, \
            Collector(store, "tcp://127.0.0.1:0", open_to_local_users=True) as running:
        hand_out(store, "r1", *(f"r-agent-{i}" for i in range(100)))
        yield running


def stored_ids(collector, rollout: str = "r1") -> list[str]:
    return [s.span_id for s in collector.store.spans_of_rollout(rollout)]


@pytest.fixture
def make_sender(tmp_path):
    senders: list[SpanSender] = []

    def make(endpoint: str, **settings) -> SpanSender:
        sender = SpanSender(endpoint, **{"spool_dir": tmp_path / "spool", "ack_timeout_s": 0.5, **settings})
        senders.append(sender)
        return sender

    yield make
    for sender in senders:
        sender.shutdown(timeout=0)


# -- 1. kill -9 ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("trainer", ["down", "up"])
def test_spans_that_ended_survive_a_kill_9_and_the_next_process_delivers_them(tmp_path, collector, make_sender,
                                                                             trainer, caplog):
    spool, n = tmp_path / "spool", 300
    if trainer == "down":  # nothing was sent
        endpoint = AckServer().start()
        endpoint.stop()
        child = start_child(CHILD, endpoint.endpoint, spool, n)
    else:  # some batches sent, maybe acknowledged, the rest in memory when it is killed
        child = start_child(CHILD, collector.endpoint, spool, n)
    kill_9(child)
    assert spool_files(spool), "the killed process left nothing on disk"
    with caplog.at_level(logging.INFO, logger="lit"):
        sender = make_sender(collector.endpoint)
        counts = sender.flush(timeout=30)
    assert "adopted" in caplog.text and "torn" not in caplog.text  # the unused room of a segment is not torn
    assert not counts.timed_out and counts.pending == counts.dropped == counts.rejected == 0
    stored = stored_ids(collector)
    assert len(stored) == n and set(stored) == ids(n)  # emitted == stored, none lost, none twice
    assert sender.shutdown(timeout=5).pending == 0
    assert spool_files(spool) == []


def test_spans_of_an_instrumented_agent_survive_a_kill_9(tmp_path, collector, make_sender):
    down = AckServer().start()
    down.stop()
    spool, n = tmp_path / "spool", 40
    kill_9(start_child(INSTRUMENTED_CHILD, down.endpoint, spool, n))
    sender = make_sender(collector.endpoint)
    assert sender.flush(timeout=30).acknowledged == n
    assert collector.store.counts()["spans"] == n


# -- 2. ownership --------------------------------------------------------------------------------------------------

def test_a_live_owner_on_another_host_keeps_its_spool_until_it_dies(tmp_path, collector, make_sender):
    """Another host's sender (played by a live process holding its lock) whose pid means nothing here."""
    down = AckServer().start()
    down.stop()
    spool = tmp_path / "spool"
    child = start_child(CHILD, down.endpoint, spool, 20)
    try:
        move_owner(spool, "otherhost", dead_pid())
        first = make_sender(collector.endpoint)
        assert first.flush(timeout=1) == DeliveryCounts(0, 0, 0, 0, 0, 0, 0, 0)
        assert stored_ids(collector) == [] and any(p.suffix == ".seg" for p in spool_files(spool))
    finally:
        kill_9(child)
    second = make_sender(collector.endpoint)  # its lock is free now: it is gone
    assert second.flush(timeout=30).acknowledged == 20
    assert set(stored_ids(collector)) == ids(20)


@pytest.mark.parametrize("death", ["kill -9", "exit"])
def test_a_dead_owner_is_adopted_though_its_pid_lives_again(tmp_path, collector, make_sender, death):
    down = AckServer().start()
    down.stop()
    spool = tmp_path / "spool"
    if death == "kill -9":
        kill_9(start_child(CHILD, down.endpoint, spool, 20))
    else:  # shutdown() leaves the undelivered spans in the spool
        exited = start_child(CHILD.replace("time.sleep(120)", "sender.shutdown(timeout=0)"), down.endpoint, spool, 20)
        assert exited.wait(20) == 0
    move_owner(spool, "thishost", os.getppid())  # a live process got its pid
    sender = make_sender(collector.endpoint)
    assert sender.flush(timeout=30).acknowledged == 20
    assert set(stored_ids(collector)) == ids(20)


def test_a_dead_owner_is_adopted_once_by_one_of_two_adopters(tmp_path, make_sender):
    server = AckServer().start()
    try:
        spool, n = tmp_path / "spool", 120
        server.stop()
        kill_9(start_child(CHILD, server.endpoint, spool, n, pad=100_000))  # 12 MB: several segments
        assert len([p for p in spool_files(spool) if p.suffix == ".seg"]) >= 3
        server.start()
        start = threading.Barrier(2)
        senders: list[SpanSender] = []

        def adopt() -> None:
            start.wait()
            senders.append(make_sender(server.endpoint))

        threads = [threading.Thread(target=adopt) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        totals = [s.flush(timeout=30) for s in senders]
        assert sum(c.submitted for c in totals) == sum(c.acknowledged for c in totals) == n
        assert server.span_ids() == ids(n)
        assert server.duplicates == 0
    finally:
        server.stop()


# -- 3. batches capped in bytes ------------------------------------------------------------------------------------

def test_512_spans_of_200_kb_are_all_stored_none_rejected(collector, make_sender):
    sender = make_sender(collector.endpoint)
    for i in range(512):
        sender.submit(span(i, pad=200_000))
    counts = sender.flush(timeout=60)
    assert (counts.acknowledged, counts.rejected, counts.dropped, counts.pending) == (512, 0, 0, 0)
    assert set(stored_ids(collector)) == ids(512)
    assert collector.counts.rejected == {}
    assert collector.counts.frames >= 512 * 200_000 // (4 << 20)  # no frame over max_batch_bytes (4 MiB)


def test_a_span_too_large_for_a_frame_is_dropped_and_logged_never_sent(make_sender, caplog):
    with AckServer() as server:
        sender = make_sender(server.endpoint)
        with caplog.at_level(logging.WARNING, logger="lit"):
            sender.submit(span(0, pad=protocol.MAX_FRAME_BYTES))
            sender.submit(span(1))
            counts = sender.flush(timeout=10)
        assert (counts.submitted, counts.acknowledged, counts.dropped, counts.pending) == (2, 1, 1, 0)
        assert server.span_ids() == {f"{2:016x}"} and server.frames == 1 and server.bad_frames == 0
    assert "does not fit in one frame of protocol.MAX_FRAME_BYTES" in caplog.text


def test_frames_are_what_the_protocol_encodes(make_sender):
    """Spans are encoded once, in submit; the frame made of them is byte for byte ``encode_span_dicts``."""
    import zmq

    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        sender = make_sender(f"tcp://127.0.0.1:{port}", max_batch_spans=20, linger_s=60.0)
        spans = [span(i, pad=i) for i in range(20)]
        for s in spans:
            sender.submit(s)
        assert router.poll(5000)
        _, data = router.recv_multipart()
        frame = protocol.decode_frame(data)
        assert data == protocol.encode_span_dicts(frame.batch, sender.sender_id, spans)
    finally:
        router.close(linger=0)


def test_max_batch_bytes_must_fit_in_a_frame(tmp_path):
    with pytest.raises(ValueError, match="max_batch_bytes"):
        SpanSender("tcp://127.0.0.1:1", spool_dir=tmp_path, max_batch_bytes=protocol.MAX_FRAME_BYTES)


# -- 4. memory bounded in bytes ------------------------------------------------------------------------------------

def test_memory_is_bounded_in_bytes_and_the_rest_waits_on_disk(make_sender):
    server = AckServer().start()
    server.stop()
    try:
        sender = make_sender(server.endpoint, max_memory_bytes=1 << 20, linger_s=60.0)
        for i in range(40):
            sender.submit(span(i, pad=100_000))  # about 100 KB each: 10 fit in 1 MiB
        assert sender.counts.spooled == 30
        server.start()
        counts = sender.flush(timeout=30)
        assert (counts.acknowledged, counts.pending, counts.dropped) == (40, 0, 0)
        assert server.span_ids() == ids(40) and server.duplicates == 0
    finally:
        server.stop()


# -- 5. flush says whether it finished -----------------------------------------------------------------------------

def test_flush_says_whether_it_finished(make_sender):
    server = AckServer().start()
    server.stop()
    try:
        sender = make_sender(server.endpoint)
        assert sender.flush(timeout=0).timed_out is False  # nothing to wait for
        for i in range(5):
            sender.submit(span(i))
        waited = sender.flush(timeout=0.2)
        assert (waited.timed_out, waited.pending) == (True, 5)
        assert sender.counts.timed_out is False
        server.start()
        done = sender.flush(timeout=10)
        assert (done.timed_out, done.acknowledged, done.pending) == (False, 5, 0)
        assert sender.shutdown(timeout=1).timed_out is False
    finally:
        server.stop()
