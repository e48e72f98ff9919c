"""The collector's bounds against many hostile peers: memory for frames in flight, connections, idle peers.

Real ZeroMQ sockets on 127.0.0.1 and a real SQLite store. The spans are outside any rollout (``rollout_id`` None),
which the store takes without asking whether the trainer handed the rollout out: these tests are about the socket.
Hostile peers are plain TCP sockets speaking as much of ZeroMQ's wire protocol (ZMTP 3.0) as they need, or raw
connections that say nothing; the honest agent is the SDK's ``SpanSender`` or a plain DEALER. A collector that needs
a low open-files limit runs in a child process (``collector_process``).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import sqlite3
import struct
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import zmq
from raw_peers import closed_by_peer, flood, flood_until, read_exactly, zmtp_connect
from test_collector import WAIT_S, Client, span, spans_frame
from waiting import wait_until

from lit_sdk import protocol
from lit_sdk.protocol import codec, security
from lit_sdk.sender import SpanSender
from lit_trainer.intake import parts
from lit_trainer.intake.collector import Collector
from lit_trainer.intake.parts import BUSY, PartAssembler
from lit_trainer.intake.store import SqliteStore

ACK_S = 20.0
"""How long an honest agent may wait for its ack while hostile peers are about (a loaded 2-core machine)."""
BUDGET = 64 * 2**20
"""The collector's default ``max_partial_bytes``."""
NOFILE = 512
"""The open-files limit of the collector process that a flood of up to 700 connections meets."""


@pytest.fixture
def store(tmp_path):
    with SqliteStore(tmp_path / "lit.db") as s:
        yield s


# -- a hostile peer, byte by byte (ZMTP 3.0: https://rfc.zeromq.org/spec/23/; raw_peers.zmtp_connect) ------------

def announce(sock: socket.socket, size: int, sent: int) -> None:
    """Announce a message of ``size`` bytes and send ``sent`` of them (then stop, half-way)."""
    sock.sendall(b"\x02" + struct.pack(">Q", size) + b"\0" * sent)


def announce_command(sock: socket.socket, size: int, sent: int) -> None:
    """Announce a handshake command of ``size`` bytes and send ``sent`` of them (then stop, half-way)."""
    sock.sendall(b"\x06" + struct.pack(">Q", size) + b"\0" * sent)


def first_part(batch: str, total: int) -> bytes:
    """The first part of a frame ``total`` bytes long (the rest never comes)."""
    return codec.packb({"v": protocol.VERSION, "t": protocol.PART, "batch": batch, "total": total, "offset": 0,
                        "data": b"\0" * protocol.PART_BYTES})


def dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


_CHILD = textwrap.dedent("""
    import dataclasses, json, sys
    from lit_sdk.protocol import security
    from lit_trainer.intake.collector import Collector
    from lit_trainer.intake.store import SqliteStore
    db, keys_dir, handshake_s = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    keys = security.load_server_keys(keys_dir) if keys_dir else None
    options = {"handshake_s": handshake_s} if handshake_s else {}
    with SqliteStore(db) as store, \
            Collector(store, "tcp://127.0.0.1:0", keys=keys, open_to_local_users=keys is None, **options) as collector:
        print(collector.endpoint, flush=True)
        for line in sys.stdin:
            if line.strip() != "counts":
                break
            print(json.dumps(dataclasses.asdict(collector.counts)), flush=True)
        counts = dataclasses.asdict(collector.counts)
    print(json.dumps(counts), flush=True)
""")


