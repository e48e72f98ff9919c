"""What a span sender's thread keeps until the collector answers: the batches waiting to be sent, the batches in
flight and when each goes again, and the spans set aside to the spool while memory is over its bounds.

A batch in flight that is not answered within ``ack_timeout_s`` is sent again, each wait twice the last, up to
``_MAX_BACKOFF`` times ``ack_timeout_s``; one the collector answered ``busy`` goes again sooner. When the spans held
in memory pass ``max_memory_spans`` or ``max_memory_bytes``, the newest waiting batches are left on disk alone and read
back from the spool, oldest first, when there is room again.

A ``Backlog`` belongs to the sender's thread; ``SpanSender`` (sender.py) keeps the socket, the callers' side and the
loop. What is held in memory and the counts are the sender's ``Ledger`` (delivery.py), changed under its lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from lit_sdk._spool import Entry, LostRecord, Spool
from lit_sdk.delivery import Batch, Ledger

TURN_BATCHES = 256
"""Batches formed or read back, and replies read, per turn of the sender's loop, so that one never starves the
others."""
_MAX_BACKOFF = 8
"""Resends wait ``ack_timeout_s``, then twice that, and so on up to this many times it."""
_BUSY_S = 0.1
"""A batch the collector answered ``busy`` goes again after this, doubling with each try (within its ack timeout's
schedule)."""


class Backlog:
    """The batches of one sender that the collector has not answered yet (see the module docstring)."""

    def __init__(self, spool: Spool, lock: threading.Lock, ledger: Ledger, drop: Callable[[int, str], None], *,
                 token: str, max_batch_spans: int, max_batch_bytes: int, max_memory_spans: int,
                 max_memory_bytes: int, ack_timeout_s: float, max_inflight_batches: int):
        """``ledger`` is read and changed with ``lock`` held; ``drop(n, why)`` counts and logs ``n`` spans lost."""
        self._spool, self._lock, self._ledger, self._drop = spool, lock, ledger, drop
        self._token = token
        self._max_batch, self._max_batch_bytes = max_batch_spans, max_batch_bytes
        self._max_memory, self._max_memory_bytes = max_memory_spans, max_memory_bytes
        self._ack_timeout, self._max_inflight = ack_timeout_s, max_inflight_batches
        self._waiting: deque[Batch] = deque()
        self._inflight: dict[str, Batch] = {}
        self._batch_no = 0

    def new_id(self) -> str:
        """An id for a new batch: the sender's token and the batch's number."""
        self._batch_no += 1
        return f"{self._token}-{self._batch_no}"

    def add(self, batch: Batch) -> None:
        """A batch formed of spans held in memory waits its turn to be sent."""
        self._waiting.append(batch)

    def has_unsent(self) -> bool:
        """Whether batches wait to be sent, in memory or on disk."""
        return bool(self._waiting) or self._spool.has_unread()

    def next_resend(self) -> float | None:
        """When the first batch in flight is due to go again (None: none in flight)."""
        return min((b.resend_at for b in self._inflight.values()), default=None)

    def oldest_seq(self) -> int:
        """The smallest sequence number of a span here or on disk (sys.maxsize: none)."""
        seqs = [self._spool.min_seq(), *(b.first_seq for b in self._waiting)]
        seqs.extend(b.first_seq for b in self._inflight.values())
        return min(seqs)

    def entries(self) -> list[Entry]:
        """The entries of every span in the backlog's batches."""
        return [e for b in [*self._waiting, *self._inflight.values()] for e in b.entries]

    def spill(self) -> None:
        """Keep memory within its bounds: the newest waiting batches are left on disk alone."""
        ledger = self._ledger
        while self._waiting and (ledger.held_spans > self._max_memory or ledger.held_bytes > self._max_memory_bytes):
            self._set_aside(self._waiting.pop())

    def set_aside_all(self) -> None:
        """At shutdown: leave every batch, in flight or waiting, to the spool alone."""
        for batch in [*self._inflight.values(), *self._waiting]:
            self._set_aside(batch)
        self._inflight.clear()
        self._waiting.clear()

    def send(self, now: float, transmit: Callable[[Batch], bool]) -> None:
        """Send what is due, with ``transmit`` (False: it cannot go now): first the batches in flight whose wait for
        an answer is over, then waiting ones (read back from disk when none is in memory) while fewer than
        ``max_inflight_batches`` are in flight. Stops at the first that cannot go, which waits first in line."""
        for batch in [b for b in self._inflight.values() if b.resend_at <= now]:
            del self._inflight[batch.batch_id]
            if not self._transmit(batch, now, transmit):
                return
        for _ in range(self._max_inflight):
            if len(self._inflight) >= self._max_inflight or (not self._waiting and not self._read_back()):
                return
            if not self._transmit(self._waiting.popleft(), now, transmit):
                return

    def answered(self, batch_id: str) -> Batch | None:
        """Take the batch the collector answered out of flight (None: a late answer to a batch resent or set aside
        since, which is answered again later)."""
        return self._inflight.pop(batch_id, None)

    def retry_soon(self, batch_id: str) -> bool:
        """The collector had no room for a batch sent in parts: it is not refused, and goes again after a short
        wait that doubles with each try (the collector frees room as frames complete or time out). Whether the
        batch is in flight."""
        batch = self._inflight.get(batch_id)
        if batch is None:
            return False
        batch.resend_at = min(batch.resend_at, time.monotonic() + _BUSY_S * 2 ** min(batch.attempts - 1, 6))
        return True

    def settle(self, batch: Batch, **counts: int) -> None:
        """An answered batch is done with: its spans leave memory and the spool, and ``counts`` are counted."""
        self._spool.release(batch.entries)
        with self._lock:
            self._ledger.add(-batch.n, -batch.nbytes, **counts)

    def _transmit(self, batch: Batch, now: float, transmit: Callable[[Batch], bool]) -> bool:
        """Send a batch and keep it in flight until its answer or its next send; if it cannot go now, it waits first
        in line. Whether it went."""
        if not transmit(batch):
            self._waiting.appendleft(batch)
            return False
        first_time = 0
        for entry in batch.entries:
            if not entry.sent:
                entry.sent = True
                first_time += 1
        if first_time:
            with self._lock:
                self._ledger.add(sent=first_time)
        batch.attempts += 1
        backoff = min(2 ** (batch.attempts - 1), _MAX_BACKOFF)
        batch.resend_at = now + self._ack_timeout * backoff
        self._inflight[batch.batch_id] = batch
        return True

    def _set_aside(self, batch: Batch) -> None:
        """Stop holding a batch in memory: its spans are read back from the spool when their turn comes."""
        kept = 0
        for payload, entry in zip(batch.payloads, batch.entries, strict=True):
            if entry.segment is not None:
                self._spool.set_aside(entry)
                kept += 1
            elif self._spool.write_late(entry, payload):  # its first write failed: try again
                kept += 1
        with self._lock:
            self._ledger.add(-batch.n, -batch.nbytes, spooled=kept)
        if kept < batch.n:
            self._drop(batch.n - kept, f"the spool at {self._spool.directory} could not keep them (see the warning "
                                       "about it above)")

    def _read_back(self) -> bool:
        """Move the oldest spans left on disk into memory, as one batch, if there is room; whether one came."""
        for _ in range(TURN_BATCHES):
            with self._lock:
                room_spans = self._max_memory - self._ledger.held_spans
                room_bytes = self._max_memory_bytes - self._ledger.held_bytes
                empty = self._ledger.held_spans == 0
            if not empty and (room_spans <= 0 or room_bytes <= 0):
                return False  # one batch at least, however big, when memory holds nothing
            try:
                items = self._spool.take(min(self._max_batch, max(room_spans, 1)),
                                         min(self._max_batch_bytes, max(room_bytes, 1)))
            except LostRecord as exc:
                with self._lock:
                    self._ledger.add(corrupt=exc.n_spans)
                self._drop(exc.n_spans, str(exc))
                continue
            if not items:
                return False
            payloads = [p for p, _ in items]
            entries = [e for _, e in items]
            nbytes = sum(map(len, payloads))
            with self._lock:
                self._ledger.add(len(items), nbytes)
            self._waiting.append(Batch(self.new_id(), payloads, entries, nbytes, min(e.seq for e in entries)))
            return True
        return False
