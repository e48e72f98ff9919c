"""The trainer's fast way into the spans channel: ``decode_frame_packed`` validates a frame exactly as
``spans.decode_frame`` does but leaves each span's attributes and events as the MessagePack bytes they arrived in
(``PackedSpan``), ready to be stored. It uses msgspec (the trainer extra's), imported on its first call: agents,
which never call it, do not load it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from lit_sdk.protocol import codec
from lit_sdk.protocol.codec import VERSION, ProtocolError, check_size, packer
from lit_sdk.protocol.spans import (
    PACKED_FIELDS,
    SPAN_FIELDS,
    SPANS,
    STATUSES,
    PackedFrame,
    PackedSpan,
    PackedSpansFrame,
    SpansFrame,
    decode_frame,
    pack_span,
)


def decode_frame_packed(data: bytes) -> PackedFrame:
    """``decode_frame``, with a spans frame's attributes and events kept as their wire bytes (``PackedSpan``).

    Accepts what ``decode_frame`` accepts, within bounds: a msgspec decoder types every field as it decodes
    (``_fast_decoder``), so a hostile frame cannot make it build much more in memory than the frame's own size.
    A frame it refuses is decoded again by ``decode_frame`` when it is at most ``codec.WORDING_BYTES`` long, which
    words the error in detail and accepts what only differs in form (keys in another order, a field a later
    version added); a larger refused frame is rejected with msgspec's own account of what is wrong. Without
    msgspec (an agent-side install; the trainer extra has it) every frame takes the ``decode_frame`` path."""
    check_size(data)  # before the fast path, which would decode it
    decode_fast = _fast_decoder()
    if decode_fast is None:
        return _slow(data)
    try:
        return decode_fast(data)
    except ProtocolError:
        if len(data) > codec.WORDING_BYTES:
            raise
        return _slow(data)  # words the error, or accepts a frame that differs only in form


def _slow(data: bytes) -> PackedFrame:
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
def _fast_decoder() -> Callable[[bytes], PackedSpansFrame] | None:
    """A function that decodes a valid spans frame with msgspec and raises ProtocolError for anything else; None
    when msgspec is not installed. Built on first use: the SDK side never imports msgspec.

    msgspec decodes a frame into typed structs in C, leaving each span's attributes and events as the raw bytes
    they arrived in, much faster than msgpack's ``Unpacker`` walking it field by field (bench/README.md). Every
    type carries the bounds of ``codec`` (spans per frame, items per map or list, characters, 64-bit times), which
    msgspec checks from a container's header before it decodes the items, so a frame is refused before it costs
    memory. What msgspec does not check, the code below does, so that it accepts no frame ``decode_frame`` refuses:

    - duplicate keys: msgspec keeps the last value of a repeated key (as msgpack does) but only skips over an
      earlier raw ``attributes``, never checking it. The map headers must say exactly 5 and 11 entries, which,
      with every field required and unknown ones refused, leaves no room for a repeated key;
    - hex ids and the status range (in Python: msgspec's ``pattern`` constraint cost more than this);
    - attributes and events: decoded once with their bounded types to check them, and thrown away."""
    try:
        import msgspec
    except ImportError:
        return None
    from typing import Annotated

    meta = msgspec.Meta
    ident = Annotated[str, meta(max_length=codec.MAX_ID_CHARS)]
    int64 = Annotated[int, meta(ge=codec.INT64_MIN, le=codec.INT64_MAX)]
    scalar = str | bool | int | float | None
    attributes = Annotated[dict[ident, scalar | Annotated[list[scalar], meta(max_length=codec.MAX_ITEMS)]],
                           meta(max_length=codec.MAX_ITEMS)]
    event = msgspec.defstruct("WireEvent", [("name", Annotated[str, meta(max_length=codec.MAX_NAME_CHARS)]),
                                            ("time_ns", int64), ("attributes", attributes)],
                              forbid_unknown_fields=True)
    types = {"trace_id": str, "span_id": str, "parent_id": str | None,
             "name": Annotated[str, meta(max_length=codec.MAX_NAME_CHARS)], "start_ns": int64, "end_ns": int64,
             "status": int, "status_message": Annotated[str, meta(max_length=codec.MAX_ITEMS)],
             "rollout_id": ident | None}
    assert set(types) == set(SPAN_FIELDS) - set(PACKED_FIELDS)
    span_fields = [(name, msgspec.Raw if name in PACKED_FIELDS else types[name]) for name in SPAN_FIELDS]
    frame_fields = [("v", int), ("t", str), ("batch", ident), ("sender", ident),
                    ("spans", Annotated[list[msgspec.Raw], meta(max_length=codec.MAX_SPANS_PER_FRAME)])]
    wire_span = msgspec.defstruct("WireSpan", span_fields, forbid_unknown_fields=True)
    wire_frame = msgspec.defstruct("WireSpansFrame", frame_fields, forbid_unknown_fields=True)
    decode_frame_ = msgspec.msgpack.Decoder(wire_frame).decode
    decode_span = msgspec.msgpack.Decoder(wire_span).decode
    check_attributes = msgspec.msgpack.Decoder(attributes).decode
    check_events = msgspec.msgpack.Decoder(Annotated[list[event], meta(max_length=codec.MAX_ITEMS)]).decode

    def decode(data: bytes) -> PackedSpansFrame:
        where = "the frame"
        try:
            if data[:1] != _FRAME_HEADER:
                raise ProtocolError("shape", "not a map of exactly the 5 fields of a spans frame")
            frame = decode_frame_(data)
            if frame.v != VERSION or frame.t != SPANS:
                raise ProtocolError("version" if frame.v != VERSION else "type",
                                    f"protocol version {frame.v} frame of type {frame.t!r}, not a spans frame of "
                                    f"version {VERSION}")
            spans = []
            for i, wire in enumerate(frame.spans):
                where = f"span {i}"
                blob = bytes(wire)
                if blob[:1] != bytes([_SPAN_HEADER]):
                    raise ProtocolError("span", f"span {i} is not a map of exactly the {len(SPAN_FIELDS)} fields "
                                                "of a span")
                s = decode_span(blob)
                parent, attrs, events = s.parent_id, bytes(s.attributes), bytes(s.events)
                if not (_hex_32(s.trace_id) and _hex_16(s.span_id) and (parent is None or _hex_16(parent))):
                    raise ProtocolError("span", f"span {i}: ids must be lowercase hex (32 and 16 digits)")
                if s.status not in STATUSES:
                    raise ProtocolError("span", f"span {i}: 'status' must be 0, 1 or 2")
                check_attributes(attrs)
                if events != _EMPTY_LIST:
                    check_events(events)
                spans.append(PackedSpan(*msgspec.structs.astuple(s)[:-2], attrs, events))
        except msgspec.ValidationError as exc:
            raise ProtocolError("span" if where != "the frame" else "shape", f"{where}: {exc}") from None
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise ProtocolError("decode", f"{where} is not well-formed MessagePack: {exc}") from None
        return PackedSpansFrame(frame.batch, frame.sender, spans)

    return decode
