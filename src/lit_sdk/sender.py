"""The agent side of span delivery: ``SpanSender`` takes finished spans in wire form and gets them to the trainer.

``submit`` encodes a span, appends it to the disk spool (``_spool``: a copy into a memory-mapped file, no fsync) and
to a deque, and returns: it never waits for the network and never raises. One background thread owns the ZeroMQ
DEALER socket (connected to the collector's ROUTER). It groups spans into batches (at most ``max_batch_spans`` spans and
``max_batch_bytes`` bytes, or whatever came within ``linger_s``), sends each as a ``spans`` frame and keeps it until
the collector's ``ack``; a batch not acknowledged within ``ack_timeout_s`` is sent again, with a doubling, capped
back-off. A frame longer than ``protocol.PART_BYTES`` goes as parts (``protocol.encode_parts``); one the collector
answers ``busy`` (no room for it now) is sent again after a shorter back-off, its spans still in our care. While
the trainer is away, spans wait in memory (``max_memory_spans``, ``max_memory_bytes``) and beyond that on disk
alone, read back from the spool when the trainer comes back. What the thread keeps until the collector answers (the
waiting batches, those in flight and their resends, the spans set aside to the spool) is its ``Backlog``
(``_backlog``); this module holds what the callers share with the thread, under one lock, and the socket and loop.

What is promised (a span survives the agent's ``kill -9`` once ``submit()`` returned, not a power loss; delivery at
least once, each span stored once) is stated in docs/reliability.md, section 1, with the tests that check it.

With ``keys`` (``security.ClientKeys``) the socket is a CURVE client of a collector holding the server key; without
them it reaches only a collector on this machine (``security.check_connect``).

It takes wire dicts (as ``SpanRecord.to_wire()`` makes them), not OpenTelemetry span objects.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import zmq

from lit_sdk import protocol
from lit_sdk._backlog import TURN_BATCHES, Backlog
from lit_sdk._spool import Entry, Spool, owner_name
from lit_sdk.delivery import Batch, DeliveryCounts, Ledger, frame_head
from lit_sdk.protocol import codec, security

log = logging.getLogger("lit")

_PROBE_S = 0.05
"""How soon a sender that found no trainer to send to tries again (ZeroMQ reconnects on its own)."""
_IDLE_S = 0.5
_DROP_LOG_S = 5.0
"""Drops of one kind are logged at most this often (with the count since the last line)."""
_JOIN_S = 30.0


def _check_limits(**limits: float) -> None:
    """ValueError naming the first of a sender's ``limits`` that is not positive, or a batch larger than a frame."""
    for name, value in limits.items():
        if value <= 0:
            raise ValueError(f"SpanSender: {name} must be positive, got {value!r}")
    if limits["max_batch_spans"] > codec.MAX_SPANS_PER_FRAME:
        raise ValueError(f"SpanSender: max_batch_spans must be at most {codec.MAX_SPANS_PER_FRAME} (spans in one "
                         f"frame), got {limits['max_batch_spans']}")


