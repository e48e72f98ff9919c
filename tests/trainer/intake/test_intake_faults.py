"""Intake under faults and hostile peers: a real ZeroMQ ROUTER on 127.0.0.1 writing into a real SQLite store.

Each test names the hole it closes. A bad span must never stop the collector; a store that fails (a full disk)
must stop it loudly, with nothing acknowledged that was not stored; no frame may make it hold much more memory
than the frame's size; and a rollout that lost a span on the way must be told from a complete one.
"""

from __future__ import annotations

import os
import sqlite3
import time

import msgpack
import psutil
import pytest
import zmq
from handed_out import hand_out
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_collector import HANDED_OUT, WAIT_S, Client, span, spans_frame
from waiting import wait_until
from zmq.utils.monitor import recv_monitor_message

import lit_sdk as lit
from lit_sdk import protocol
from lit_sdk import semconv as sc
from lit_trainer.intake.collector import Collector, CollectorError
from lit_trainer.intake.store import SqliteStore

HANDED_OUT = ("r", "r-complete", "r-lossy", "good", *HANDED_OUT)


@pytest.fixture
def store(tmp_path):
    with SqliteStore(tmp_path / "lit.db") as s:
        hand_out(s, *HANDED_OUT)
        yield s


@pytest.fixture
def collector(store):
    with Collector(store, "tcp://127.0.0.1:0", open_to_local_users=True) as c:
        yield c


def acked_within(client: Client, batch: str, seconds: float = 1.0) -> float:
    """Send a good frame and return how long its ack took (asserting it came within ``seconds``)."""
    t0 = time.monotonic()
    client.send(spans_frame(batch, [span(int(t0 * 1e6) % 2**40, rollout=batch)]))
    while time.monotonic() - t0 < seconds:
        if client.sock.poll(20):
            reply = protocol.decode_frame(client.sock.recv())
            if isinstance(reply, protocol.AckFrame) and reply.batch == batch:
                return time.monotonic() - t0
    raise AssertionError(f"no ack for {batch} within {seconds} s")


def test_an_integer_sqlite_cannot_store_is_refused_and_the_collector_goes_on(collector, store):
    """Hole: 2**63 passed validation, failed the INSERT and killed the collector thread."""
    client = Client(collector.endpoint)
    try:
        bad = {**span(1).to_wire(), "end_ns": 2**63}
        client.send(protocol.encode_span_dicts("bad", "test", [span(2).to_wire(), bad]))
        (nack,) = client.replies(1)
        assert isinstance(nack, protocol.NackFrame) and "64 bits" in nack.reason
        acked_within(client, "good")
        collector.check()  # nothing stopped it
        assert collector.counts.rejected == {"span": 1}
        assert store.counts()["spans"] == 1  # the good frame only: the bad frame's good span was not kept either
    finally:
        client.close()


class FullStore(SqliteStore):
    """A real SQLite store that runs out of room: ``max_page_count`` caps the file as a full disk would, and
    SQLite answers a write beyond it with SQLITE_FULL ("database or disk is full")."""

    pages = 0

    def _conn(self) -> sqlite3.Connection:
        conn = super()._conn()
        if self.pages:
            conn.execute(f"PRAGMA max_page_count={self.pages}")
        return conn


def test_a_full_disk_stops_the_collector_loudly_and_loses_nothing(tmp_path):
    """Hole: the collector thread died silently on a full disk, and the trainer went on with empty rollouts."""
    store = FullStore(tmp_path / "lit.db")
    hand_out(store, "r")
    store.pages = store._conn().execute("PRAGMA page_count").fetchone()[0] + 2  # room for a few small frames
    collector = Collector(store, "tcp://127.0.0.1:0", open_to_local_users=True).start()
    client = Client(collector.endpoint)
    acks = 0
    try:
        big = "x" * 20_000  # a few pages per frame: the cap is reached within a few frames
        for i in range(20):  # one at a time, so that each frame is its own transaction
            client.send(spans_frame(f"b{i}", [protocol.SpanRecord(
                trace_id="ab" * 16, span_id=f"{i:016x}", parent_id=None, name="tool", start_ns=i, end_ns=i + 1,
                rollout_id="r", attributes={"text": big})]))
            if not client.sock.poll(2000):
                break
            assert isinstance(protocol.decode_frame(client.sock.recv()), protocol.AckFrame)
            acks += 1
        deadline = time.monotonic() + WAIT_S
        with pytest.raises(CollectorError) as info:
            while time.monotonic() < deadline:
                collector.check()
                time.sleep(0.02)
        message = str(info.value)
        assert "database or disk is full" in message and "Free disk space" in message and "--resume" in message
        assert not client.sock.poll(200), "a frame that was not stored was acknowledged"
    finally:
        client.close()
        collector.stop()
        store.close()
    with sqlite3.connect(tmp_path / "lit.db") as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        stored = conn.execute("SELECT count(*) FROM spans").fetchone()[0]
    assert 0 < acks < 20
    assert stored == acks  # every acknowledged span is on disk, and nothing unacknowledged is


