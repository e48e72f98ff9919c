"""The wire format between agents and the trainer: versioned MessagePack frames with a type tag. Never pickle.

Frames (all MessagePack maps; see docs/protocol.md):

- ``spans`` (agent → trainer): ``{"v": 1, "t": "spans", "batch": str, "sender": str, "spans": [span, ...]}``
- ``ack``   (trainer → agent): ``{"v": 1, "t": "ack", "batch": str, "stored": int, "duplicates": int}``
- ``nack``  (trainer → agent): ``{"v": 1, "t": "nack", "batch": str, "reason": str}`` — the frame is refused
  for good (resending it cannot help); the sender counts its spans as rejected.

A span is a map with the keys of ``SpanRecord``. This module knows nothing of sockets, OpenTelemetry or SQLite:
it turns records into bytes and bytes back into validated records, and says in words what is wrong with a frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

VERSION = 1
MAX_FRAME_BYTES = 64 * 2**20
"""Frames above this size are refused before decoding."""

SPANS, ACK, NACK = "spans", "ack", "nack"
STATUS_UNSET, STATUS_OK, STATUS_ERROR = 0, 1, 2

AttrValue = str | bool | int | float | list


class ProtocolError(ValueError):
    """A frame that cannot be accepted. ``kind`` groups errors for counting and once-per-kind logging."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(slots=True)
