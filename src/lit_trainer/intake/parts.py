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
that trickles in slower than ``MIN_BYTES_PER_S`` (``idle_s`` plus its length at that rate), so that a peer sending
a byte now and then cannot hold it for good.

That deadline counts from the peer's first reservation, not from its latest first part: a frame that replaces the
peer's unfinished one keeps its clock, so a peer that re-announces a first part again and again, instead of sending
the rest, is dropped on time like one that trickles. The clock starts again only once the peer holds nothing (its
frame completed, or dropped). Room that frees goes to the peers told ``busy``, in the order they were first told,
before a newcomer or a re-announcing peer takes it: a peer may reserve only when nobody told ``busy`` before it
still waits. So however many connections a hostile peer opens, the agent told ``busy`` first gets in once the frames
held when it was told have completed or met their deadline. A peer waits in that order as long as it asks again
within ``idle_s`` (the SDK asks again within seconds); one that stops asking loses its place.
"""

from __future__ import annotations

from dataclasses import dataclass

from lit_sdk import protocol

MIN_BYTES_PER_S = 64 * 2**10
"""The slowest a frame in parts may come in, on average: a 16 MiB frame has 256 s, plus ``idle_s``."""

BUSY = object()
"""What ``add`` returns for a first part whose frame does not fit in the budget now, or whose peer must wait its
turn."""


@dataclass(slots=True)
class _Frame:
    batch: str
    total: int
    data: bytearray
    touched: float
    """When its last part came (``time.monotonic``)."""
    since: float
    """When its peer first reserved room: for this frame, or for the unfinished ones it replaced."""
    deadline: float
    """When it is dropped even if its parts keep coming (``MIN_BYTES_PER_S``, from ``since``)."""


@dataclass(frozen=True, slots=True)
class PartCounts:
    reserved: int
    """Bytes reserved now by frames in the making (never above the budget)."""
    assembled: int
    """Frames put together whole."""
    busy: int
    """First parts answered ``busy``: their frame did not fit in the budget, or peers told ``busy`` before were
    still waiting for room."""
    dropped: int
    """Frames given up half-way: idle for ``idle_s``, too slow (``MIN_BYTES_PER_S``), or replaced by the peer's next
    frame."""
    busy_peers: int
    """Peers told ``busy``, each counted once until it gets room (``busy`` counts every answer)."""
    overdue: int
    """Frames among ``dropped`` that were past their deadline: their peer held room too long."""


class PartAssembler:
    """Puts together the frames peers send in parts (see the module docstring). Used by one thread."""

    def __init__(self, budget: int, idle_s: float) -> None:
        if budget < protocol.MAX_FRAME_BYTES or idle_s <= 0:
            raise ValueError(f"PartAssembler: the budget must hold one frame of protocol.MAX_FRAME_BYTES "
                             f"({protocol.MAX_FRAME_BYTES}) and idle_s must be positive, got {budget} and {idle_s}")
        self.budget, self.idle_s = budget, idle_s
        self._frames: dict[bytes, _Frame] = {}
        self._waiting: dict[bytes, float] = {}
        """Peers told ``busy``, in the order they were first told, with when each last asked."""
        self._reserved = self._assembled = self._busy = self._dropped = self._busy_peers = self._overdue = 0

    @property
    def counts(self) -> PartCounts:
        return PartCounts(self._reserved, self._assembled, self._busy, self._dropped, self._busy_peers,
                          self._overdue)

    def add(self, peer: bytes, part: protocol.PartFrame, now: float) -> bytearray | object | None:
        """Take ``part`` from ``peer`` (its ZeroMQ routing id): the whole frame when this part completes it, ``BUSY``
        when its frame does not fit in the budget or the peer must wait its turn, else None (kept, or ignored)."""
        frame = self._frames.get(peer)
        if part.offset == 0:
            since = now if frame is None else frame.since  # a re-announced frame keeps the peer's clock
            if frame is not None:
                self._drop(peer)
            if not self._admit(peer, part.total, now):
                return BUSY
            frame = self._frames[peer] = _Frame(part.batch, part.total, bytearray(), now, since,
                                                since + self.idle_s + part.total / MIN_BYTES_PER_S)
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
        """Drop the frames that made no progress for ``idle_s``, or are past their deadline, and forget the waiting
        peers that stopped asking; how many frames."""
        idle = [peer for peer, frame in self._frames.items()
                if now - frame.touched > self.idle_s or now > frame.deadline]
        for peer in idle:
            self._overdue += now > self._frames[peer].deadline
            self._drop(peer)
        if self._waiting:
            self._waiting = {peer: asked for peer, asked in self._waiting.items() if now - asked <= self.idle_s}
        return len(idle)

    def _admit(self, peer: bytes, total: int, now: float) -> bool:
        """Whether ``peer`` may reserve ``total`` bytes now: they fit, and no peer told ``busy`` before it still
        waits. If not, it is told ``busy`` and waits its turn (keeping its place when it asks again)."""
        if next(iter(self._waiting), peer) == peer and self._reserved + total <= self.budget:
            self._waiting.pop(peer, None)
            return True
        self._busy += 1
        self._busy_peers += peer not in self._waiting
        self._waiting[peer] = now  # a peer already waiting keeps its place
        return False

    def _drop(self, peer: bytes) -> None:
        frame = self._frames.pop(peer)
        self._reserved -= frame.total
        self._dropped += 1
