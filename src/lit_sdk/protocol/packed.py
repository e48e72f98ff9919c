"""The trainer's fast way into the spans channel: ``decode_frame_packed`` validates a frame exactly as
``spans.decode_frame`` does but leaves each span's attributes and events as the MessagePack bytes they arrived in
(``PackedSpan``), ready to be stored. It uses msgspec (the trainer extra's), imported on its first call: agents,
which never call it, do not load it.
"""

from __future__ import annotations

import functools
import re
import typing
from collections.abc import Callable

from lit_sdk.protocol.codec import VERSION, check_size, packer, unpackb
from lit_sdk.protocol.spans import (
    PACKED_FIELDS,
    SPAN_FIELDS,
    SPANS,
    STATUSES,
    PackedFrame,
    PackedSpan,
    PackedSpansFrame,
    SpanRecord,
    SpansFrame,
    decode_frame,
    pack_span,
)


def decode_frame_packed(data: bytes) -> PackedFrame:
    """``decode_frame``, with a spans frame's attributes and events kept as their wire bytes (``PackedSpan``).

    Accepts and rejects exactly what ``decode_frame`` does, with the same errors: a msgspec decoder handles the
    common shape (what the SDK sends) and gives up on anything else, which then goes through ``decode_frame`` —
    so the fast path only needs to be no more lenient than it, never to word an error. Without msgspec (an
    agent-side install; the trainer extra has it) every frame takes the ``decode_frame`` path."""
    check_size(data)  # before the fast path, which would decode it
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
    pack = packer()
    return PackedSpansFrame(frame.batch, frame.sender, [pack_span(s, pack) for s in frame.spans])


_FRAME_HEADER, _SPAN_HEADER = b"\x85", 0x80 | len(SPAN_FIELDS)
"""The map headers of a spans frame (5 fields) and of a span (one entry per field), as MessagePack packers write
them (fixmap)."""
_EMPTY_LIST = b"\x90"
_hex_32 = re.compile("[0-9a-f]{32}").fullmatch
_hex_16 = re.compile("[0-9a-f]{16}").fullmatch


@functools.cache
def _fast_decoder() -> Callable[[bytes], PackedSpansFrame | None] | None:
    """A function that decodes a valid spans frame with msgspec, or returns None (or raises) for anything else;
    None when msgspec is not installed. Built on first use: the SDK side never imports msgspec.

    msgspec decodes a frame into typed structs in C, leaving each span's attributes and events as the raw bytes
    they arrived in, much faster than msgpack's ``Unpacker`` walking it field by field (bench/README.md). What it
    does not check, the code below does, so that it accepts no frame that ``decode_frame`` refuses:

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

    # SpanRecord's fields and types, the packed ones left as raw bytes; defstruct, not class statements: this
    # module's postponed annotations would name a msgspec it lacks
    hints = typing.get_type_hints(SpanRecord)
    span_fields = [(name, msgspec.Raw if name in PACKED_FIELDS else hints[name]) for name in SPAN_FIELDS]
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
                and s.status in STATUSES and (events == _EMPTY_LIST or type(_unpack_strict(events)) is list)
            ):
                return None
            try:
                check_attributes(attributes)
            except Exception:  # a shape beyond scalars and lists of them: msgpack decides
                if type(_unpack_strict(attributes)) is not dict:
                    return None
            spans.append(PackedSpan(*msgspec.structs.astuple(s)[:-2], attributes, events))
        return PackedSpansFrame(frame.batch, frame.sender, spans)

    return decode


def _unpack_strict(blob: bytes) -> typing.Any:
    """Decoded with ``decode_frame``'s settings, so that what it would refuse is refused here too."""
    return unpackb(blob)