def test_a_frame_over_the_limit_never_reaches_the_collector(collector):
    """Hole: no zmq.MAXMSGSIZE, so a peer could make the collector receive (allocate) a frame of any size. ZeroMQ
    now cuts it off at the limit (dropping that peer's connection), and the others are served as before."""
    hostile = Client.__new__(Client)  # watched from before it connects: ZeroMQ says when the collector drops it
    hostile.sock = zmq.Context.instance().socket(zmq.DEALER)
    hostile.sock.setsockopt(zmq.LINGER, 0)
    events = hostile.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    hostile.sock.connect(collector.endpoint)
    client = Client(collector.endpoint)
    try:
        assert _monitor_event(events) == zmq.EVENT_CONNECTED
        hostile.send(b"\x00" * (protocol.MAX_FRAME_BYTES + 2048))
        assert _monitor_event(events) == zmq.EVENT_DISCONNECTED, "the collector did not cut the oversized frame off"
        acked_within(client, "after")
        assert collector.counts.rejected == {}, "the oversized frame was read into memory"
    finally:
        hostile.sock.disable_monitor()
        events.close()
        hostile.close()
        client.close()


def _monitor_event(events: zmq.Socket) -> int:
    """The next event of a socket monitor, within ``WAIT_S``."""
    assert events.poll(int(WAIT_S * 1000)), f"no socket event within {WAIT_S} s"
    return recv_monitor_message(events)["event"]


def test_a_turn_holds_a_bounded_number_of_bytes(store):
    """A turn stops draining at ``max_turn_bytes``, not only at a frame or span count."""
    seen: list[int] = []
    original = store.add_packed_span_batches

    def record(batches, admit=False):
        seen.append(len(batches))
        return original(batches, admit)

    store.add_packed_span_batches = record
    with Collector(store, "tcp://127.0.0.1:0", max_turn_bytes=50_000, open_to_local_users=True) as collector:
        client = Client(collector.endpoint)
        try:
            frames = [spans_frame(f"b{i}", [protocol.SpanRecord(
                trace_id="ab" * 16, span_id=f"{i:016x}", parent_id=None, name="tool", start_ns=i, end_ns=i + 1,
                rollout_id="r", attributes={"text": "y" * 20_000})]) for i in range(12)]
            for frame in frames:
                client.send(frame)
            client.replies(12)
        finally:
            client.close()
    assert sum(seen) == 12 and max(seen) <= 3


# -- a hostile peer ----------------------------------------------------------------------------------------------

_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20) | \
    st.binary(max_size=20)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
    st.text(max_size=8) | st.integers(-1000, 1000), inner, max_size=5), max_leaves=20)
_GOOD = spans_frame("template", [span(1), span(2, parent=None, name=sc.ROLLOUT_SPAN)])


def _mutate(data: bytes, ops: list[tuple[int, int, int]]) -> bytes:
    out = bytearray(data)
    for op, position, value in ops:
        i = position % max(len(out), 1)
        if op == 0 and out:
            out[i] = value
        elif op == 1:
            del out[i:]
        else:
            out[i:i] = bytes([value])
    return bytes(out)


_frames = st.one_of(
    st.binary(max_size=200),
    _values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
    st.dictionaries(st.sampled_from(["v", "t", "batch", "sender", "spans"]), _values, max_size=5).map(
        lambda d: msgpack.packb(d, use_bin_type=True)),
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, 10_000), st.integers(0, 255)), min_size=1,
             max_size=4).map(lambda ops: _mutate(_GOOD, ops)),
)


def _bomb(n: int) -> bytes:
    """A spans frame whose ``spans`` is an array of ``n`` empty maps: 1 byte each on the wire."""
    head = b"".join(msgpack.packb(x) for x in ("v", 1, "t", "spans", "batch", "bomb", "sender", "s", "spans"))
    return b"\x85" + head + b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n


