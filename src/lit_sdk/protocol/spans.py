"""The spans channel: agents deliver finished spans to the trainer's collector, which acknowledges them.

Frames (MessagePack maps; see docs/protocol.md):

- ``spans`` (agent → trainer): ``{"v": 1, "t": "spans", "batch": str, "sender": str, "spans": [span, ...]}``
- ``ack``   (trainer → agent): ``{"v": 1, "t": "ack", "batch": str, "stored": int, "duplicates": int}``
- ``nack``  (trainer → agent): ``{"v": 1, "t": "nack", "batch": str, "reason": str}`` — the frame is refused
  for good (resending it cannot help); the sender counts its spans as rejected.
- ``part``  (agent → trainer): ``{"v": 1, "t": "part", "batch": str, "total": int, "offset": int, "data": bin}`` —
  ``data`` is bytes ``offset`` to ``offset + len(data)`` of a spans frame ``total`` bytes long, longer than
  ``codec.PART_BYTES`` (``encode_parts``). The parts of a frame follow each other, in order.
- ``busy``  (trainer → agent): ``{"v": 1, "t": "busy", "batch": str}`` — the frame is not taken now (the trainer's
  memory for frames in parts is full), nor refused: send it again later.

A span is a map with the fields of ``SpanRecord``, the one definition of them: the wire form (``to_wire``), the
validation of a received span, the stored form (``PackedSpan``) and the trainer's fast decoder all follow from its
fields. The trainer's fast way in is in ``packed``.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lit_sdk.protocol import codec
from lit_sdk.protocol.codec import VERSION, ProtocolError, decode_map, packb, short_repr, unpackb

SPANS, ACK, NACK, PART, BUSY = "spans", "ack", "nack", "part", "busy"
STATUS_UNSET, STATUS_OK, STATUS_ERROR = 0, 1, 2
STATUSES = (STATUS_UNSET, STATUS_OK, STATUS_ERROR)

AttrValue = str | bool | int | float | list
_HEX = frozenset("0123456789abcdef")


def _hex(digits: int, nil: bool = False) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        return (nil and value is None) or (type(value) is str and len(value) == digits and _HEX.issuperset(value))

    return check


def _wire(check: Callable[[Any], bool], need: str, default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A ``SpanRecord`` field with how a received value is checked, and what it must be in words."""
    return field(default=default, metadata={"check": check, "need": need}, **kwargs)


def _text(limit: int, nil: bool = False) -> Callable[[Any], bool]:
    return lambda value: (nil and value is None) or (type(value) is str and len(value) <= limit)


def _int64(value: Any) -> bool:
    """An integer SQLite can store (a boolean is no integer here)."""
    return type(value) is int and codec.INT64_MIN <= value <= codec.INT64_MAX


_SCALARS = (str, bool, int, float, type(None))


def attributes_ok(value: Any) -> bool:
    """OpenTelemetry's attribute model, bounded: a map of at most ``MAX_ITEMS`` string keys (``MAX_ID_CHARS``
    each) to scalars or lists of at most ``MAX_ITEMS`` scalars. Nothing nests deeper, so a frame of attributes
    cannot take much more memory decoded than it takes on the wire."""
    if type(value) is not dict or len(value) > codec.MAX_ITEMS:
        return False
    for key, item in value.items():
        if type(key) is not str or len(key) > codec.MAX_ID_CHARS:
            return False
        if type(item) is list:
            if len(item) > codec.MAX_ITEMS or not all(type(x) in _SCALARS for x in item):
                return False
        elif type(item) not in _SCALARS:
            return False
    return True


EVENT_FIELDS = ("name", "time_ns", "attributes")


def events_ok(value: Any) -> bool:
    """At most ``MAX_ITEMS`` events, each exactly ``{"name": str, "time_ns": int, "attributes": {...}}``."""
    return type(value) is list and len(value) <= codec.MAX_ITEMS and all(
        type(e) is dict and len(e) == len(EVENT_FIELDS) and _text(codec.MAX_NAME_CHARS)(e.get("name"))
        and _int64(e.get("time_ns")) and attributes_ok(e.get("attributes")) for e in value)


