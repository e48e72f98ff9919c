"""MessagePack for every lit channel, in one place: the settings lit encodes and decodes with, the protocol
version, the frame size limit, and the error a receiver raises for a frame it refuses. Never pickle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

VERSION = 1
"""The protocol version every frame carries as ``v`` (spans and dispatch channels alike)."""
MAX_FRAME_BYTES = 16 * 2**20
"""Frames above this size are refused before decoding. Senders cap their batches well below it. On the spans
channel a frame longer than ``PART_BYTES`` travels in pieces (``spans.encode_parts``)."""
PART_BYTES = 256 * 2**10
"""A spans frame longer than this is sent as ``part`` messages carrying this many bytes of it each, so that no
message of the spans channel is much longer: ZeroMQ allocates a message whole as soon as a peer announces its
length, and what it holds for a peer that announces one and stops is bounded by ``MAX_MESSAGE_BYTES``."""
MAX_MESSAGE_BYTES = PART_BYTES + 8 * 2**10
"""The longest ZeroMQ message of the spans channel: a part with its header (whose batch id of ``MAX_ID_CHARS``
characters takes at most 4 KiB). The collector cuts anything longer before it is read (``zmq.MAXMSGSIZE``)."""
MAX_SPANS_PER_FRAME = 4096
"""Spans in one ``spans`` frame."""
MAX_ITEMS = 1 << 20
"""Entries in any one map or list of a frame: attributes of a span, elements of one attribute's list, events."""
MAX_ID_CHARS = 1024
"""Characters in an identifier: a rollout id, a batch or sender id, an attribute key."""
MAX_NAME_CHARS = 4096
"""Characters in a span or event name."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""The integers a span's time fields may hold: what SQLite stores."""
WORDING_BYTES = 1 << 20
"""The trainer's fast decoder types every field as it decodes, so a hostile frame cannot make it allocate much
more than its own size; the generic decoder that words errors in detail builds Python objects for whatever the
frame holds (an empty map is 1 byte on the wire and about 64 in memory), so it only reads frames up to this size."""
assert MAX_MESSAGE_BYTES <= WORDING_BYTES  # a part is read by the generic decoder


class ProtocolError(ValueError):
    """A frame that cannot be accepted. ``kind`` groups errors for counting and once-per-kind logging."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def packb(value: Any) -> bytes:
    """Encode ``value`` (strings as str, bytes as bin)."""
    return msgpack.packb(value, use_bin_type=True)


def packer() -> Callable[[Any], bytes]:
    """A reusable encoder for hot loops: ``packb`` builds a ``Packer`` per call."""
    return msgpack.Packer(use_bin_type=True).pack


def unpackb(data: bytes, *, strict_map_key: bool = True) -> Any:
    """Decode one value; raises whatever msgpack raises for bad input. ``strict_map_key``: map keys must be str
    or bytes (what a receiver of untrusted frames wants); False for lit's own stored blobs."""
    return msgpack.unpackb(data, raw=False, strict_map_key=strict_map_key)


def check_size(data: bytes) -> None:
    """Refuse a frame over ``MAX_FRAME_BYTES`` (ProtocolError ``too_large``) before anything decodes it."""
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError("too_large", f"frame of {len(data)} bytes is over the {MAX_FRAME_BYTES} byte limit")


def decode_map(data: bytes) -> dict[str, Any]:
    """The first checks of every frame, before anything is allocated for it: its size, that it decodes, that it
    is a map, and that it speaks this ``VERSION``. Raises ProtocolError (``too_large``, ``decode``, ``shape``,
    ``version``); each channel then checks its own fields."""
    check_size(data)
    try:
        obj = unpackb(data)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError("decode", f"not a MessagePack frame: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("shape", f"a frame is a map, got {type(obj).__name__} {short_repr(obj)}")
    if "v" not in obj:
        raise ProtocolError("version", f"the frame carries no protocol version 'v' (is the other side a lit from "
                                       f"before protocol version {VERSION}? upgrade it)")
    version = obj["v"]
    if type(version) is not int or version != VERSION:  # True == 1 in Python: a boolean is no version
        raise ProtocolError("version", f"protocol version {version!r} is not supported (this side speaks "
                                       f"{VERSION}); run the same lit version on both sides")
    return obj


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages about received values."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