class collector_process:
    """A collector (default settings, or ``handshake_s``) in a child process, so that its memory is its own and its
    open-files limit can be ``nofile`` (soft and hard). Its counts come back as a dict."""

    def __init__(self, db, nofile: int | None = None, keys_dir=None, handshake_s: float | None = None):
        def limit():
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(db), str(keys_dir or ""),
                                      json.dumps(handshake_s)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=limit,
                                     env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        self.endpoint = self.proc.stdout.readline().strip()
        assert self.endpoint.startswith("tcp://"), "the collector process did not start"

    def rss(self) -> int:
        return psutil.Process(self.proc.pid).memory_info().rss

    def open_fds(self) -> int:
        return psutil.Process(self.proc.pid).num_fds()

    def counts(self) -> dict:
        self.proc.stdin.write("counts\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> dict:
        try:
            out, _ = self.proc.communicate("stop\n", timeout=WAIT_S * 3)
        finally:
            self.proc.kill()
        return json.loads(out.strip().splitlines()[-1])


# -- memory ------------------------------------------------------------------------------------------------------

def test_idle_peers_announcing_long_frames_cost_bounded_memory(tmp_path):
    """Hole: each peer that announced a message just under the 16 MiB limit and went idle cost 16 MiB, however many
    there were. Now a message is at most ``MAX_MESSAGE_BYTES`` (longer ones are cut at their header), longer frames
    come in parts, and the parts of all peers together are kept within ``max_partial_bytes``; the rest are told
    ``busy``. An honest agent is acknowledged all along."""
    n = 40
    bound = BUDGET + n * 2 * protocol.MAX_MESSAGE_BYTES + 32 * 2**20
    child = collector_process(tmp_path / "lit.db")
    rss0 = child.rss()

    def memory_is_bounded() -> None:
        grown = child.rss() - rss0
        assert grown < bound, f"the collector grew by {grown / 2**20:.0f} MiB, more than {bound / 2**20:.0f} MiB"

    raw: list[socket.socket] = []
    dealers: list[zmq.Socket] = []
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(child.stop)
        cleanup.callback(lambda: [s.close() for s in [*raw, *dealers]])
        for _ in range(n):
            peer = zmtp_connect(child.endpoint)
            try:
                announce(peer, protocol.MAX_FRAME_BYTES, protocol.MAX_FRAME_BYTES - 1)
            except OSError:  # cut off at the header
                pass
            raw.append(peer)
        sender = SpanSender(child.endpoint, spool_dir=tmp_path / "spool", linger_s=0.01)
        try:
            for i in range(200):
                sender.submit(span(i, rollout=None).to_wire())
            assert sender.flush(timeout=ACK_S).acknowledged == 200
            memory_is_bounded()
            for i in range(n):
                dealers.append(dealer(child.endpoint))
                dealers[-1].send(first_part(f"idle-{i}", protocol.MAX_FRAME_BYTES - 1))
            for i in range(200, 300):
                sender.submit(span(i, rollout=None).to_wire())
            delivered = sender.flush(timeout=ACK_S)
        finally:
            sender.shutdown(timeout=1)
        assert delivered.acknowledged == 300 and delivered.pending == 0, delivered
        counts = wait_until(lambda: (c := child.counts())["busy"] + c["partial_bytes"] // (protocol.MAX_FRAME_BYTES - 1)
                            == n and c, "every first part kept or told busy")
        memory_is_bounded()
        assert 0 < counts["partial_bytes"] <= BUDGET and counts["busy"] > 0, counts
        replies: list[protocol.Frame] = []

        def all_busy_answered() -> bool:
            for sock in dealers:
                while sock.poll(0):
                    replies.append(protocol.decode_frame(sock.recv()))
            return len(replies) == counts["busy"]

        wait_until(all_busy_answered, "a busy answer for each frame that did not fit")
        assert all(isinstance(r, protocol.BusyFrame) for r in replies)
    with sqlite3.connect(tmp_path / "lit.db") as conn:
        assert conn.execute("SELECT count(*) FROM spans").fetchone()[0] == 300


def test_a_peer_without_the_keys_cannot_make_the_collector_hold_a_long_message(tmp_path):
    """Hole, before authentication: with CURVE keys on, a peer without them could still announce a 16 MiB handshake
    command and send it, and ZeroMQ held it until the handshake timed out (16 MiB each, 30 s). Now it is cut off at
    its header."""
    security.generate_keys(tmp_path / "keys")
    n = 20
    child = collector_process(tmp_path / "lit.db", keys_dir=tmp_path / "keys")
    rss0 = child.rss()
    host, port = child.endpoint.removeprefix("tcp://").rsplit(":", 1)
    peers = []
    try:
        for _ in range(n):
            peer = socket.create_connection((host, int(port)), timeout=WAIT_S)
            peers.append(peer)
            peer.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") + b"\0" * 32)
            read_exactly(peer, 64)
            try:
                announce_command(peer, protocol.MAX_FRAME_BYTES, protocol.MAX_FRAME_BYTES - 1)
            except OSError:  # cut off at the header
                pass
        grown = child.rss() - rss0
        assert grown < 32 * 2**20, f"the collector grew by {grown / 2**20:.0f} MiB for {n} peers without keys"
        wait_until(lambda: all(closed_by_peer(p) for p in peers), "every such peer cut off")
    finally:
        for peer in peers:
            peer.close()
        child.stop()


def test_a_frame_left_half_way_is_dropped_and_an_agents_large_frame_waits_its_turn(store, tmp_path):
    """A peer that sends the first part of a frame and stops holds its memory only until ``peer_idle_s``: then the
    frame is dropped (counted) and its reservation freed. Meanwhile an agent's frame in parts that does not fit is
    answered ``busy``, and the SDK sends it again until it goes in: nothing lost."""
    with Collector(store, "tcp://127.0.0.1:0", max_partial_bytes=protocol.MAX_FRAME_BYTES,
                   peer_idle_s=1.5, open_to_local_users=True) as collector:
        idle = dealer(collector.endpoint)
        idle.send(first_part("idle", protocol.MAX_FRAME_BYTES))
        wait_until(lambda: collector.counts.partial_bytes == protocol.MAX_FRAME_BYTES, "the idle frame reserved")
        large = span(1, rollout=None)
        large.attributes = {"text": "x" * (3 * protocol.PART_BYTES)}  # a frame of 4 parts
        sender = SpanSender(collector.endpoint, spool_dir=tmp_path / "spool", linger_s=0.01)
        try:
            sender.submit(large.to_wire())
            delivered = sender.flush(timeout=ACK_S)
        finally:
            sender.shutdown(timeout=1)
        counts = collector.counts
        idle.close()
    assert delivered.acknowledged == 1 and delivered.pending == 0 and delivered.dropped == 0, delivered
    with sqlite3.connect(store.path) as conn:
        (attributes,) = conn.execute("SELECT attributes FROM spans").fetchone()
    assert codec.unpackb(attributes) == large.attributes
    assert counts.busy >= 1 and counts.partials_dropped == 1 and counts.partial_bytes == 0, counts


HOARD_BYTES = 320 * 2**10
"""The frame each hoarding peer announces: 51 of them hold all but 64 KiB of a 16 MiB budget."""
HOARDERS = protocol.MAX_FRAME_BYTES // HOARD_BYTES
HOARD_IDLE_S = 3.0
"""The collector's ``peer_idle_s`` in the hoarding test; a hoarder's frame has this plus its length at
``parts.MIN_BYTES_PER_S`` (5 s) from its peer's first reservation."""


def part(batch: str, total: int, offset: int = 0) -> bytes:
    """One byte of a frame ``total`` bytes long, at ``offset``."""
    return codec.packb({"v": protocol.VERSION, "t": protocol.PART, "batch": batch, "total": total, "offset": offset,
                        "data": b"\0"})


def hoard(endpoint: str, variant: str, stop: threading.Event) -> None:
    """Hoarding peers, every 0.2 s until ``stop``: ``HOARDERS`` re-announce their frame (``re-announce``), alternate
    two frames (``alternating batches``), re-announce while new connections announce frames of their own
    (``new connections``), or trickle a byte each while new connections announce (``trickle, new connections``)."""
    peers = [(dealer(endpoint), f"h{i}") for i in range(HOARDERS)]
    sent = 0
    try:
        while not stop.wait(0.2):
            sent += 1
            for sock, batch in peers[:HOARDERS]:
                if variant.startswith("trickle"):
                    sock.send(part(batch, HOARD_BYTES, sent - 1))
                else:
                    sock.send(part(f"{batch}-{sent % 2}" if variant == "alternating batches" else batch, HOARD_BYTES))
            for sock, batch in peers[HOARDERS:]:
                sock.send(part(batch, HOARD_BYTES))
            if "new connections" in variant:
                peers += [(dealer(endpoint), f"n{sent}-{k}") for k in range(4)]
    finally:
        for sock, _ in peers:
            sock.close()


@pytest.mark.parametrize("variant", ["re-announce", "alternating batches", "new connections",
                                     "trickle, new connections"])
def test_peers_that_hoard_the_budget_for_frames_in_parts_keep_an_agent_out_for_one_deadline_at_most(
        store, tmp_path, variant):
    """Hole: a first part reserved its frame with a fresh deadline, so peers re-announcing first parts held the
    budget for good and an agent's large frame was told busy until they stopped; and whoever asked first took the
    room that freed. Now a peer's deadline counts from its first reservation, and the agent told busy first gets
    the room before newcomers and re-announcers: its large frame is stored within the hoarders' deadline (and the
    time it takes to ask again)."""
    deadline_s = HOARD_IDLE_S + HOARD_BYTES / parts.MIN_BYTES_PER_S
    large = span(1, rollout=None)
    large.attributes = {"text": "x" * (480 * 2**10)}  # 2 parts: more than the 64 KiB the hoarders leave
    stop = threading.Event()
    with Collector(store, "tcp://127.0.0.1:0", max_partial_bytes=protocol.MAX_FRAME_BYTES,
                   peer_idle_s=HOARD_IDLE_S, open_to_local_users=True) as collector:
        hoarders = threading.Thread(target=hoard, args=(collector.endpoint, variant, stop))
        hoarders.start()
        try:
            wait_until(lambda: collector.counts.partial_bytes == HOARDERS * HOARD_BYTES, "the budget hoarded")
            # asks again within 2 s (8 times ack_timeout_s), as the SDK does within seconds
            sender = SpanSender(collector.endpoint, spool_dir=tmp_path / "spool", linger_s=0.01, ack_timeout_s=0.25)
            try:
                t0 = time.monotonic()
                sender.submit(large.to_wire())
                delivered = sender.flush(timeout=deadline_s + 5)
                took = time.monotonic() - t0
            finally:
                sender.shutdown(timeout=1)
        finally:
            stop.set()
            hoarders.join()
        counts = collector.counts
    assert delivered.acknowledged == 1, f"{variant}: the agent's frame was not stored in {took:.1f} s: {counts}"
    with sqlite3.connect(store.path) as conn:
        (attributes,) = conn.execute("SELECT attributes FROM spans").fetchone()
    assert codec.unpackb(attributes) == large.attributes
    assert counts.busy >= 1 and counts.busy_peers >= 1, counts
    print(f"{variant}: stored after {took:.1f} s (deadline {deadline_s:.0f} s); {counts}")


def test_parts_are_put_together_in_order_one_frame_per_peer():
    frame = os.urandom(protocol.PART_BYTES * 2 + 10)
    parts = [protocol.decode_frame(m) for m in protocol.encode_parts("b", frame)]
    other = [protocol.decode_frame(m) for m in protocol.encode_parts("c", os.urandom(protocol.PART_BYTES + 1))]
    assembler = PartAssembler(budget=protocol.MAX_FRAME_BYTES, idle_s=10)
    assert assembler.add(b"p", parts[0], 0.0) is None
    assert assembler.add(b"p", parts[2], 0.0) is None  # out of order: ignored, and the frame given up
    assert assembler.counts.dropped == 1 and assembler.counts.reserved == 0
    assert [assembler.add(b"p", part, 1.0) for part in parts] == [None, None, frame]
    assert assembler.add(b"q", other[0], 2.0) is None and assembler.add(b"p", parts[0], 2.0) is None
    assert assembler.counts.reserved == len(frame) + other[0].total
    assert assembler.add(b"r", protocol.PartFrame("d", protocol.MAX_FRAME_BYTES, 0, b"x"), 2.0) is BUSY
    assert assembler.expire(12.5) == 2 and assembler.counts.reserved == 0
    assert assembler.counts == type(assembler.counts)(reserved=0, assembled=1, busy=1, dropped=3, busy_peers=1,
                                                      overdue=0)


def test_a_frame_that_trickles_in_is_dropped_at_its_deadline():
    """Hole: each part reset the idle clock, so a peer sending a byte of a 16 MiB frame every 25 s held 16 MiB of
    the shared budget for good (four such held all of it, and every agent's large frame was told busy). Now a frame
    has ``idle_s`` plus its length at ``MIN_BYTES_PER_S`` from its first part."""
    total = protocol.PART_BYTES * 4
    assembler = PartAssembler(budget=protocol.MAX_FRAME_BYTES, idle_s=10)
    deadline = 10 + total / parts.MIN_BYTES_PER_S
    now, offset = 0.0, 0
    while now <= deadline:
        assert assembler.add(b"p", protocol.PartFrame("b", total, offset, b"x"), now) is None
        assert assembler.expire(now) == 0  # a byte every 9 s: never idle for 10 s
        now, offset = now + 9, offset + 1
    assert assembler.expire(now) == 1 and assembler.counts.reserved == 0 and assembler.counts.dropped == 1
    whole = os.urandom(total)  # at the slowest rate allowed, a frame still arrives
    pieces = [protocol.decode_frame(m) for m in protocol.encode_parts("c", whole)]
    gap = (deadline - 1) / len(pieces)
    results = []
    for i, piece in enumerate(pieces):
        assembler.expire(now + i * gap)
        results.append(assembler.add(b"p", piece, now + i * gap))
    assert results[-1] == whole


def test_a_peer_that_re_announces_keeps_its_deadline_and_peers_told_busy_get_room_first():
    """Hole: a first part dropped the peer's unfinished frame and reserved the new one with a fresh deadline, so a
    peer re-announcing one every few seconds held its room for good; and freed room went to whoever asked first.
    Now the deadline counts from the peer's first reservation, and room goes to the peers told ``busy`` in the order
    they were told, before newcomers and re-announcers."""
    mib = 2**20

    def first(peer: bytes, batch: str, total: int, now: float) -> object:
        return assembler.add(peer, protocol.PartFrame(batch, total, 0, b"x"), now)

    assembler = PartAssembler(budget=protocol.MAX_FRAME_BYTES, idle_s=10)  # 16 MiB
    # a reserves 1 MiB at 0: its deadline is 0 + 10 + 1 MiB / 64 KiB/s = 26, whatever it re-announces meanwhile
    for now in (0.0, 9.0, 18.0, 25.0):
        assert first(b"a", f"a{now}", mib, now) is None and assembler.expire(now) == 0
    assert assembler.expire(25.9) == 0  # (the old code's deadline was 25 + 26 = 51)
    assert assembler.expire(26.1) == 1 and assembler.counts.overdue == 1 and assembler.counts.reserved == 0
    for now in (27.0, 36.0, 45.0):  # it held nothing: a new clock from 27, until 27 + 26 = 53
        assert first(b"a", f"a{now}", mib, now) is None
    assert assembler.expire(52.9) == 0 and assembler.expire(53.1) == 1

    assembler = PartAssembler(budget=protocol.MAX_FRAME_BYTES, idle_s=10)
    assert first(b"a", "a1", 12 * mib, 0.0) is None
    assert first(b"h", "h1", 8 * mib, 1.0) is BUSY  # 12 + 8 > 16: the honest agent waits, first
    assert first(b"n", "n1", mib, 2.0) is BUSY  # 12 + 1 fits, but h was told busy before this newcomer
    assert first(b"a", "a2", 12 * mib, 3.0) is BUSY  # a re-announces: its frame is dropped, and it waits behind n
    assert first(b"n", "n1", mib, 4.0) is BUSY  # nothing held now, but h is still first
    assert first(b"h", "h1", 8 * mib, 5.0) is None
    assert first(b"a", "a2", 12 * mib, 6.0) is BUSY  # n is before it
    assert first(b"n", "n1", mib, 7.0) is None
    assert first(b"a", "a2", 12 * mib, 8.0) is BUSY  # first now, but 8 + 1 + 12 > 16
    counts = assembler.counts
    assert (counts.reserved, counts.busy, counts.busy_peers) == (9 * mib, 6, 3), counts
    assert first(b"m", "m1", mib, 9.0) is BUSY  # behind a, which waits for room
    assembler.expire(18.5)  # a asked last at 8, m at 9: a loses its place, m keeps its own
    assert first(b"m", "m1", mib, 18.6) is None and counts.busy_peers + 1 == assembler.counts.busy_peers


# -- connections -------------------------------------------------------------------------------------------------

def agent(endpoint: str, keys_dir=None) -> Client:
    """A plain DEALER, a CURVE client when given the keys folder."""
    client = Client.__new__(Client)
    client.sock = zmq.Context.instance().socket(zmq.DEALER)
    client.sock.setsockopt(zmq.LINGER, 0)
    if keys_dir is not None:
        security.secure_client(client.sock, security.load_client_keys(keys_dir))
    client.sock.connect(endpoint)
    return client


def acked(client: Client, batch: str) -> bool:
    """Send one good frame, again every 2 s as an agent would, and wait up to ``ACK_S`` for its ack."""
    frame = spans_frame(batch, [span(1, rollout=None)])
    deadline = time.monotonic() + ACK_S
    while time.monotonic() < deadline:
        client.send(frame)
        resend = time.monotonic() + 2.0
        while time.monotonic() < min(resend, deadline):
            if client.sock.poll(100):
                reply = protocol.decode_frame(client.sock.recv())
                if isinstance(reply, protocol.AckFrame) and reply.batch == batch:
                    return True
    return False


def accepted(child: collector_process) -> int:
    """The idle connections ``child`` has accepted so far (open now, or closed for the cap; the agent's not counted)."""
    counts = child.counts()
    return counts["connections"] + counts["evicted"] - 1


@pytest.mark.parametrize("with_keys", [False, True], ids=["no keys", "CURVE keys"])
def test_a_flood_of_idle_connections_leaves_room_for_agents(tmp_path, with_keys):
    """Hole: nothing capped the connections, so a flood of idle TCP connections (no handshake, so keys do not stop
    it) used up the collector process's file descriptors, and an agent could not get in. Now the collector keeps
    at most what its open-files limit leaves, closing the oldest connection that has not delivered a frame: an agent
    that has delivered one stays, and a new one gets in."""
    keys_dir = None
    if with_keys:
        keys_dir = tmp_path / "keys"
        security.generate_keys(keys_dir)
    # The idle connections must stay while the flood builds up, not be closed by the handshake timeout (10 s).
    child = collector_process(tmp_path / "lit.db", nofile=NOFILE, keys_dir=keys_dir, handshake_s=600.0)
    client, newcomer = agent(child.endpoint, keys_dir), None
    flooders: list[socket.socket] = []
    try:
        assert acked(client, "before"), "no ack before the flood"
        flooders = flood_until(child.endpoint, lambda: child.counts()["evicted"], lambda: accepted(child))
        wait_until(lambda: child.counts()["evicted"], "the flood filling the collector's room (connections closed)")
        newcomer = agent(child.endpoint, keys_dir)
        assert acked(newcomer, "newcomer"), "a new agent could not get in during the flood"
        assert acked(client, "during"), "the agent that was in lost its connection to the flood"
    finally:
        for c in (client, newcomer):
            if c is not None:
                c.close()
        counts = child.stop()
        for sock in flooders:
            sock.close()
    assert counts["evicted"] > 0 and counts["frames"] >= 3, counts


IDLE_PEERS = 64


def test_idle_connections_are_closed_after_the_handshake_timeout(store):
    """Raw connections that never finish the handshake are closed after ``handshake_s`` (counted as refused
    ``handshake``), and one that finished it and stopped half-way through a message is closed after
    ``peer_idle_s`` (ZeroMQ's heartbeat), which frees what ZeroMQ held of its message."""
    with Collector(store, "tcp://127.0.0.1:0", handshake_s=1.0, peer_idle_s=2.0, open_to_local_users=True) as collector:
        # Fewer than the listener's backlog (ZeroMQ's default 100): under load, connections past it wait for a
        # SYN retry (1, 3, 7, 15, 31 s) and were still connecting when the 30 s below ran out (seen once).
        idle = flood(collector.endpoint, IDLE_PEERS)
        stalled = zmtp_connect(collector.endpoint)
        announce(stalled, protocol.PART_BYTES, 1000)
        client = Client(collector.endpoint)
        try:
            assert acked(client, "while-idle")
            wait_until(lambda: all(closed_by_peer(s) for s in idle), "the idle connections closed", timeout_s=30)
            wait_until(lambda: closed_by_peer(stalled), "the stalled peer's connection closed", timeout_s=30)
            assert acked(client, "after")  # the agent, which answers heartbeats, was not closed
            counts = wait_until(lambda: (c := collector.counts).connections == 1 and c,
                                "only the agent's connection left")
        finally:
            client.close()
            stalled.close()
            for sock in idle:
                sock.close()
    assert counts.refused_peers.get("handshake", 0) >= IDLE_PEERS, counts