@dataclass(slots=True)
class SpanRecord:
    """One finished OpenTelemetry span, as it travels and is stored."""

    trace_id: str = _wire(_hex(32), "must be 32 lowercase hex digits")
    """32 lowercase hex digits."""
    span_id: str = _wire(_hex(16), "must be 16 lowercase hex digits")
    """16 lowercase hex digits; unique within its rollout: a second delivery of the same id is a duplicate."""
    parent_id: str | None = _wire(_hex(16, nil=True), "must be 16 lowercase hex digits or nil")
    """None for a root span."""
    name: str = _wire(_text(codec.MAX_NAME_CHARS), f"must be a string of at most {codec.MAX_NAME_CHARS} characters")
    start_ns: int = _wire(_int64, "must be an integer of 64 bits")
    """Unix time in nanoseconds."""
    end_ns: int = _wire(_int64, "must be an integer of 64 bits")
    status: int = _wire(lambda v: type(v) is int and v in STATUSES, "must be 0, 1 or 2", STATUS_UNSET)
    """0 unset, 1 ok, 2 error."""
    status_message: str = _wire(_text(codec.MAX_ITEMS), f"must be a string of at most {codec.MAX_ITEMS} characters",
                                "")
    rollout_id: str | None = _wire(_text(codec.MAX_ID_CHARS, nil=True),
                                   f"must be nil or a string of at most {codec.MAX_ID_CHARS} characters", None)
    """The rollout the span belongs to, or None for a span outside any rollout."""
    attributes: dict[str, AttrValue] = _wire(
        attributes_ok, "must be a map of string keys to scalars or lists of scalars (see attributes_ok)",
        default_factory=dict)
    events: list[dict[str, Any]] = _wire(
        events_ok, 'must be a list of {"name": str, "time_ns": int, "attributes": map} (see events_ok)',
        default_factory=list)
    """``{"name": str, "time_ns": int, "attributes": {...}}`` each, e.g. a recorded exception."""

    def to_wire(self) -> dict[str, Any]:
        return dict(zip(SPAN_FIELDS, _field_values(self), strict=True))


SPAN_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SpanRecord))
"""The keys of a span on the wire, in ``SpanRecord``'s order."""
PACKED_FIELDS = ("attributes", "events")
"""The fields kept as MessagePack bytes in a ``PackedSpan``: the last two."""
assert SPAN_FIELDS[-len(PACKED_FIELDS):] == PACKED_FIELDS
_field_values = operator.attrgetter(*SPAN_FIELDS)
_CHECKS = tuple((f.name, f.metadata["check"], f.metadata["need"]) for f in dataclasses.fields(SpanRecord))


class PackedSpan(collections.namedtuple("PackedSpan", SPAN_FIELDS)):
    """A validated span whose ``attributes`` and ``events`` are still MessagePack bytes (a map and a list).

    The collector stores spans in this form: decoding the attributes (hundreds of token ids and logprobs per LLM
    call) into Python objects and encoding them again for the store was a large share of its time per span
    (bench/README.md). A plain tuple in ``SpanRecord``'s field order, so that the store can bind it as it is."""

    __slots__ = ()

    def unpack(self) -> SpanRecord:
        """The ``SpanRecord``, attributes and events decoded."""
        n = len(PACKED_FIELDS)
        return SpanRecord(*self[:-n], *(unpackb(blob, strict_map_key=False) for blob in self[-n:]))


def pack_span(record: SpanRecord, pack: Callable[[Any], bytes] | None = None) -> PackedSpan:
    """The ``PackedSpan`` of a record. ``pack``: a reused ``codec.packer()`` (``packb`` builds a Packer per call)."""
    pack = pack or packb
    values = _field_values(record)
    n = len(PACKED_FIELDS)
    return PackedSpan(*values[:-n], *map(pack, values[-n:]))


@dataclass(slots=True)
class SpansFrame:
    batch: str
    sender: str
    spans: list[SpanRecord]


@dataclass(slots=True)
class PackedSpansFrame:
    """A spans frame from ``decode_frame_packed``."""

    batch: str
    sender: str
    spans: list[PackedSpan]


@dataclass(slots=True)
class AckFrame:
    batch: str
    stored: int
    duplicates: int


@dataclass(slots=True)
class NackFrame:
    batch: str
    reason: str


@dataclass(slots=True)
class PartFrame:
    """A piece of a spans frame too long for one message (``encode_parts``)."""

    batch: str
    total: int
    """The whole frame's length in bytes."""
    offset: int
    data: bytes


@dataclass(slots=True)
class BusyFrame:
    batch: str


Frame = SpansFrame | AckFrame | NackFrame | PartFrame | BusyFrame
PackedFrame = PackedSpansFrame | AckFrame | NackFrame | PartFrame | BusyFrame


def encode_spans(batch: str, sender: str, spans: list[SpanRecord]) -> bytes:
    return encode_span_dicts(batch, sender, [s.to_wire() for s in spans])


