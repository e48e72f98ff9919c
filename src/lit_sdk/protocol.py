"""The wire format between agents and the trainer: versioned MessagePack frames with a type tag. Never pickle.

Frames (all MessagePack maps; see docs/protocol.md):

- ``spans`` (agent → trainer): ``{"v": 1, "t": "spans", "batch": str, "sender": str, "spans": [span, ...]}``
- ``ack``   (trainer → agent): ``{"v": 1, "t": "ack", "batch": str, "stored": int, "duplicates": int}``
- ``nack``  (trainer → agent): ``{"v": 1, "t": "nack", "batch": str, "reason": str}`` — the frame is refused
  for good (resending it cannot help); the sender counts its spans as rejected.

A span is a map with the keys of ``SpanRecord``. This module knows nothing of sockets, OpenTelemetry or SQLite:
it turns records into bytes and bytes back into validated records, and says in words what is wrong with a frame.
``decode_frame_packed`` is the trainer's fast way in: it validates exactly as ``decode_frame`` does but leaves each
span's attributes and events as the MessagePack bytes they arrived in (``PackedSpan``), ready to be stored. It
uses msgspec (the trainer extra's), imported on its first call: agents, which never call it, do not load it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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


class PackedSpan(NamedTuple):
    """A validated span whose ``attributes`` and ``events`` are still MessagePack bytes (a map and a list).

    The collector stores spans in this form: decoding the attributes (hundreds of token ids and logprobs per LLM
    call) into Python objects and encoding them again for the store took a third of its time per span. A plain
    tuple in ``SpanRecord``'s field order, so that the store can bind it as it is."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start_ns: int
    end_ns: int
    status: int
    status_message: str
    rollout_id: str | None
    attributes: bytes
    events: bytes

    def unpack(self) -> SpanRecord:
        """The ``SpanRecord``, attributes and events decoded."""
        return SpanRecord(*self[:9], _unpack_lenient(self.attributes), _unpack_lenient(self.events))


def pack_span(record: SpanRecord, pack: Callable[[Any], bytes] | None = None) -> PackedSpan:
    """The ``PackedSpan`` of a record. ``pack``: a reused ``msgpack.Packer(use_bin_type=True).pack`` (``packb``
    builds a Packer per call)."""
    pack = pack or _packb
    r = record
    return PackedSpan(r.trace_id, r.span_id, r.parent_id, r.name, r.start_ns, r.end_ns, r.status, r.status_message,
                      r.rollout_id, pack(r.attributes), pack(r.events))