class SpanSender:
    """Delivers span wire dicts to the collector at ``endpoint`` (see the module docstring)."""

    def __init__(
        self,
        endpoint: str,
        *,
        spool_dir: Path,
        sender_id: str | None = None,
        max_batch_spans: int = 512,
        linger_s: float = 0.05,
        max_memory_spans: int = 100_000,
        ack_timeout_s: float = 2.0,
        max_inflight_batches: int = 64,
        max_spool_bytes: int = 1 << 30,
        max_batch_bytes: int = 4 << 20,
        max_memory_bytes: int = 256 << 20,
        keys: security.ClientKeys | None = None,
    ):
        _check_limits(max_batch_spans=max_batch_spans, max_memory_spans=max_memory_spans,
                      max_inflight_batches=max_inflight_batches, ack_timeout_s=ack_timeout_s,
                      max_batch_bytes=max_batch_bytes, max_memory_bytes=max_memory_bytes)
        security.check_connect(endpoint, keys, "lit.instrument()")
        self.endpoint, self._keys = endpoint, keys
        self.spool_dir = Path(spool_dir)
        self._token = secrets.token_hex(6)
        owner = owner_name(self._token)
        self.sender_id = sender_id or owner
        # What a frame holds besides its spans (batch ids grow; this one is longer than any we make).
        longest_head = frame_head(self.sender_id, f"{self._token}-{1 << 64}", 1 << 20)
        self._max_span_bytes = protocol.MAX_FRAME_BYTES - len(longest_head)
        if max_batch_bytes > self._max_span_bytes:
            raise ValueError(f"SpanSender: max_batch_bytes must leave room in a frame of protocol.MAX_FRAME_BYTES "
                             f"({protocol.MAX_FRAME_BYTES}): at most {self._max_span_bytes}, got {max_batch_bytes}")
        self._max_batch, self._max_batch_bytes, self._linger = max_batch_spans, max_batch_bytes, max(linger_s, 0.0)
        self._max_memory, self._max_memory_bytes = max_memory_spans, max_memory_bytes
        self._max_inflight = max_inflight_batches
        self._spool = Spool(self.spool_dir, owner, max_spool_bytes)
        # Shared with the callers' threads, under _lock.
        self._lock = threading.Lock()
        self._incoming: deque[tuple[bytes, Entry]] = deque()
        self._incoming_bytes = 0
        self._ledger = Ledger()  # the counts, and the spans in memory: in _incoming and in the backlog
        self._appended = 0  # sequence number of the last span submitted
        self._waiters: list[tuple[int, threading.Event]] = []
        self._closing = self._closed = False
        self._logged: set[str] = set()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # The thread's own.
        self._fill_since: float | None = None
        self._backlog = Backlog(self._spool, self._lock, self._ledger, self._drop, token=self._token,
                                max_batch_spans=max_batch_spans, max_batch_bytes=max_batch_bytes,
                                max_memory_spans=max_memory_spans, max_memory_bytes=max_memory_bytes,
                                ack_timeout_s=ack_timeout_s, max_inflight_batches=max_inflight_batches)
        self._away_until = 0.0
        self._unlogged_drops: dict[str, int] = {}
        self._next_drop_log = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lit-span-sender", daemon=True)
        self._thread.start()

    def submit(self, span: dict[str, Any]) -> None:
        """Take one span (a wire dict) for delivery: on disk (see the module docstring) when this returns.
        Thread-safe; never waits for the network, never raises."""
        try:
            try:
                payload: bytes | None = codec.packb(span)
                why = ""
            except Exception as exc:
                payload, why = None, f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._ledger.add(submitted=1)
                if self._closed:
                    self._refuse("closed", "lit: a span was submitted after the span sender was shut down; it is "
                                 "dropped, as will be any later ones (see counts.dropped)")
                elif payload is None:
                    self._refuse("encode", "lit: a span could not be encoded (%s); it is dropped (see "
                                  "counts.dropped)", why)
                elif len(payload) > self._max_span_bytes:
                    self._refuse("too_large", "lit: a span of %d bytes is dropped: it does not fit in one frame of "
                                 "protocol.MAX_FRAME_BYTES (%d bytes), which the collector could never take (see "
                                 "counts.dropped)", len(payload), protocol.MAX_FRAME_BYTES)
                else:
                    self._take(payload)
        except Exception:  # telemetry never breaks the user's call
            log.exception("lit: could not take a span for delivery")

    def flush(self, timeout: float | None = None) -> DeliveryCounts:
        """Send at once, and wait until every span submitted before this call (and every adopted one) is
        acknowledged, rejected or dropped, or ``timeout`` seconds pass (None: no limit). The counts, with
        ``timed_out`` True if it stopped waiting because of ``timeout``."""
        event = threading.Event()
        with self._lock:
            if self._closed:
                return self._counts_locked()
            waiter = (self._appended, event)
            self._waiters.append(waiter)
            self._wake()
        finished = event.wait(timeout)
        with self._lock:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            counts = self._counts_locked()
        # Nothing pending at all: whatever came before the call is settled, even if the thread had no turn yet.
        return counts if finished or not counts.pending else self._counts_locked(timed_out=True)

    def shutdown(self, timeout: float = 5.0) -> DeliveryCounts:
        """Flush for up to ``timeout`` seconds, leave what is still unacknowledged in the spool (synced; the next
        lit process to open the spool directory delivers it), stop the thread and close the socket. Idempotent."""
        with self._lock:
            first, self._closing = not self._closing, True
        if first:
            self.flush(timeout)
            with self._lock:
                self._closed = True
                self._stop.set()
                self._wake()
        self._thread.join(_JOIN_S)
        if self._thread.is_alive():
            log.warning("lit: the span sender's thread did not stop within %.0f s", _JOIN_S)
            return self.counts
        with self._lock:
            if self._wake_w >= 0:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1
            counts = self._counts_locked()
        if first and counts.pending:
            log.warning("lit: %d spans kept in the spool at %s; they will be delivered by the next lit process "
                        "that connects", counts.pending, self.spool_dir)
        return counts

    @property
    def counts(self) -> DeliveryCounts:
        with self._lock:
            return self._counts_locked()

    def _take(self, payload: bytes) -> None:
        """Write the span ahead to the spool and hold it in memory, or leave it on disk alone when memory is full
        (call with _lock held: the spool's order is the order of sequence numbers)."""
        self._appended += 1
        entry = self._spool.append(payload, self._appended)
        size = len(payload)
        if entry.segment is not None and (self._ledger.held_spans >= self._max_memory
                                          or self._ledger.held_bytes + size > self._max_memory_bytes):
            self._spool.set_aside(entry)
            self._ledger.add(spooled=1)
            return
        self._incoming.append((payload, entry))
        self._ledger.add(1, size)
        before, self._incoming_bytes = self._incoming_bytes, self._incoming_bytes + size
        n = len(self._incoming)
        if n == 1 or n == self._max_batch or before < self._max_batch_bytes <= self._incoming_bytes:
            self._wake()

    def _refuse(self, key: str, message: str, *args: Any) -> None:
        self._ledger.add(dropped=1)
        self._log_once(key, logging.WARNING, message, *args)

    def _counts_locked(self, timed_out: bool = False) -> DeliveryCounts:
        t = self._ledger.tally
        pending = t["submitted"] - t["acknowledged"] - t["rejected"] - t["dropped"]
        return DeliveryCounts(**t, pending=pending, timed_out=timed_out)

    def _wake(self) -> None:
        """Interrupt the thread's poll (call with _lock held, so that the pipe is not closed meanwhile)."""
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # a full pipe wakes the thread all the same; a closed one means it has stopped

    def _log_once(self, key: str, level: int, message: str, *args: Any, exc_info: bool = False) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, message, *args, exc_info=exc_info)

    def _add(self, **counts: int) -> None:
        with self._lock:
            self._ledger.add(**counts)

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        try:
            # IMMEDIATE: nothing is queued for a collector that is not there (a send fails, and the batch waits
            # with us, where it is counted and bounded); heartbeats notice a collector that vanished silently.
            for option, value in ((zmq.IMMEDIATE, 1), (zmq.LINGER, 0), (zmq.SNDHWM, self._send_hwm()),
                                  (zmq.RECONNECT_IVL, 100), (zmq.RECONNECT_IVL_MAX, 2000),
                                  (zmq.HEARTBEAT_IVL, 2000), (zmq.HEARTBEAT_TIMEOUT, 10_000)):
                sock.setsockopt(option, value)
            security.guard_client(sock, self.endpoint, self._keys, "lit.instrument()")
            sock.connect(self.endpoint)
            self._adopt()
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(self._wake_r, zmq.POLLIN)
            while not self._stop.is_set():
                try:
                    self._turn(sock, poller)
                except Exception:
                    self._log_once("turn", logging.ERROR, "lit: the span sender hit an error; it goes on",
                                   exc_info=True)
                    time.sleep(_PROBE_S)
            self._keep_the_rest(sock)
        except Exception:  # whatever it is, the callers must hear of it and stop waiting
            log.exception("lit: the span sender stopped on an error")
        finally:
            sock.close(linger=0)
            self._stop_callers()  # first: no span may be written to the spool once it is retired
            self._spool.retire()

    def _send_hwm(self) -> int:
        """ZeroMQ's queue for the collector, in messages: room for every batch in flight twice over (a resend may
        follow a first send still queued), each in as many parts as a full batch takes. A full queue makes a send
        fail as if the trainer were away (``_PROBE_S`` of waiting): with a queue of one message per batch, frames
        in two parts stalled the sender that way about 60 times per 100k spans in bench/ingest.py. The bytes it
        holds stay bounded by the batches in flight."""
        head = protocol.MAX_FRAME_BYTES - self._max_span_bytes  # the longest frame head (see __init__)
        return 2 * self._max_inflight * -(-(self._max_batch_bytes + head) // protocol.PART_BYTES)

    def _stop_callers(self) -> None:
        """The thread is ending: later spans are dropped, flushes return, and spans in memory only are lost."""
        with self._lock:
            self._closed = True
            held = [e for _, e in self._incoming]
            self._incoming.clear()
            for _, event in self._waiters:
                event.set()
            self._waiters.clear()
        held.extend(self._backlog.entries())
        lost = sum(1 for e in held if e.segment is None)  # the others are in the spool, for the next process
        if lost:
            self._drop(lost, "the span sender stopped on an error")
            self._log_drops()

    def _adopt(self) -> None:
        try:
            adopted, lost = self._spool.adopt()
            self._add(submitted=len(adopted) + lost, corrupt=lost, dropped=lost)
        except OSError as exc:
            log.warning("lit: could not look for spans left in the spool at %s: %s", self.spool_dir, exc)

    def _turn(self, sock: zmq.Socket, poller: zmq.Poller) -> None:
        ready = dict(poller.poll(self._poll_timeout() * 1000))
        if self._wake_r in ready:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        if sock in ready:
            self._receive(sock)
        with self._lock:
            waiters = list(self._waiters)
        now = time.monotonic()
        self._form_batches(now, force=bool(waiters))
        self._backlog.spill()
        self._send(sock, now)
        if waiters:
            self._settle(waiters)
        if self._unlogged_drops and now >= self._next_drop_log:
            self._log_drops()

    def _poll_timeout(self) -> float:
        now = time.monotonic()
        deadlines = [now + _IDLE_S]
        if self._incoming and (len(self._incoming) >= self._max_batch or self._waiters
                               or self._incoming_bytes >= self._max_batch_bytes):
            deadlines.append(now)
        elif self._fill_since is not None:
            deadlines.append(self._fill_since + self._linger)
        if self._away_until > now and self._backlog.has_unsent():
            deadlines.append(self._away_until)  # try again then
        resend_at = self._backlog.next_resend()
        if resend_at is not None:  # resends wait for the trainer too
            deadlines.append(max(resend_at, self._away_until))
        return max(0.0, min(deadlines) - now)

    def _form_batches(self, now: float, force: bool) -> None:
        with self._lock:
            if not self._incoming:
                self._fill_since = None
                return
            if self._fill_since is None:
                self._fill_since = now
        force = force or now - self._fill_since >= self._linger
        for _ in range(TURN_BATCHES):
            with self._lock:  # one batch at a time: the callers' submit() waits for this lock
                batch = self._next_batch(force)
            if batch is None:
                break
            self._backlog.add(batch)
        with self._lock:
            if not self._incoming:
                self._fill_since = None
            elif force:
                self._fill_since = now

    def _next_batch(self, force: bool) -> Batch | None:
        """Take a batch out of _incoming: a full one (``max_batch_spans`` or ``max_batch_bytes``), or with ``force``
        whatever is there. Call with _lock held."""
        full = len(self._incoming) >= self._max_batch or self._incoming_bytes >= self._max_batch_bytes
        if not self._incoming or not (full or force):
            return None
        payloads: list[bytes] = []
        entries: list[Entry] = []
        nbytes = 0
        while self._incoming and len(payloads) < self._max_batch:
            payload, entry = self._incoming[0]
            if payloads and nbytes + len(payload) > self._max_batch_bytes:
                break
            self._incoming.popleft()
            payloads.append(payload)
            entries.append(entry)
            nbytes += len(payload)
        self._incoming_bytes -= nbytes
        return Batch(self._backlog.new_id(), payloads, entries, nbytes, entries[0].seq)

    def _send(self, sock: zmq.Socket, now: float) -> None:
        if now < self._away_until:
            return
        self._backlog.send(now, lambda batch: self._transmit(sock, batch, now))

    def _transmit(self, sock: zmq.Socket, batch: Batch, now: float) -> bool:
        """Send a batch (in parts if it is long: ``protocol.encode_parts``); False (and the trainer taken as away) if
        it cannot go now. A frame cut off half-way is sent again whole: the collector drops the parts it got."""
        frame = b"".join([frame_head(self.sender_id, batch.batch_id, batch.n), *batch.payloads])
        try:
            for message in protocol.encode_parts(batch.batch_id, frame):
                sock.send(message, zmq.NOBLOCK)
        except zmq.Again:  # IMMEDIATE: no collector connected (or its queue for us is full)
            self._away_until = now + _PROBE_S
            return False
        except zmq.ZMQError as exc:
            self._log_once(f"send:{exc.errno}", logging.WARNING, "lit: could not send spans: %s", exc)
            self._away_until = now + _PROBE_S
            return False
        return True

    def _receive(self, sock: zmq.Socket) -> None:
        for _ in range(TURN_BATCHES):
            try:
                data = sock.recv_multipart(zmq.NOBLOCK)[-1]
            except zmq.Again:
                return
            try:
                frame = protocol.decode_frame(data)
            except protocol.ProtocolError as exc:
                self._log_once(f"reply:{exc.kind}", logging.WARNING,
                               "lit: ignoring a reply from the collector that is not a valid frame: %s", exc)
                continue
            if isinstance(frame, (protocol.SpansFrame, protocol.PartFrame)):
                self._log_once("reply:spans", logging.WARNING, "lit: ignoring a spans frame sent to this sender")
                continue
            if isinstance(frame, protocol.BusyFrame):
                if self._backlog.retry_soon(frame.batch):
                    self._log_once("busy", logging.INFO, "lit: the trainer's collector is busy with other large "
                                   "batches; this one waits and is sent again")
                continue
            batch = self._backlog.answered(frame.batch)
            if batch is None:
                continue  # a late ack of a batch resent or set aside since: it is acknowledged again later
            if isinstance(frame, protocol.AckFrame):
                self._backlog.settle(batch, acknowledged=batch.n, duplicates=min(max(frame.duplicates, 0), batch.n))
            else:
                self._log_once(f"nack:{frame.reason}", logging.WARNING,
                               "lit: the collector refused a batch of spans for good: %s", frame.reason)
                self._backlog.settle(batch, rejected=batch.n)

    def _settle(self, waiters: list[tuple[int, threading.Event]]) -> None:
        """Wake the flushes whose spans are all settled."""
        oldest = self._backlog.oldest_seq()
        with self._lock:
            if self._incoming:
                oldest = min(oldest, self._incoming[0][1].seq)
            for waiter in [w for w in waiters if w[0] < oldest]:
                waiter[1].set()
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def _drop(self, n: int, why: str) -> None:
        self._add(dropped=n)
        self._unlogged_drops[why] = self._unlogged_drops.get(why, 0) + n
        if time.monotonic() >= self._next_drop_log:
            self._log_drops()

    def _log_drops(self) -> None:
        total = self.counts.dropped
        for why, n in self._unlogged_drops.items():
            log.warning("lit: dropped %d spans (%d in all): %s", n, total, why)
        self._unlogged_drops.clear()
        self._next_drop_log = time.monotonic() + _DROP_LOG_S

    def _keep_the_rest(self, sock: zmq.Socket) -> None:
        """At shutdown: take the last acks, then leave every span still in memory to the spool alone."""
        self._receive(sock)
        while self._incoming:
            self._form_batches(time.monotonic(), force=True)
        self._backlog.set_aside_all()
        if self._unlogged_drops:
            self._log_drops()