def encode_span_dicts(batch: str, sender: str, spans: list[dict[str, Any]]) -> bytes:
    """Like ``encode_spans`` for spans already in wire form (the sender keeps them so)."""
    return packb({"v": VERSION, "t": SPANS, "batch": batch, "sender": sender, "spans": spans})


def encode_ack(batch: str, stored: int, duplicates: int) -> bytes:
    return packb({"v": VERSION, "t": ACK, "batch": batch, "stored": stored, "duplicates": duplicates})


def encode_nack(batch: str, reason: str) -> bytes:
    return packb({"v": VERSION, "t": NACK, "batch": batch, "reason": reason})


def encode_busy(batch: str) -> bytes:
    return packb({"v": VERSION, "t": BUSY, "batch": batch})


def encode_parts(batch: str, frame: bytes) -> list[bytes]:
    """The messages that carry ``frame`` (an encoded spans frame of batch ``batch``): the frame itself when it is
    at most ``codec.PART_BYTES`` long, else ``part`` frames of ``PART_BYTES`` of it each, to be sent in order."""
    total = len(frame)
    if total <= codec.PART_BYTES:
        return [frame]
    view = memoryview(frame)
    return [packb({"v": VERSION, "t": PART, "batch": batch, "total": total, "offset": offset,
                   "data": view[offset:offset + codec.PART_BYTES]}) for offset in range(0, total, codec.PART_BYTES)]


def decode_frame(data: bytes) -> Frame:
    """Decode and validate one frame; raise ProtocolError saying what is wrong."""
    obj = decode_map(data)
    kind = obj.get("t")
    batch = obj.get("batch")
    if not isinstance(batch, str) or len(batch) > codec.MAX_ID_CHARS:
        raise ProtocolError("shape", f"frame field 'batch' must be a string of at most {codec.MAX_ID_CHARS} "
                                     "characters")
    if kind == SPANS:
        spans = obj.get("spans")
        sender = obj.get("sender")
        if not isinstance(spans, list) or not isinstance(sender, str):
            raise ProtocolError("shape", "a spans frame needs 'sender' (string) and 'spans' (list)")
        if len(spans) > codec.MAX_SPANS_PER_FRAME or len(sender) > codec.MAX_ID_CHARS:
            raise ProtocolError("shape", f"a spans frame carries at most {codec.MAX_SPANS_PER_FRAME} spans and a "
                                         f"sender id of at most {codec.MAX_ID_CHARS} characters")
        return SpansFrame(batch, sender, [_span_from_wire(s, i) for i, s in enumerate(spans)])
    if kind == ACK:
        stored, dups = obj.get("stored"), obj.get("duplicates")
        if not isinstance(stored, int) or not isinstance(dups, int):
            raise ProtocolError("shape", "an ack frame needs integer 'stored' and 'duplicates'")
        return AckFrame(batch, stored, dups)
    if kind == NACK:
        return NackFrame(batch, str(obj.get("reason", "")))
    if kind == PART:
        return _part(batch, obj)
    if kind == BUSY:
        return BusyFrame(batch)
    raise ProtocolError("type", f"unknown frame type {kind!r}")


def _part(batch: str, obj: dict[str, Any]) -> PartFrame:
    total, offset, data = obj.get("total"), obj.get("offset"), obj.get("data")
    if type(total) is not int or type(offset) is not int or type(data) is not bytes:
        raise ProtocolError("part", "a part frame needs integer 'total' and 'offset' and binary 'data'")
    if not (0 < total <= codec.MAX_FRAME_BYTES and 0 <= offset and 0 < len(data) <= codec.PART_BYTES
            and offset + len(data) <= total):
        raise ProtocolError("part", f"a part carries 1 to {codec.PART_BYTES} bytes of a frame of at most "
                                    f"{codec.MAX_FRAME_BYTES} bytes, within it; got {len(data)} bytes at {offset} of "
                                    f"{total}")
    return PartFrame(batch, total, offset, data)


_MISSING = object()


def _span_from_wire(obj: Any, index: int) -> SpanRecord:
    """A received span map as a ``SpanRecord``, each field checked as ``SpanRecord`` declares; unknown keys are
    ignored (a later version may add optional ones)."""
    if not isinstance(obj, dict):
        raise ProtocolError("span", f"span {index} is not a map")
    values = []
    for name, check, need in _CHECKS:
        value = obj.get(name, _MISSING)
        if value is _MISSING:
            raise ProtocolError("span", f"span {index} lacks the field {name!r}")
        if not check(value):
            raise ProtocolError("span", f"span {index}: {name!r} {need}, got {short_repr(value)}")
        values.append(value)
    return SpanRecord(*values)