def _packb(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _unpack_lenient(blob: bytes) -> Any:
    return msgpack.unpackb(blob, raw=False, strict_map_key=False)


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


Frame = SpansFrame | AckFrame | NackFrame
PackedFrame = PackedSpansFrame | AckFrame | NackFrame


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


# -- the trainer's fast way in -------------------------------------------------------------------------------------


def decode_frame_packed(data: bytes) -> PackedFrame:
    """``decode_frame``, with a spans frame's attributes and events kept as their wire bytes (``PackedSpan``).

    Accepts and rejects exactly what ``decode_frame`` does, with the same errors: a msgspec decoder handles the
    common shape (what the SDK sends) and gives up on anything else, which then goes through ``decode_frame`` —
    so the fast path only needs to be no more lenient than it, never to word an error. Without msgspec (an
    agent-side install; the trainer extra has it) every frame takes the ``decode_frame`` path."""
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError("too_large", f"frame of {len(data)} bytes is over the {MAX_FRAME_BYTES} byte limit")
    decode_fast = _fast_decoder()
    if decode_fast is not None:
        try:
            packed = decode_fast(data)
        except Exception:  # malformed somewhere: decode_frame below says where
            packed = None
        if packed is not None:
            return packed
    frame = decode_frame(data)
    if not isinstance(frame, SpansFrame):
        return frame
    pack = msgpack.Packer(use_bin_type=True).pack
    return PackedSpansFrame(frame.batch, frame.sender, [pack_span(s, pack) for s in frame.spans])


_FRAME_HEADER, _SPAN_HEADER = b"\x85", 0x8B
"""The map headers of a spans frame (5 fields) and of a span (11), as MessagePack packers write them (fixmap)."""
_EMPTY_LIST = b"\x90"
_hex_32 = re.compile("[0-9a-f]{32}").fullmatch
_hex_16 = re.compile("[0-9a-f]{16}").fullmatch


@functools.cache
def _fast_decoder() -> Callable[[bytes], PackedSpansFrame | None] | None:
    """A function that decodes a valid spans frame with msgspec, or returns None (or raises) for anything else;
    None when msgspec is not installed. Built on first use: the SDK side never imports msgspec.

    msgspec decodes a frame into typed structs in C, leaving each span's attributes and events as the raw bytes
    they arrived in, about 5x faster than msgpack's ``Unpacker`` walking it field by field. What it does not
    check, the code below does, so that it accepts no frame that ``decode_frame`` refuses:

    - duplicate keys: msgspec keeps the last value of a repeated key (as msgpack does) but only skips over an
      earlier raw ``attributes``, never checking it. The map headers must say exactly 5 and 11 entries, which,
      with every field required and unknown ones refused, leaves no room for a repeated key;
    - hex ids and the status range (in Python: msgspec's ``pattern`` constraint cost more than this);
    - attributes and events: decoded once to check them (valid UTF-8, string keys, a map and a list) and thrown
      away. Attributes of the documented shape (scalars and lists of scalars) are checked by msgspec; others by
      msgpack, with ``decode_frame``'s settings.

    ``int`` fields refuse booleans and ``str`` fields refuse binary, which ``decode_frame`` may accept: such a
    frame goes the slow way."""
    try:
        import msgspec
    except ImportError:
        return None

    # defstruct, not class statements: this module's postponed annotations would name a msgspec it lacks
    span_fields = [("trace_id", str), ("span_id", str), ("parent_id", str | None), ("name", str),
                   ("start_ns", int), ("end_ns", int), ("status", int), ("status_message", str),
                   ("rollout_id", str | None), ("attributes", msgspec.Raw), ("events", msgspec.Raw)]
    frame_fields = [("v", int), ("t", str), ("batch", str), ("sender", str), ("spans", list[msgspec.Raw])]
    wire_span = msgspec.defstruct("WireSpan", span_fields, forbid_unknown_fields=True)
    wire_frame = msgspec.defstruct("WireSpansFrame", frame_fields, forbid_unknown_fields=True)
    scalar = str | bool | int | float | None
    decode_frame_ = msgspec.msgpack.Decoder(wire_frame).decode
    decode_span = msgspec.msgpack.Decoder(wire_span).decode
    check_attributes = msgspec.msgpack.Decoder(dict[str, scalar | list[scalar]]).decode

    def decode(data: bytes) -> PackedSpansFrame | None:
        if data[:1] != _FRAME_HEADER:
            return None
        frame = decode_frame_(data)
        if frame.v != VERSION or frame.t != SPANS:
            return None
        spans = []
        for wire in frame.spans:
            blob = bytes(wire)
            if blob[0] != _SPAN_HEADER:
                return None
            s = decode_span(blob)
            parent, attributes, events = s.parent_id, bytes(s.attributes), bytes(s.events)
            if not (
                _hex_32(s.trace_id) and _hex_16(s.span_id) and (parent is None or _hex_16(parent))
                and s.status in _STATUSES and (events == _EMPTY_LIST or type(_unpack_strict(events)) is list)
            ):
                return None
            try:
                check_attributes(attributes)
            except Exception:  # a shape beyond scalars and lists of them: msgpack decides
                if type(_unpack_strict(attributes)) is not dict:
                    return None
            spans.append(PackedSpan(s.trace_id, s.span_id, parent, s.name, s.start_ns, s.end_ns, s.status,
                                    s.status_message, s.rollout_id, attributes, events))
        return PackedSpansFrame(frame.batch, frame.sender, spans)

    return decode


def _unpack_strict(blob: bytes) -> Any:
    """Decoded with ``decode_frame``'s settings, so that what it would refuse is refused here too."""
    return msgpack.unpackb(blob, raw=False, strict_map_key=True)
