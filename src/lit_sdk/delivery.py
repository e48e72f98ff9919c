"""What a ``SpanSender`` (sender.py) sends and counts: its batches of encoded spans, each batch's frame head, the
counts of what became of the spans in its charge, and the ledger it keeps them in while it runs."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from lit_sdk import protocol
from lit_sdk._spool import Entry
from lit_sdk.protocol import codec


@dataclass(frozen=True, slots=True)
class DeliveryCounts:
    """What a sender did with the spans in its charge, counted in spans (not batches), since it started."""

    submitted: int
    """Spans it took charge of: given to ``submit()`` (after shutdown too), plus those adopted from the spool of
    a process that died (damaged ones too, counted dropped). Always ``acknowledged + rejected + dropped +
    pending``."""
    sent: int
    """Spans whose batch was sent for the first time; resends are not counted again."""
    acknowledged: int
    """Spans the collector acknowledged, whether it stored them now or had them already."""
    duplicates: int
    """Of the acknowledged spans, those the collector already had (a resend whose first ack was lost)."""
    spooled: int
    """Spans left on disk alone, no longer held in memory: beyond ``max_memory_spans`` or ``max_memory_bytes``,
    or still undelivered at ``shutdown()``. (Every span is also written to the spool when it is submitted, so that
    it survives the process being killed; that is not counted here.)"""
    rejected: int
    """Spans of batches the collector refused for good (``nack``)."""
    dropped: int
    """Spans lost and logged: kept neither in memory nor in the spool (disk full, write error,
    ``max_spool_bytes``), too large for one frame, impossible to encode, or submitted after ``shutdown()``."""
    pending: int
    """Spans neither acknowledged, rejected nor dropped yet: in memory, on the wire or in the spool."""
    timed_out: bool = False
    """From ``flush(timeout)``: True when it returned because ``timeout`` passed before every span submitted
    before the call was settled (some may still be pending). False from ``counts``, ``shutdown()``, and a flush
    that finished."""
    corrupt: int = 0
    """Of the dropped spans, those whose record in the spool was damaged (a checksum failed: a flipped bit, a file
    changed by someone else) or gone when it was read back; the records around a damaged one are still delivered.
    A record torn by a writer killed mid-write is not counted: no one was told it was kept."""


@dataclass(eq=False, slots=True)
class Ledger:
    """What a running sender holds in memory and has counted so far, shared by the callers' threads and the sender's
    thread: read and change it with the sender's lock held."""

    tally: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("submitted", "sent", "acknowledged", "duplicates", "spooled", "rejected", "dropped", "corrupt"), 0))
    """The counts of ``DeliveryCounts`` that are counted, not worked out."""
    held_spans: int = 0
    """Spans in memory: submitted and not yet in a batch, in batches waiting to be sent, and in flight."""
    held_bytes: int = 0
    """Their encoded bytes."""

    def add(self, spans: int = 0, nbytes: int = 0, **counts: int) -> None:
        """Hold ``spans`` more spans of ``nbytes`` in memory (fewer if negative) and add ``counts`` to the tally."""
        self.held_spans += spans
        self.held_bytes += nbytes
        for name, n in counts.items():
            self.tally[name] += n


@dataclass(eq=False, slots=True)
class Batch:
    """Spans sent (or to be sent) in one frame, as the MessagePack bytes each encodes to."""

    batch_id: str
    payloads: list[bytes]
    entries: list[Entry]
    nbytes: int
    first_seq: int
    """The smallest sequence number of its spans (0 for adopted ones)."""
    attempts: int = 0
    resend_at: float = 0.0

    @property
    def n(self) -> int:
        return len(self.payloads)


def frame_head(sender_id: str, batch_id: str, n: int) -> bytes:
    """A ``spans`` frame up to its spans: ``protocol.encode_span_dicts`` of ``n`` spans is this followed by their
    encodings (spans are encoded once, in ``SpanSender.submit``, and kept so)."""
    head = codec.packb({"v": protocol.VERSION, "t": protocol.SPANS, "batch": batch_id, "sender": sender_id,
                        "spans": []})
    # "spans" is the last key and [] its last byte; MessagePack array headers: fixarray, array 16, array 32.
    count = bytes([0x90 | n]) if n < 16 else (b"\xdc" + struct.pack(">H", n) if n < 1 << 16
                                              else b"\xdd" + struct.pack(">I", n))
    return head[:-1] + count