class SpanRecord:
    """One finished OpenTelemetry span, as it travels and is stored."""

    trace_id: str
    """32 lowercase hex digits."""
    span_id: str
    """16 lowercase hex digits; unique: a second delivery of the same id is a duplicate."""
    parent_id: str | None
    name: str
    start_ns: int
    end_ns: int
    status: int = STATUS_UNSET
    status_message: str = ""
    rollout_id: str | None = None
    """The rollout the span belongs to, or None for a span outside any rollout."""
    attributes: dict[str, AttrValue] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    """``{"name": str, "time_ns": int, "attributes": {...}}`` each, e.g. a recorded exception."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "parent_id": self.parent_id,
            "name": self.name,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "status": self.status,
            "status_message": self.status_message,
            "rollout_id": self.rollout_id,
            "attributes": self.attributes,
            "events": self.events,
        }


@dataclass(slots=True)
class SpansFrame:
    batch: str
    sender: str
    spans: list[SpanRecord]


@dataclass(slots=True)
class AckFrame:
    batch: str
    stored: int
    duplicates: int


@dataclass(slots=True)
class NackFrame:
    batch: str
    reason: str


Frame = SpansFrame | AckFrame | NackFrame


def encode_spans(batch: str, sender: str, spans: list[SpanRecord]) -> bytes:
    frame = {"v": VERSION, "t": SPANS, "batch": batch, "sender": sender, "spans": [s.to_wire() for s in spans]}
    return msgpack.packb(frame, use_bin_type=True)


def encode_span_dicts(batch: str, sender: str, spans: list[dict[str, Any]]) -> bytes:
    """Like ``encode_spans`` for spans already in wire form (the exporter keeps them so)."""
    return msgpack.packb(
        {"v": VERSION, "t": SPANS, "batch": batch, "sender": sender, "spans": spans}, use_bin_type=True
    )


def encode_ack(batch: str, stored: int, duplicates: int) -> bytes:
    return msgpack.packb({"v": VERSION, "t": ACK, "batch": batch, "stored": stored, "duplicates": duplicates})


def encode_nack(batch: str, reason: str) -> bytes:
    return msgpack.packb({"v": VERSION, "t": NACK, "batch": batch, "reason": reason})


def decode_frame(data: bytes) -> Frame:
    """Decode and validate one frame; raise ProtocolError saying what is wrong."""
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError("too_large", f"frame of {len(data)} bytes is over the {MAX_FRAME_BYTES} byte limit")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError("decode", f"not a MessagePack frame: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("shape", f"a frame is a map, got {type(obj).__name__}")
    if obj.get("v") != VERSION:
        version = obj.get("v")
        raise ProtocolError("version", f"protocol version {version!r} is not supported (this side speaks {VERSION})")
    kind = obj.get("t")
    batch = obj.get("batch")
    if not isinstance(batch, str):
        raise ProtocolError("shape", "frame field 'batch' must be a string")
    if kind == SPANS:
        spans = obj.get("spans")
        sender = obj.get("sender")
        if not isinstance(spans, list) or not isinstance(sender, str):
            raise ProtocolError("shape", "a spans frame needs 'sender' (string) and 'spans' (list)")
        return SpansFrame(batch, sender, [_span_from_wire(s, i) for i, s in enumerate(spans)])
    if kind == ACK:
        stored, dups = obj.get("stored"), obj.get("duplicates")
        if not isinstance(stored, int) or not isinstance(dups, int):
            raise ProtocolError("shape", "an ack frame needs integer 'stored' and 'duplicates'")
        return AckFrame(batch, stored, dups)
    if kind == NACK:
        return NackFrame(batch, str(obj.get("reason", "")))
    raise ProtocolError("type", f"unknown frame type {kind!r}")


_HEX = frozenset("0123456789abcdef")


def _hex_id(value: Any, digits: int, what: str, index: int) -> str:
    if not isinstance(value, str) or len(value) != digits or not _HEX.issuperset(value):
        raise ProtocolError("span", f"span {index}: '{what}' must be {digits} lowercase hex digits, got {value!r}")
    return value


_STATUSES = (STATUS_UNSET, STATUS_OK, STATUS_ERROR)


def _span_from_wire(obj: Any, index: int) -> SpanRecord:
    """The fast path: every check of ``_span_from_wire_checked`` in one expression (the collector runs this for
    each of ~100k spans a second); when any fails, the checked path finds which and says so."""
    if isinstance(obj, dict) and len(obj) >= 11:
        get = obj.get
        trace_id, span_id, parent = get("trace_id"), get("span_id"), get("parent_id", 0)
        name, start, end, status = get("name"), get("start_ns"), get("end_ns"), get("status")
        message, rollout, attributes, events = get("status_message"), get("rollout_id", 0), get("attributes"), \
            get("events")
        if (
            type(trace_id) is str and len(trace_id) == 32 and _HEX.issuperset(trace_id)
            and type(span_id) is str and len(span_id) == 16 and _HEX.issuperset(span_id)
            and (parent is None or (type(parent) is str and len(parent) == 16 and _HEX.issuperset(parent)))
            and type(name) is str and isinstance(start, int) and isinstance(end, int) and status in _STATUSES
            and type(message) is str and (rollout is None or type(rollout) is str)
            and type(attributes) is dict and type(events) is list
        ):
            return SpanRecord(trace_id, span_id, parent, name, start, end, status, message, rollout, attributes,
                              events)
    return _span_from_wire_checked(obj, index)


def _span_from_wire_checked(obj: Any, index: int) -> SpanRecord:
    if not isinstance(obj, dict):
        raise ProtocolError("span", f"span {index} is not a map")
    try:
        parent = obj["parent_id"]
        record = SpanRecord(
            trace_id=_hex_id(obj["trace_id"], 32, "trace_id", index),
            span_id=_hex_id(obj["span_id"], 16, "span_id", index),
            parent_id=None if parent is None else _hex_id(parent, 16, "parent_id", index),
            name=obj["name"],
            start_ns=obj["start_ns"],
            end_ns=obj["end_ns"],
            status=obj["status"],
            status_message=obj["status_message"],
            rollout_id=obj["rollout_id"],
            attributes=obj["attributes"],
            events=obj["events"],
        )
    except KeyError as exc:
        raise ProtocolError("span", f"span {index} lacks the field {exc.args[0]!r}") from None
    checks = (
        (isinstance(record.name, str), "name must be a string"),
        (isinstance(record.start_ns, int) and isinstance(record.end_ns, int), "start_ns/end_ns must be integers"),
        (record.status in (STATUS_UNSET, STATUS_OK, STATUS_ERROR), "status must be 0, 1 or 2"),
        (isinstance(record.status_message, str), "status_message must be a string"),
        (record.rollout_id is None or isinstance(record.rollout_id, str), "rollout_id must be a string or nil"),
        (isinstance(record.attributes, dict), "attributes must be a map"),
        (isinstance(record.events, list), "events must be a list"),
    )
    for ok, message in checks:
        if not ok:
            raise ProtocolError("span", f"span {index} ({record.span_id}): {message}")
    return record