HOSTILE = {
    "wrong version": msgpack.packb({"v": 2, "t": "spans", "batch": "b", "sender": "s", "spans": []}),
    "truncated": _GOOD[: len(_GOOD) // 2],
    "decode bomb, 15 Mi empty maps": _bomb(15 * 2**20),
    "5000 empty spans": msgpack.packb({"v": 1, "t": "spans", "batch": "b", "sender": "s", "spans": [{}] * 5000}),
    "junk": os.urandom(1000),
}


def test_hostile_frames_are_refused_within_bounded_memory(collector_for_fuzz):
    collector, client, tally = collector_for_fuzz
    before = sum(collector.counts.rejected.values())
    for data in HOSTILE.values():
        for message in protocol.encode_parts("hostile", data):  # the bomb is longer than a message: in parts
            client.send(message)
    deadline = time.monotonic() + WAIT_S
    while sum(collector.counts.rejected.values()) - before < len(HOSTILE) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(collector.counts.rejected.values()) - before == len(HOSTILE)
    tally["sent"] += len(HOSTILE)
    acked_within(client, "after-hostile")
    rss = psutil.Process(os.getpid()).memory_info().rss
    assert rss - tally["rss0"] < 400 * 2**20, f"memory grew by {(rss - tally['rss0']) / 2**20:.0f} MiB"


@pytest.mark.slow
@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(frames=st.lists(_frames, min_size=20, max_size=20))
def test_ten_thousand_fuzzed_frames(collector_for_fuzz, frames):
    """500 examples of 20 frames each (10,000 in all; small enough that hypothesis never drops one as too big to
    generate): every frame is either acknowledged or rejected and
    counted (exactly: accepted + rejected == sent), memory stays bounded, the collector never stops, and the next
    good frame is acknowledged within a second."""
    collector, client, tally = collector_for_fuzz
    before = collector.counts
    for data in frames:
        client.send(data)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        after = collector.counts
        handled = (after.frames - before.frames) + sum(after.rejected.values()) - sum(before.rejected.values())
        if handled == len(frames):
            break
        time.sleep(0.01)
    assert handled == len(frames)
    while client.sock.poll(0):
        client.sock.recv()
    tally["sent"] += len(frames)
    tally["fuzzed"] += len(frames)
    tally["latency"] = max(tally["latency"], acked_within(client, f"good-{tally['sent']}"))
    collector.check()
    rss = psutil.Process(os.getpid()).memory_info().rss
    assert rss - tally["rss0"] < 400 * 2**20, f"memory grew by {(rss - tally['rss0']) / 2**20:.0f} MiB"


@pytest.fixture(scope="module")
def collector_for_fuzz(tmp_path_factory):
    with SqliteStore(tmp_path_factory.mktemp("fuzz") / "lit.db") as store, \
            Collector(store, "tcp://127.0.0.1:0", open_to_local_users=True) as collector:
        client = Client(collector.endpoint)
        tally = {"sent": 0, "fuzzed": 0, "latency": 0.0, "rss0": psutil.Process(os.getpid()).memory_info().rss}
        yield collector, client, tally
        client.close()
        assert tally["fuzzed"] in (0, 10_000)  # the fuzz test ran all its examples, or was not selected
        with sqlite3.connect(store.path) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


# -- per-rollout completeness --------------------------------------------------------------------------------------

def test_the_root_span_declares_how_many_spans_the_rollout_emitted(collector, store, tmp_path):
    """Hole: nothing checked, per rollout, that the spans emitted were all stored."""

    tracer = lit.instrument(endpoint=collector.endpoint, spool_dir=tmp_path / "spool", frameworks=[]).tracer

    @lit.trace
    def agent(n: int) -> float:
        for i in range(n):
            tracer.start_span(f"step-{i}").end()
        lit.reward(0.5)
        return 1.0

    try:
        from lit_sdk import _context

        with _context.assign("r-complete", "t1", 1, None):
            agent(3)
        with _context.assign("r-lossy", "t1", 1, None):
            agent(3)
        assert lit.flush(WAIT_S).pending == 0
    finally:
        lit.uninstrument()
    (root,) = [s for s in store.spans_of_rollout("r-complete") if s.parent_id is None]
    assert root.attributes[sc.ROLLOUT_SPANS] == 5  # 3 steps, the reward, the root
    assert store.missing_spans("r-complete") is None
    with sqlite3.connect(store.path) as conn:  # a span lost on the way
        conn.execute("DELETE FROM spans WHERE rollout_id = 'r-lossy' AND name = 'step-1'")
    assert store.missing_spans("r-lossy") == "4 of its 5 spans were stored: the others were lost on the way"
    with sqlite3.connect(store.path) as conn:
        conn.execute("DELETE FROM spans WHERE rollout_id = 'r-lossy' AND parent_id IS NULL")
    assert store.missing_spans("r-lossy") == "its root span was not stored (3 other spans were)"


# -- the collector killed between its commit and its ack ---------------------------------------------------------

_KILLED_COLLECTOR = """
import os, signal, sys, time
import zmq
from lit_trainer.intake.collector import Collector
from lit_trainer.intake.store import SqliteStore

send = zmq.Socket.send_multipart
def die_instead_of_acking(sock, parts, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)  # after the commit, before the ack: the worst moment
zmq.Socket.send_multipart = die_instead_of_acking
collector = Collector(SqliteStore(sys.argv[1]), sys.argv[2], open_to_local_users=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_a_collector_killed_between_commit_and_ack_stores_each_span_once(tmp_path):
    """SIGKILL after the commit and before the ack: the sender never hears back, sends again to the next
    collector, which finds the spans stored and acknowledges them as duplicates. Emitted == stored, once each."""
    import socket
    import subprocess
    import sys

    from lit_sdk.sender import SpanSender

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    db = tmp_path / "lit.db"
    with SqliteStore(db) as store:
        hand_out(store, *HANDED_OUT)
    child = subprocess.Popen([sys.executable, "-c", _KILLED_COLLECTOR, str(db), endpoint], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline().strip() == "ready"
    sender = SpanSender(endpoint, spool_dir=tmp_path / "spool", max_batch_spans=50, linger_s=0.01, ack_timeout_s=0.5)
    emitted = [span(i, rollout=f"r{i % 7}").to_wire() for i in range(300)]
    try:
        for s in emitted:
            sender.submit(s)
        assert child.wait(WAIT_S) == -9  # it died at its first ack
        with SqliteStore(db) as store:
            with sqlite3.connect(db) as conn:
                committed = conn.execute("SELECT count(*) FROM spans").fetchone()[0]
            assert committed > 0, "the first batch was committed before the kill"
            with Collector(store, endpoint, open_to_local_users=True) as collector:
                counts = sender.flush(WAIT_S * 3)
                assert (counts.acknowledged, counts.pending, counts.dropped, counts.rejected) == (300, 0, 0, 0)
                assert collector.counts.duplicates == counts.duplicates >= committed
            with sqlite3.connect(db) as conn:
                ids = [row[0] for row in conn.execute("SELECT rollout_id || '/' || span_id FROM spans")]
                assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        sender.shutdown(1)
        child.kill()
    assert sorted(ids) == sorted(f"{s['rollout_id']}/{s['span_id']}" for s in emitted)  # each once, none lost


# -- only the right peers connect --------------------------------------------------------------------------------

def test_only_peers_with_the_client_key_reach_the_collector(tmp_path, store):
    """Hole: no authentication, so anyone reaching the port could store a forged root span with a chosen reward.
    With keys, a peer without the client key (or with another one) is refused at the handshake and counted; its
    frames never reach the store."""
    from lit_sdk.protocol import security

    security.generate_keys(tmp_path / "keys")
    security.generate_keys(tmp_path / "other")
    with Collector(store, "tcp://127.0.0.1:0", keys=security.load_server_keys(tmp_path / "keys")) as collector:
        peers = {}
        for name, folder in (("good", "keys"), ("wrong key", "other"), ("no key", None)):
            client = Client.__new__(Client)
            client.sock = zmq.Context.instance().socket(zmq.DEALER)
            client.sock.setsockopt(zmq.LINGER, 0)
            if folder:
                security.secure_client(client.sock, security.load_client_keys(tmp_path / folder))
            client.sock.connect(collector.endpoint)
            peers[name] = client
        forged = span(1, rollout="r-forged", parent=None, name=sc.ROLLOUT_SPAN)
        forged.attributes = {sc.ROLLOUT_RETURN_REWARD: 1.0}
        for name in ("wrong key", "no key"):
            try:  # without blocking: once its handshake was refused, a DEALER has no peer and its send would wait
                peers[name].sock.send(spans_frame(f"forged-{name}", [forged]), zmq.NOBLOCK)  # forever (seen on CI)
            except zmq.Again:
                pass  # refused before the frame went out: it cannot reach the store either
        acked_within(peers["good"], "good", seconds=WAIT_S)
        wait_until(lambda: sum(collector.counts.refused_peers.values()) >= 2, "both peers refused at the handshake")
        for name in ("wrong key", "no key"):
            assert not peers[name].sock.poll(50), f"the peer with {name} got an answer"
        refused = collector.counts.refused_peers
        for client in peers.values():
            client.close()
    assert sum(refused.values()) >= 2, refused
    assert store.spans_of_rollout("r-forged") == [] and collector.counts.rejected == {}


def test_a_collector_on_another_address_needs_keys(store):
    from lit_sdk.protocol import security

    with pytest.raises(security.SecurityError, match="lit keys generate"):
        Collector(store, "tcp://0.0.0.0:0", open_to_local_users=True).start()
