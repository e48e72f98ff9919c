"""The agent side of span delivery: ``SpanSender`` takes finished spans in wire form and gets them to the trainer.

``submit`` appends a span to a deque and returns: it never blocks the agent's thread and never raises. One
background thread owns the ZeroMQ DEALER socket (connected to the collector's ROUTER) and the disk spool. It groups
spans into batches (``max_batch_spans``, or whatever came within ``linger_s``), sends each as a ``spans`` frame and
keeps it until the collector's ``ack``; a batch not acknowledged within ``ack_timeout_s`` is sent again, with a
doubling, capped back-off. While the trainer is away, batches wait in memory (``max_memory_spans``) and then, oldest
first, in the spool (``_spool``), from which they are sent when it comes back: by this process, or by the next lit
process to open the same spool directory if this one exits first (it adopts the files of dead processes).

Delivery guarantee: at least once. A span leaves the sender's care only when the collector acknowledges its batch,
refuses it for good with a ``nack`` (counted as rejected), or it can be kept neither in memory nor on disk (counted
as dropped and logged: a full or unwritable spool, a span submitted after shutdown). A batch whose ack was lost is
sent again, so the collector may receive a span twice; it keeps the first copy by span id and reports the others
as duplicates, so that each span is stored exactly once.

It takes wire dicts (as ``SpanRecord.to_wire()`` makes them), not OpenTelemetry span objects.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from lit_sdk import protocol
from lit_sdk._spool import Batch, LostRecord, Spool

log = logging.getLogger("lit")

_PROBE_S = 0.05
"""How soon a sender that found no trainer to send to tries again (ZeroMQ reconnects on its own)."""
_MAX_BACKOFF = 8
"""Resends wait ``ack_timeout_s``, then twice that, and so on up to this many times it."""
_IDLE_S = 0.5
_TURN_BATCHES = 256
"""Batches formed, and replies read, per turn of the loop, so that one never starves the others."""
_DROP_LOG_S = 5.0
"""Drops of one kind are logged at most this often (with the count since the last line)."""
_JOIN_S = 30.0


@dataclass(frozen=True, slots=True)
class DeliveryCounts:
    """What a sender did with the spans in its charge, counted in spans (not batches), since it started."""

    submitted: int
    """Spans it took charge of: given to ``submit()`` (after shutdown too), plus those adopted from the spool of
    a process that died. Always ``acknowledged + rejected + dropped + pending``."""
    sent: int
    """Spans whose batch was sent for the first time; resends are not counted again."""
    acknowledged: int
    """Spans the collector acknowledged, whether it stored them now or had them already."""
    duplicates: int
    """Of the acknowledged spans, those the collector already had (a resend whose first ack was lost)."""
    spooled: int
    """Spans written to the disk spool."""
    rejected: int
    """Spans of batches the collector refused for good (``nack``)."""
    dropped: int
    """Spans lost and logged: the spool could not keep them (disk full, write error, ``max_spool_bytes``), they
    could not be encoded, or they were submitted after ``shutdown()``."""
    pending: int
    """Spans neither acknowledged, rejected nor dropped yet: in memory, on the wire or in the spool."""


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
    ):
        for name, value in (("max_batch_spans", max_batch_spans), ("max_memory_spans", max_memory_spans),
                            ("max_inflight_batches", max_inflight_batches), ("ack_timeout_s", ack_timeout_s)):
            if value <= 0:
                raise ValueError(f"SpanSender: {name} must be positive, got {value!r}")
        self.endpoint = endpoint
        self.spool_dir = Path(spool_dir)
        self._token = secrets.token_hex(6)
        self.sender_id = sender_id or f"{socket.gethostname()}-{os.getpid()}-{self._token}"
        self._max_batch, self._linger, self._max_memory = max_batch_spans, max(linger_s, 0.0), max_memory_spans
        self._ack_timeout, self._max_inflight = ack_timeout_s, max_inflight_batches
        # Shared with the callers' threads, under _lock.
        self._lock = threading.Lock()
        self._incoming: deque[dict[str, Any]] = deque()
        self._appended = 0  # sequence number of the last span put in _incoming
        self._tally = dict.fromkeys(("submitted", "sent", "acknowledged", "duplicates", "spooled", "rejected",
                                     "dropped"), 0)
        self._waiters: list[tuple[int, threading.Event]] = []
        self._closing = self._closed = False
        self._logged: set[str] = set()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # The thread's own.
        self._drained = 0  # spans taken out of _incoming
        self._fill_since: float | None = None
        self._waiting: deque[Batch] = deque()
        self._inflight: dict[str, Batch] = {}
        self._memory = 0  # spans in _waiting and _inflight
        self._away_until = 0.0
        self._batch_no = 0
        self._unlogged_drops: dict[str, int] = {}
        self._next_drop_log = 0.0
        self._spool = Spool(self.spool_dir, self._token, max_spool_bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lit-span-sender", daemon=True)
        self._thread.start()

    def submit(self, span: dict[str, Any]) -> None:
        """Take one span (a wire dict) for delivery. Thread-safe; never blocks, never raises."""
        try:
            with self._lock:
                self._tally["submitted"] += 1
                if self._closed:
                    self._tally["dropped"] += 1
                    self._log_once("closed", logging.WARNING, "lit: a span was submitted after the span sender "
                                   "was shut down; it is dropped, as will be any later ones (see counts.dropped)")
                    return
                self._incoming.append(span)
                self._appended += 1
                n = len(self._incoming)
                if n == 1 or n == self._max_batch:
                    self._wake()
        except Exception:  # telemetry never breaks the user's call
            log.exception("lit: could not take a span for delivery")

    def flush(self, timeout: float | None = None) -> DeliveryCounts:
        """Send at once, and wait until every span submitted before this call (and every adopted one) is
        acknowledged, rejected or dropped, or ``timeout`` seconds pass (None: no limit). The counts."""
        event = threading.Event()
        with self._lock:
            if self._closed:
                return self._counts_locked()
            waiter = (self._appended, event)
            self._waiters.append(waiter)
            self._wake()
        event.wait(timeout)
        with self._lock:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            return self._counts_locked()

    def shutdown(self, timeout: float = 5.0) -> DeliveryCounts:
        """Flush for up to ``timeout`` seconds, spool what is still unacknowledged (the next lit process to open
        the spool directory delivers it), stop the thread and close the socket. Idempotent."""
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

    def _counts_locked(self) -> DeliveryCounts:
        t = self._tally
        pending = t["submitted"] - t["acknowledged"] - t["rejected"] - t["dropped"]
        return DeliveryCounts(**t, pending=pending)

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
            for name, n in counts.items():
                self._tally[name] += n

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        try:
            # IMMEDIATE: nothing is queued for a collector that is not there (a send fails, and the batch waits
            # with us, where it is counted and bounded); heartbeats notice a collector that vanished silently.
            for option, value in ((zmq.IMMEDIATE, 1), (zmq.LINGER, 0), (zmq.SNDHWM, 2 * self._max_inflight),
                                  (zmq.RECONNECT_IVL, 100), (zmq.RECONNECT_IVL_MAX, 2000),
                                  (zmq.HEARTBEAT_IVL, 2000), (zmq.HEARTBEAT_TIMEOUT, 10_000)):
                sock.setsockopt(option, value)
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
            self._spool.retire()
            self._stop_callers()

    def _stop_callers(self) -> None:
        """The thread is ending: later spans are dropped, flushes return, and anything lost is counted."""
        with self._lock:
            self._closed = True
            lost = len(self._incoming) + self._memory
            self._incoming.clear()
            for _, event in self._waiters:
                event.set()
            self._waiters.clear()
        if lost:
            self._drop(lost, "the span sender stopped on an error")
            self._log_drops()

    def _adopt(self) -> None:
        try:
            self._add(submitted=self._spool.adopt())
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
        self._spill()
        self._send(sock, now)
        if waiters:
            self._settle(waiters)
        if self._unlogged_drops and now >= self._next_drop_log:
            self._log_drops()

    def _poll_timeout(self) -> float:
        now = time.monotonic()
        deadlines = [now + _IDLE_S]
        if self._incoming and (len(self._incoming) >= self._max_batch or self._waiters):
            deadlines.append(now)
        elif self._fill_since is not None:
            deadlines.append(self._fill_since + self._linger)
        if self._away_until > now and (self._waiting or self._spool.has_unread()):
            deadlines.append(self._away_until)  # try again then
        if self._inflight:  # resends wait for the trainer too
            deadlines.append(max(min(b.resend_at for b in self._inflight.values()), self._away_until))
        return max(0.0, min(deadlines) - now)

    def _form_batches(self, now: float, force: bool) -> None:
        if not self._incoming:
            self._fill_since = None
            return
        if self._fill_since is None:
            self._fill_since = now
        force = force or now - self._fill_since >= self._linger
        for _ in range(_TURN_BATCHES):
            k = min(len(self._incoming), self._max_batch)
            if k == 0 or (k < self._max_batch and not force):
                break
            spans = [self._incoming.popleft() for _ in range(k)]
            first_seq, self._drained = self._drained + 1, self._drained + k
            self._batch_no += 1
            batch_id = f"{self._token}-{self._batch_no}"
            try:
                frame = protocol.encode_span_dicts(batch_id, self.sender_id, spans)
            except Exception as exc:
                self._drop(k, f"a batch could not be encoded ({type(exc).__name__}: {exc})")
                continue
            self._waiting.append(Batch(batch_id, frame, k, first_seq))
            self._memory += k
        if not self._incoming:
            self._fill_since = None
        elif force:
            self._fill_since = now

    def _spill(self) -> None:
        """Keep memory within ``max_memory_spans``: the oldest waiting batches go to the spool."""
        while self._waiting and len(self._incoming) + self._memory > self._max_memory:
            batch = self._waiting.popleft()
            self._memory -= batch.n
            self._to_spool(batch)

    def _to_spool(self, batch: Batch) -> None:
        try:
            if self._spool.keep(batch):
                self._add(spooled=batch.n)
        except OSError as exc:
            self._drop(batch.n, f"the spool at {self.spool_dir} could not keep them: {exc}")

    def _send(self, sock: zmq.Socket, now: float) -> None:
        if now < self._away_until:
            return
        for batch in [b for b in self._inflight.values() if b.resend_at <= now]:
            del self._inflight[batch.batch_id]
            if not self._transmit(sock, batch, now):
                self._waiting.appendleft(batch)
                return
        for _ in range(self._max_inflight):
            if len(self._inflight) >= self._max_inflight or (not self._waiting and not self._read_back()):
                return
            batch = self._waiting[0]
            if self._inflight and sum(b.n for b in self._inflight.values()) + batch.n > self._max_memory:
                return
            self._waiting.popleft()
            if not self._transmit(sock, batch, now):
                self._waiting.appendleft(batch)
                return

    def _transmit(self, sock: zmq.Socket, batch: Batch, now: float) -> bool:
        """Send a batch and count it in flight; False (and the trainer taken as away) if it cannot go now."""
        try:
            sock.send(batch.frame, zmq.NOBLOCK)
        except zmq.Again:  # IMMEDIATE: no collector connected
            self._away_until = now + _PROBE_S
            return False
        except zmq.ZMQError as exc:
            self._log_once(f"send:{exc.errno}", logging.WARNING, "lit: could not send spans: %s", exc)
            self._away_until = now + _PROBE_S
            return False
        if not batch.sent:
            batch.sent = True
            self._add(sent=batch.n)
        batch.attempts += 1
        backoff = min(2 ** (batch.attempts - 1), _MAX_BACKOFF)
        batch.resend_at = now + self._ack_timeout * backoff
        self._inflight[batch.batch_id] = batch
        return True

    def _read_back(self) -> bool:
        """Move the oldest spooled batch into memory if it fits; whether one came."""
        for _ in range(_TURN_BATCHES):
            room = self._max_memory - len(self._incoming) - self._memory
            try:
                batch = self._spool.take(room if self._memory else 1 << 62)  # one at least, however big
            except LostRecord as exc:
                self._drop(exc.n_spans, str(exc))
                continue
            if batch is None:
                return False
            self._waiting.append(batch)
            self._memory += batch.n
            return True
        return False

    def _receive(self, sock: zmq.Socket) -> None:
        for _ in range(_TURN_BATCHES):
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
            if isinstance(frame, protocol.SpansFrame):
                self._log_once("reply:spans", logging.WARNING, "lit: ignoring a spans frame sent to this sender")
                continue
            batch = self._inflight.pop(frame.batch, None)
            if batch is None:
                continue  # a late ack of a batch resent or spooled since: it is acknowledged again later
            if isinstance(frame, protocol.AckFrame):
                self._settle_batch(batch, acknowledged=batch.n, duplicates=min(max(frame.duplicates, 0), batch.n))
            else:
                self._log_once(f"nack:{frame.reason}", logging.WARNING,
                               "lit: the collector refused a batch of spans for good: %s", frame.reason)
                self._settle_batch(batch, rejected=batch.n)

    def _settle_batch(self, batch: Batch, **counts: int) -> None:
        self._memory -= batch.n
        self._add(**counts)
        self._spool.release(batch)

    def _settle(self, waiters: list[tuple[int, threading.Event]]) -> None:
        """Wake the flushes whose spans are all settled."""
        seqs = [self._spool.min_seq(), *(b.first_seq for b in self._waiting)]
        seqs.extend(b.first_seq for b in self._inflight.values())
        if self._incoming:
            seqs.append(self._drained + 1)
        oldest = min(seqs)
        done = [w for w in waiters if w[0] < oldest]
        if done:
            with self._lock:
                for waiter in done:
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
        """At shutdown: take the last acks, then spool every batch still waiting or in flight."""
        self._receive(sock)
        while self._incoming:
            self._form_batches(time.monotonic(), force=True)
        for batch in [*self._inflight.values(), *self._waiting]:
            self._to_spool(batch)
        self._inflight.clear()
        self._waiting.clear()
        self._memory = 0
        self._spool.close()
        if self._unlogged_drops:
            self._log_drops()
