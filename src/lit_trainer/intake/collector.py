"""The trainer's end of span delivery: a ZeroMQ ROUTER that takes ``spans`` frames, stores them, then acknowledges.

One background thread owns the socket. Each turn it drains the frames that are waiting (up to ``max_frames`` and
``max_spans``), decodes and validates each with ``protocol.decode_frame_packed`` (msgspec; span attributes stay
the MessagePack bytes the agent sent, and are stored so), writes the spans of all the good ones in ONE store
transaction, and only after the commit answers each frame with an ``ack`` carrying its own stored and duplicate
counts; then it calls ``on_root_span(rollout_id)`` for each rollout root span stored for the first time.
An acknowledged span is therefore on disk, and a frame whose transaction failed is never acknowledged (its sender
sends it again).

Bad input is data, not a crash: a frame that fails to decode or validate (every integer, string, map and list of a
span is bounded: ``lit_sdk.protocol.codec``), has an unknown protocol version, or is not a ``spans`` frame is
rejected — answered with a ``nack`` when its ``batch`` id can be read, counted by ``ProtocolError.kind``, logged
once per kind — and the collector goes on.

What its peers can make it hold in memory, however many they are:

- ZeroMQ: a message over ``protocol.MAX_MESSAGE_BYTES`` is cut before it is read (``zmq.MAXMSGSIZE``; ZeroMQ drops
  that peer's connection), so a peer that announces one and stops costs at most that until ``peer_idle_s`` (the
  server's heartbeat) closes it; a frame longer than ``PART_BYTES`` comes in parts.
- Frames in parts: put together within ``max_partial_bytes`` for all peers at once (``parts.PartAssembler``); a
  frame that does not fit is answered ``busy`` and the agent sends it again later, when room that frees goes to the
  peers told ``busy`` in the order they were told. A peer holds its room at most until a deadline that counts from
  its first reservation, however often it re-announces a frame.
- Connections: at most ``max_peers`` (fewer if the descriptor limit says so), the oldest that has not delivered
  a valid frame closed beyond that (``connections.ConnectionLimit``); one that has not finished its handshake
  within ``handshake_s`` is closed by ZeroMQ.
- A turn holds at most ``max_turn_bytes`` of whole frames.

Beyond these, ZeroMQ queues up to ``_RCVHWM`` whole messages per connection while the thread commits. And a peer
that sends one ZeroMQ message of endless frames (``SNDMORE``) is buffered whole by ZeroMQ before the collector sees
any of it: libzmq has no cap on that, so only a peer past the handshake can do it (with keys, one holding the
client key; without, a process on this machine).
Anything else that goes wrong in the thread (the store fails: a full disk, an I/O error; ``on_root_span`` raises)
stops it, with nothing acknowledged that was not committed; ``check()`` and ``stop()`` re-raise it in the caller
as a ``CollectorError`` that names the cause. The trainer calls ``check()`` while it waits for rollouts.

It writes through the ``Store`` interface only.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import zmq

from lit_sdk import protocol
from lit_sdk.protocol import security
from lit_trainer.intake import admission
from lit_trainer.intake.connections import ConnectionLimit
from lit_trainer.intake.parts import BUSY, PartAssembler
from lit_trainer.intake.rows import Store

log = logging.getLogger("lit")

DEFAULT_ENDPOINT = "tcp://127.0.0.1:7373"
_POLL_MS = 50
"""How often the idle thread looks at its stop flag."""
_RCVHWM = 64
"""Messages ZeroMQ queues per peer before it stops reading from that peer's connection (TCP back-pressure); as many
as a sender keeps unacknowledged (``SpanSender(max_inflight_batches=64)``)."""
_EXPIRE_S = 0.5
"""How often the thread drops the frames in parts that stopped coming."""
_JOIN_S = 30.0
"""How long ``stop()`` waits for the thread to finish its turn (a commit in progress) before giving up."""


class CollectorError(RuntimeError):
    """The collector cannot bind, or its thread stopped on an error."""


@dataclass(frozen=True, slots=True)
class CollectorCounts:
    frames: int
    """Spans frames accepted and acknowledged (a resent frame counts again)."""
    spans_stored: int
    duplicates: int
    """Spans received that were already stored (a resend whose ack was lost)."""
    rejected: dict[str, int]
    """Frames refused, by ``ProtocolError.kind`` (``decode``, ``shape``, ``version``, ``type``, ``span``,
    ``too_large``)."""
    commits: int
    """Store transactions; ``frames / commits`` is how many frames one transaction carried on average."""
    refused_peers: dict[str, int]
    """Peers refused at the handshake, by kind (``security.HandshakeMonitor``): with ``keys`` a wrong or missing
    key; with or without, ``handshake`` for one that did not finish it within ``handshake_s`` (an idle connection)."""
    connections: int
    """Peer connections open now."""
    evicted: int
    """Connections closed because ``max_peers`` were open (the oldest that had not delivered a valid frame)."""
    partial_bytes: int
    """Bytes reserved now by frames coming in parts (at most ``max_partial_bytes``)."""
    busy: int
    """Frames in parts answered ``busy`` (the agent sends them again later): ``max_partial_bytes`` was taken, or
    peers told ``busy`` before were still waiting for it."""
    busy_peers: int
    """Peers told ``busy``, each counted once until it gets room."""
    partials_dropped: int
    """Frames in parts given up half-way (no part for ``peer_idle_s``, too slow, or the peer started another), their
    memory freed."""
    partials_overdue: int
    """Frames among ``partials_dropped`` whose peer held its room past its deadline (``parts.PartAssembler``)."""
    refused_spans: dict[str, int]
    """Spans of valid frames that the store refused (``intake/admission.py``: ``unknown_rollout``,
    ``wrong_secret``, ``second_root``); their frames were acknowledged."""


class Collector:
    """Receives spans at ``endpoint`` into ``store`` (see the module docstring). Use ``with`` or start/stop.

    endpoint: where to bind; ``tcp://127.0.0.1:0`` (or ``:*``) picks a free port, read back from ``.endpoint``.
        Agents find it through their ``LIT_ENDPOINT`` / ``lit.instrument(endpoint=...)``.
    keys: the trainer's CURVE keys (``security.load_server_keys``): only agents holding the client key get in.
        Without them the collector binds to loopback addresses only (``security.check_bind``), and only with
        ``open_to_local_users=True``: any user of this machine may then send it spans (``security.check_keyless``).
    on_root_span: called in the collector thread with the rollout id of each rollout root span, once, after the
        commit that stored it (so every span the agent sent before its root is readable from the store by then).
    max_frames, max_spans, max_turn_bytes: bounds on one transaction: frames drained per turn, spans in them and
        their bytes (checked after each frame, so one large frame still goes in whole). A few thousand spans per
        transaction make the fsync negligible while the decoded spans stay few (holding tens of thousands at once
        slows decoding: bench/ingest.py).
    max_partial_bytes: memory for frames coming in parts, all peers together (at least one frame of
        ``protocol.MAX_FRAME_BYTES``).
    max_peers: connections at once (one per agent process); fewer if the open-files limit leaves fewer beside the
        process's other listeners (``connections.ConnectionLimit.claim`` raises the soft limit toward the hard one
        first).
    handshake_s: a connection that has not finished its ZeroMQ handshake by then is closed.
    peer_idle_s: a connection that neither completes a message nor answers a heartbeat for this long is closed
        (its half-sent message freed), and a frame in parts with no part for this long is dropped.
    """

    def __init__(self, store: Store, endpoint: str = DEFAULT_ENDPOINT,
                 on_root_span: Callable[[str], None] | None = None, *, keys: security.ServerKeys | None = None,
                 max_frames: int = 1024,
                 max_spans: int = 4096, max_turn_bytes: int = 64 * 2**20, max_partial_bytes: int = 64 * 2**20,
                 max_peers: int = 1024, handshake_s: float = 10.0, peer_idle_s: float = 30.0,
                 open_to_local_users: bool = False):
        security.check_keyless(keys, open_to_local_users, "Collector", "can send it spans and hold its memory for "
                               "frames in parts")
        if min(max_frames, max_spans, max_turn_bytes, max_peers) <= 0:
            raise ValueError(f"Collector: max_frames, max_spans, max_turn_bytes and max_peers must be positive, got "
                             f"{max_frames}, {max_spans}, {max_turn_bytes}, {max_peers}")
        if max_partial_bytes < protocol.MAX_FRAME_BYTES:
            raise ValueError(f"Collector: max_partial_bytes must hold one frame of protocol.MAX_FRAME_BYTES "
                             f"({protocol.MAX_FRAME_BYTES}), got {max_partial_bytes}")
        if handshake_s < 0.001 or peer_idle_s < 0.003:
            raise ValueError(f"Collector: handshake_s and peer_idle_s must be at least a millisecond (and peer_idle_s "
                             f"three), got {handshake_s} and {peer_idle_s}")
        self.store = store
        self.requested_endpoint = endpoint
        self.on_root_span = on_root_span
        self.keys = keys
        self._monitor: security.HandshakeMonitor | None = None
        self._max_frames, self._max_spans, self._max_turn_bytes = max_frames, max_spans, max_turn_bytes
        self._parts = PartAssembler(max_partial_bytes, peer_idle_s)
        self._max_peers, self._handshake_s, self._peer_idle_s = max_peers, handshake_s, peer_idle_s
        self._limit: ConnectionLimit | None = None
        self._part_counts = self._parts.counts
        self._endpoint: str | None = None
        self._lock = threading.Lock()
        self._tally = {"frames": 0, "spans_stored": 0, "duplicates": 0, "commits": 0}
        self._rejected: dict[str, int] = {}
        self._refused: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def endpoint(self) -> str:
        """The endpoint actually bound (with the port chosen when port 0 or ``*`` was asked)."""
        if self._endpoint is None:
            raise CollectorError("the collector is not started: its endpoint is not bound yet")
        return self._endpoint

    @property
    def counts(self) -> CollectorCounts:
        refused = self._monitor.counts if self._monitor is not None else {}
        limit = self._limit
        with self._lock:
            parts = self._part_counts
            return CollectorCounts(**self._tally, rejected=dict(self._rejected), refused_peers=refused,
                                   connections=limit.open if limit else 0, evicted=limit.evicted if limit else 0,
                                   partial_bytes=parts.reserved, busy=parts.busy, busy_peers=parts.busy_peers,
                                   partials_dropped=parts.dropped, partials_overdue=parts.overdue,
                                   refused_spans=dict(self._refused))

    def start(self) -> Collector:
        """Bind (in the caller's thread, so that a busy port raises here) and start the thread."""
        if self._thread is not None:
            raise CollectorError("the collector is already started")
        _require_msgspec()
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        idle_ms = int(self._peer_idle_s * 1000)
        for option, value in ((zmq.LINGER, 0), (zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES), (zmq.RCVHWM, _RCVHWM),
                              (zmq.HANDSHAKE_IVL, int(self._handshake_s * 1000)),
                              (zmq.HEARTBEAT_IVL, idle_ms // 3), (zmq.HEARTBEAT_TIMEOUT, idle_ms)):
            sock.setsockopt(option, value)
        self._limit = ConnectionLimit.claim(self._max_peers, "the collector")
        try:
            self._monitor = security.guard_server(sock, self.requested_endpoint, self.keys, "the collector",
                                                  "collector.endpoint", watch=self._limit.on_event)
        except BaseException:
            sock.close()
            self._limit.release()
            raise
        try:
            sock.bind(self.requested_endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            self._limit.release()
            busy = " (the address is already in use: another trainer is running?)" if exc.errno == errno.EADDRINUSE \
                else ""
            raise CollectorError(
                f"the collector cannot bind {self.requested_endpoint}{busy}: {exc}. Choose another endpoint "
                "(collector.endpoint in a lit train config, Collector(endpoint=...) in Python; tcp://127.0.0.1:0 "
                "picks a free port) and point agents you started yourself at it (LIT_ENDPOINT or "
                "lit.instrument(endpoint=...))"
            ) from None
        self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._limit.listen(self._endpoint)
        self._stop.clear()
        self._error = None
        self._thread = threading.Thread(target=self._run, args=(sock,), name="lit-collector", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Finish the current turn, close the socket, and re-raise an error the thread stopped on. Idempotent."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(_JOIN_S)
            if thread.is_alive():
                raise CollectorError(f"the collector thread did not stop within {_JOIN_S:.0f} s")
        self.check()

    def check(self) -> None:
        """Raise, in the caller's thread, a ``CollectorError`` for the exception that stopped the collector thread
        (if one did); the original is its ``__cause__``."""
        if self._error is not None:
            error, self._error = self._error, None
            raise CollectorError(_explain(error, self.store)) from error

    def __enter__(self) -> Collector:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self, sock: zmq.Socket) -> None:
        try:
            expire_at = 0.0
            while not self._stop.is_set():
                if sock.poll(_POLL_MS):
                    self._turn(sock)
                now = time.monotonic()
                if now >= expire_at:
                    self._parts.expire(now)
                    self._count_parts()
                    expire_at = now + _EXPIRE_S
        except BaseException as exc:  # carried to the caller's thread by check()/stop()
            log.error("lit: the collector stopped on an error: %s: %s", type(exc).__name__, exc)
            self._error = exc
        finally:
            sock.close(linger=0)
            self._limit.release()

    def _turn(self, sock: zmq.Socket) -> None:
        """Drain waiting frames into one transaction, acknowledge them after the commit, then report roots."""
        good: list[tuple[list[bytes], protocol.PackedSpansFrame]] = []
        n_spans = n_bytes = 0
        for _ in range(self._max_frames):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            envelope, data = [p.bytes for p in parts[:-1]], parts[-1].bytes
            frame = self._accept(sock, envelope, data, part_ok=True)
            if isinstance(frame, protocol.PartFrame):
                data = self._assemble(sock, envelope, frame)
                frame = self._accept(sock, envelope, data, part_ok=False) if data is not None else None
            if frame is not None:
                self._limit.vouch(parts[-1].get(zmq.SRCFD))
                good.append((envelope, frame))
                n_spans += len(frame.spans)
                n_bytes += len(data)
                if n_spans >= self._max_spans or n_bytes >= self._max_turn_bytes:
                    break
        self._count_parts()
        if not good:
            return
        outcomes = self.store.add_packed_span_batches([frame.spans for _, frame in good], admit=True)
        with self._lock:  # before the acks, so that whoever saw an ack finds it counted
            t = self._tally
            t["frames"] += len(good)
            t["commits"] += 1
            t["spans_stored"] += sum(o.stored for o in outcomes)
            t["duplicates"] += sum(o.duplicates for o in outcomes)
            new_kinds = _add_counts(self._refused, [o.refused for o in outcomes])
        for kind in new_kinds:
            log.warning("lit: the collector refused a span (%s): %s. Later refusals of this kind are counted in "
                        "Collector.counts.refused_spans, not logged", kind, admission.EXPLAINED[kind])
        for (envelope, frame), outcome in zip(good, outcomes, strict=True):
            sock.send_multipart([*envelope, protocol.encode_ack(frame.batch, outcome.stored, outcome.duplicates)])
        if self.on_root_span is not None:
            for outcome in outcomes:
                for rollout_id in outcome.new_roots:
                    self.on_root_span(rollout_id)

    def _assemble(self, sock: zmq.Socket, envelope: list[bytes], part: protocol.PartFrame) -> bytearray | None:
        """The whole frame if ``part`` completes one; answers ``busy`` when its frame does not fit now."""
        if len(envelope) != 1:
            return None  # no routing id: not a peer of this ROUTER's
        whole = self._parts.add(envelope[0], part, time.monotonic())
        if whole is BUSY:
            sock.send_multipart([*envelope, protocol.encode_busy(part.batch)])
            return None
        return whole

    def _count_parts(self) -> None:
        """Publish the part counts; log the first peer told ``busy`` and the first frame overdue, once each."""
        counts = self._parts.counts
        with self._lock:
            before, self._part_counts = self._part_counts, counts
        if counts.busy_peers and not before.busy_peers:
            log.info("lit: the collector told a peer busy: frames in parts of other peers hold max_partial_bytes "
                     "(%d bytes); it sends its frame again and gets room in the order peers were told. Later ones "
                     "are counted in Collector.counts.busy and busy_peers, not logged", self._parts.budget)
        if counts.overdue and not before.overdue:
            log.warning("lit: the collector dropped a frame in parts whose peer held its room past its deadline "
                        "(peer_idle_s plus its length at parts.MIN_BYTES_PER_S, from the peer's first reservation): "
                        "a peer on a very slow link, or one holding room it does not use. Later ones are counted "
                        "in Collector.counts.partials_overdue, not logged")

    def _accept(self, sock: zmq.Socket, envelope: list[bytes], data: bytes | bytearray, part_ok: bool
                ) -> protocol.PackedSpansFrame | protocol.PartFrame | None:
        """The frame if it is a valid spans frame (or, with ``part_ok``, a part); otherwise reject it (count, log
        once, nack) and None."""
        try:
            frame = protocol.decode_frame_packed(data)
            if part_ok and isinstance(frame, protocol.PartFrame):
                return frame
            if not isinstance(frame, protocol.PackedSpansFrame):
                what = type(frame).__name__
                raise protocol.ProtocolError("type", f"the collector takes spans frames only, got a {what}")
        except protocol.ProtocolError as exc:
            self._reject(exc)
            batch = _batch_id(data)
            if batch is not None and envelope:
                sock.send_multipart([*envelope, protocol.encode_nack(batch, f"{exc.kind}: {exc}")])
            return None
        return frame

    def _reject(self, exc: protocol.ProtocolError) -> None:
        with self._lock:
            n = self._rejected.get(exc.kind, 0) + 1
            self._rejected[exc.kind] = n
        if n == 1:
            log.warning("lit: the collector rejected a frame (%s): %s. Later rejections of this kind are counted "
                        "in Collector.counts.rejected, not logged", exc.kind, exc)


def _add_counts(totals: dict[str, int], counts: list[dict[str, int]]) -> list[str]:
    """Add ``counts`` into ``totals``; the kinds counted for the first time."""
    new = []
    for kind, n in ((k, n) for c in counts for k, n in c.items()):
        if not totals.get(kind):
            new.append(kind)
        totals[kind] = totals.get(kind, 0) + n
    return new


def _require_msgspec() -> None:
    try:
        import msgspec  # noqa: F401  (the bounded decoder of protocol.packed)
    except ImportError:
        raise CollectorError("the collector needs msgspec, which decodes frames within bounds; install the "
                             "trainer extra: pip install 'lit[trainer]'") from None


def _explain(error: BaseException, store: Store) -> str:
    """Why the collector stopped, in words that name the fix."""
    where = getattr(store, "path", "the store")
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, sqlite3.Error) and ("full" in str(error) or isinstance(error, sqlite3.OperationalError)):
        return (f"the collector could not store spans in {where} ({text}), so it stopped: nothing it had not "
                "stored was acknowledged, and the agents keep those spans to send again. Free disk space there "
                "(or fix what the error names), then continue with `lit train ... --resume`")
    return (f"the collector stopped on an error ({text}); nothing it had not stored was acknowledged. This is a "
            "bug in lit or in the store backend: please report it with the log above")


def _batch_id(data: bytes) -> str | None:
    """The ``batch`` string of a rejected frame, read without decoding the rest (it may be huge or broken)."""
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1))
        unpacker.feed(data)
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key == "batch":
                value = unpacker.unpack()
                return value if isinstance(value, str) else None
            unpacker.skip()
    except Exception:  # anything unreadable: no batch id, no nack
        return None
    return None
