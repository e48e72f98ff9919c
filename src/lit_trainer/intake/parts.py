"""Spans frames that come in ``part`` messages, put back together within one memory budget for all peers at once.

A spans frame longer than ``codec.PART_BYTES`` travels in pieces (``protocol.encode_parts``), so that ZeroMQ never
holds more than one short message for a peer that announces one and stops. The pieces are put together here
instead, where the memory they take is counted. A frame's parts come from one peer, in order, one frame after the
other (the agent's sender thread sends them back to back), so a peer has at most one frame in the making: a first
part replaces the unfinished frame before it, and a part that does not continue it is ignored (the rest of a frame
that was replaced or told ``busy``).

The first part names the frame's length, which is reserved from ``budget`` (shared by all peers) before anything
is kept: a frame that does not fit gets ``BUSY``, which the collector answers with ``busy`` — not refused, sent
again later by the agent, whose spans wait in its memory and spool. A frame that makes no progress for ``idle_s``
is dropped and its reservation freed, so a peer that stops half-way holds its share for a bounded time; so is one
that trickles in slower than ``MIN_BYTES_PER_S`` (``idle_s`` plus its length at that rate, from its first part),
so that a peer sending a byte now and then cannot hold it for good.
"""

from __future__ import annotations

from dataclasses import dataclass

from lit_sdk import protocol

MIN_BYTES_PER_S = 64 * 2**10
"""The slowest a frame in parts may come in, on average: a 16 MiB frame has 256 s, plus ``idle_s``."""

BUSY = object()
"""What ``add`` returns for a first part whose frame does not fit in the budget now."""


@dataclass(slots=True)
class _Frame:
    batch: str
    total: int
    data: bytearray
    touched: float
    """When its last part came (``time.monotonic``)."""
    deadline: float
    """When it is dropped even if its parts keep coming (``MIN_BYTES_PER_S``)."""


@dataclass(frozen=True, slots=True)
class PartCounts:
    reserved: int
    """Bytes reserved now by frames in the making (never above the budget)."""
    assembled: int
    """Frames put together whole."""
    busy: int
    """First parts answered ``busy``: their frame did not fit in the budget."""
    dropped: int
    """Frames given up half-way: idle for ``idle_s``, too slow (``MIN_BYTES_PER_S``), or replaced by the peer's next
    frame."""


class PartAssembler:
    """Puts together the frames peers send in parts (see the module docstring). Used by one thread."""

    def __init__(self, budget: int, idle_s: float) -> None:
        if budget < protocol.MAX_FRAME_BYTES or idle_s <= 0:
            raise ValueError(f"PartAssembler: the budget must hold one frame of protocol.MAX_FRAME_BYTES "
                             f"({protocol.MAX_FRAME_BYTES}) and idle_s must be positive, got {budget} and {idle_s}")
        self.budget, self.idle_s = budget, idle_s
        self._frames: dict[bytes, _Frame] = {}
        self._reserved = self._assembled = self._busy = self._dropped = 0

    @property
    def counts(self) -> PartCounts:
        return PartCounts(self._reserved, self._assembled, self._busy, self._dropped)

    def add(self, peer: bytes, part: protocol.PartFrame, now: float) -> bytearray | object | None:
        """Take ``part`` from ``peer`` (its ZeroMQ routing id): the whole frame when this part completes it, ``BUSY``
        when its frame does not fit in the budget, else None (kept, or ignored)."""
        frame = self._frames.get(peer)
        if part.offset == 0:
            if frame is not None:
                self._drop(peer)
            if self._reserved + part.total > self.budget:
                self._busy += 1
                return BUSY
            frame = self._frames[peer] = _Frame(part.batch, part.total, bytearray(), now,
                                                now + self.idle_s + part.total / MIN_BYTES_PER_S)
            self._reserved += part.total
        elif frame is None or (part.batch, part.total, part.offset) != (frame.batch, frame.total, len(frame.data)):
            if frame is not None:
                self._drop(peer)
            return None
        frame.data += part.data
        frame.touched = now
        if len(frame.data) < frame.total:
            return None
        del self._frames[peer]
        self._reserved -= frame.total
        self._assembled += 1
        return frame.data

    def expire(self, now: float) -> int:
        """Drop the frames that made no progress for ``idle_s``, or are past their deadline; how many."""
        idle = [peer for peer, frame in self._frames.items()
                if now - frame.touched > self.idle_s or now > frame.deadline]
        for peer in idle:
            self._drop(peer)
        return len(idle)

    def _drop(self, peer: bytes) -> None:
        frame = self._frames.pop(peer)
        self._reserved -= frame.total
        self._dropped += 1
