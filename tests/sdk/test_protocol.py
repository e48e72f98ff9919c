"""The wire format: round trips, and every kind of bad frame rejected with its kind and a readable reason."""

from __future__ import annotations

import json
import subprocess
import sys

import msgpack
import pytest

from lit_sdk import protocol as p
from lit_sdk.protocol import codec, packed


def span(**changes) -> p.SpanRecord:
    base = p.SpanRecord(
        trace_id="0" * 31 + "1", span_id="a" * 16, parent_id=None, name="lit.llm", start_ns=1, end_ns=2,
        status=p.STATUS_OK, rollout_id="r1", attributes={"lit.llm.prompt_token_ids": [1, 2, 3], "x": 1.5},
        events=[{"name": "exception", "time_ns": 2, "attributes": {"exception.type": "E"}}],
    )
    for key, value in changes.items():
        setattr(base, key, value)
    return base


def test_spans_round_trip_exactly():
    records = [span(), span(span_id="b" * 16, parent_id="a" * 16, rollout_id=None, attributes={})]
    frame = p.decode_frame(p.encode_spans("batch-1", "worker-1", records))
    assert frame == p.SpansFrame("batch-1", "worker-1", records)
    assert p.decode_frame(p.encode_span_dicts("b2", "w", [r.to_wire() for r in records])).spans == records


def test_ack_and_nack_round_trip():
    assert p.decode_frame(p.encode_ack("b", 3, 1)) == p.AckFrame("b", 3, 1)
    assert p.decode_frame(p.encode_nack("b", "bad span")) == p.NackFrame("b", "bad span")


def wire(frame: dict) -> bytes:
    return msgpack.packb(frame, use_bin_type=True)


def good_frame(**changes) -> dict:
    frame = {"v": 1, "t": "spans", "batch": "b", "sender": "s", "spans": [span().to_wire()]}
    frame.update(changes)
    return frame


def bad_utf8_attribute() -> bytes:
    good = wire(good_frame(spans=[{**span().to_wire(), "attributes": {"k": "\u00e9t\u00e9"}}]))
    return good.replace("\u00e9t\u00e9".encode(), b"\xff\xfe\xfd\xfc\xfb")  # same length: still well-formed MessagePack


def decode_packed_without_msgspec(data: bytes) -> p.PackedFrame:
    """``decode_frame_packed`` as an agent-side install (no msgspec) runs it."""
    fast, packed._fast_decoder = packed._fast_decoder, lambda: None
    try:
        return p.decode_frame_packed(data)
    finally:
        packed._fast_decoder = fast


def raw_map(*entries: tuple[str, bytes]) -> bytes:
    """A MessagePack map of the given keys and already-encoded values, repeated keys included (a dict has none)."""
    return bytes([0x80 | len(entries)]) + b"".join(wire(key) + value for key, value in entries)


def entries(obj: dict) -> list[tuple[str, bytes]]:
    return [(key, wire(value)) for key, value in obj.items()]


BAD_UTF8_MAP = b"\x81\xa1k\xa3\xff\xfe\xfd"  # {"k": <3 bytes that are not UTF-8>}


def repeated_attributes() -> bytes:
    """A span whose ``attributes`` come twice, the first not UTF-8: a dict decoder reads (and refuses) both; a
    decoder that keeps attributes as raw bytes would only skip over the first."""
    span_map = raw_map(("attributes", BAD_UTF8_MAP), *entries(span().to_wire()))
    return raw_map(*entries({k: v for k, v in good_frame().items() if k != "spans"}), ("spans", b"\x91" + span_map))


def repeated_spans() -> bytes:
    """A frame whose ``spans`` come twice, the first a list of one undecodable span."""
    return raw_map(("spans", b"\x91" + BAD_UTF8_MAP), *entries(good_frame()))


@pytest.mark.parametrize("decode", [p.decode_frame, p.decode_frame_packed, decode_packed_without_msgspec])
@pytest.mark.parametrize(
    ("data", "kind", "words"),
    [
        (b"\xc1garbage", "decode", "not a MessagePack frame"),
        (b"", "decode", "not a MessagePack frame"),
        (wire([1, 2]), "shape", "a frame is a map, got list"),
        (wire(good_frame(v=2)), "version", "version 2 is not supported"),
        (wire({k: v for k, v in good_frame().items() if k != "v"}), "version", "carries no protocol version 'v'"),
        (wire(good_frame(v=True)), "version", "protocol version True is not supported"),
        (wire(good_frame(t="pickle")), "type", "unknown frame type 'pickle'"),
        (wire(good_frame(batch=7)), "shape", "'batch' must be a string"),
        (wire(good_frame(spans="x")), "shape", "needs 'sender'"),
        (wire(good_frame(spans=[1])), "span", "span 0 is not a map"),
        (wire(good_frame(spans=[{**span().to_wire(), "trace_id": "XYZ"}])), "span", "'trace_id' must be 32"),
        (wire(good_frame(spans=[{**span().to_wire(), "parent_id": 5}])), "span", "'parent_id' must be 16"),
        (wire(good_frame(spans=[{k: v for k, v in span().to_wire().items() if k != "name"}])), "span", "'name'"),
        (wire(good_frame(spans=[{**span().to_wire(), "status": 9}])), "span", "'status' must be 0, 1 or 2"),
        (wire(good_frame(spans=[{**span().to_wire(), "attributes": []}])), "span", "'attributes' must be a map"),
        (wire(good_frame(spans=[{**span().to_wire(), "start_ns": "1"}])), "span", "'start_ns' must be an integer"),
        (wire(good_frame(spans=[{**span().to_wire(), "events": {}}])), "span", "'events' must be a list"),
        (wire({"v": 1, "t": "ack", "batch": "b", "stored": "3", "duplicates": 0}), "shape", "integer 'stored'"),
        # What only decoding the attributes finds, which the packed decoder must find too:
        (bad_utf8_attribute(), "decode", "not a MessagePack frame"),
        (wire(good_frame(spans=[{**span().to_wire(), "attributes": {1: "x"}}])), "decode", "not a MessagePack frame"),
        (wire(good_frame()) + b"\x00", "decode", "not a MessagePack frame"),  # trailing bytes
        (repeated_attributes(), "decode", "not a MessagePack frame"),
        (repeated_spans(), "decode", "not a MessagePack frame"),
        (wire(good_frame(spans=[{**span().to_wire(), "events": [{"k": {1: 2}}]}])), "decode", "not a MessagePack"),
        (wire(good_frame(spans=[{**span().to_wire(), "attributes": {"k": {1: 2}}}])), "decode", "not a MessagePack"),
    ],
)
def test_bad_frames_are_rejected_with_their_kind(decode, data, kind, words):
    with pytest.raises(p.ProtocolError) as info:
        decode(data)
    assert info.value.kind == kind
    assert words in str(info.value)


@pytest.mark.parametrize("decode", [p.decode_frame, p.decode_frame_packed, decode_packed_without_msgspec])
def test_oversized_frames_are_refused_before_decoding(monkeypatch, decode):
    monkeypatch.setattr(codec, "MAX_FRAME_BYTES", 10)
    with pytest.raises(p.ProtocolError) as info:
        decode(p.encode_ack("b", 1, 0) + b"x" * 10)
    assert info.value.kind == "too_large"


def test_packed_spans_keep_the_wire_bytes_and_unpack_to_the_records():
    records = [span(), span(span_id="b" * 16, parent_id="a" * 16, rollout_id=None, attributes={}, events=[])]
    frame = p.decode_frame_packed(p.encode_spans("batch-1", "worker-1", records))
    assert (frame.batch, frame.sender) == ("batch-1", "worker-1")
    assert [s.unpack() for s in frame.spans] == records
    for packed_span, record in zip(frame.spans, records, strict=True):
        assert packed_span.attributes == msgpack.packb(record.attributes, use_bin_type=True)
        assert packed_span.events == msgpack.packb(record.events, use_bin_type=True)
        assert packed_span == p.pack_span(record)


def test_packed_decoding_takes_any_key_order_and_other_frames():
    """Keys in another order than the SDK's go the slow way, to the same result."""
    reordered = [dict(reversed(list(s.to_wire().items()))) for s in [span(), span(span_id="c" * 16)]]
    data = wire(good_frame(spans=reordered, extra="ignored"))
    assert [s.unpack() for s in p.decode_frame_packed(data).spans] == p.decode_frame(data).spans
    assert p.decode_frame_packed(p.encode_ack("b", 3, 1)) == p.AckFrame("b", 3, 1)
    assert p.decode_frame_packed(p.encode_nack("b", "why")) == p.NackFrame("b", "why")


def test_sdk_frames_take_the_msgspec_path():
    """What the SDK sends never falls back to ``decode_frame`` (which would re-encode the attributes)."""
    records = [span(), span(span_id="b" * 16, parent_id="a" * 16, rollout_id=None, attributes={}, events=[])]
    data = p.encode_spans("batch-1", "worker-1", records)
    decode = packed._fast_decoder()
    assert decode is not None, "msgspec is not installed: the trainer extra requires it"
    assert decode(data) == p.decode_frame_packed(data) == decode_packed_without_msgspec(data)


def test_packed_decoding_accepts_what_decode_frame_accepts():
    """An optional field of a later SDK, and keys in another order, differ only in form: both paths take them."""
    reordered = dict(reversed(list(span(span_id="d" * 16).to_wire().items())))
    spans = [{**span().to_wire(), "extra": "an optional field of a later SDK"}, reordered]
    data = wire(good_frame(spans=spans))
    assert [s.unpack() for s in p.decode_frame_packed(data).spans] == p.decode_frame(data).spans


@pytest.mark.parametrize("decode", [p.decode_frame, p.decode_frame_packed, decode_packed_without_msgspec])
@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"attributes": {"nested": {"a": [1, {"b": None}]}}}, "'attributes' must be a map of string keys"),
        ({"attributes": {"k": [[1, 2]]}}, "'attributes' must be a map of string keys"),
        ({"attributes": {"b": b"binary"}}, "'attributes' must be a map of string keys"),
        ({"attributes": {"k" * 1025: 1}}, "'attributes' must be a map of string keys"),
        ({"start_ns": True}, "'start_ns' must be an integer of 64 bits"),
        ({"end_ns": 2**63}, "'end_ns' must be an integer of 64 bits"),  # passes msgpack, fails SQLite's INTEGER
        ({"status": 1.0}, "'status' must be 0, 1 or 2"),
        ({"status": True}, "'status' must be 0, 1 or 2"),
        ({"rollout_id": "r" * 1025}, "'rollout_id' must be nil or a string of at most 1024"),
        ({"name": "n" * 4097}, "'name' must be a string of at most 4096"),
        ({"events": [{"name": "e", "time_ns": 1}]}, "'events' must be a list of"),
        ({"events": [{"name": "e", "time_ns": 1, "attributes": {}, "more": 1}]}, "'events' must be a list of"),
        ({"events": [{}]}, "'events' must be a list of"),
    ],
)
def test_spans_beyond_the_bounds_are_refused_by_every_path(decode, changes, words):
    """What SQLite could not store, or what would decode into many more objects than bytes (nesting, maps in
    lists), is refused before it reaches the store, by the SDK's decoder and the trainer's alike."""
    data = wire(good_frame(spans=[span(span_id="c" * 16).to_wire(), {**span().to_wire(), **changes}]))
    with pytest.raises(p.ProtocolError) as info:
        decode(data)
    assert info.value.kind == "span"
    assert words in str(info.value)


@pytest.mark.parametrize("decode", [p.decode_frame, p.decode_frame_packed, decode_packed_without_msgspec])
@pytest.mark.parametrize(
    ("frame", "words"),
    [
        (good_frame(spans=[span().to_wire()] * 4097), "4096"),  # the typed decoder's words above WORDING_BYTES
        (good_frame(batch="b" * 1025), "'batch' must be a string of at most 1024"),
        (good_frame(sender="s" * 1025), "sender id of at most 1024"),
    ],
)
def test_frames_beyond_the_bounds_are_refused(decode, frame, words):
    with pytest.raises(p.ProtocolError) as info:
        decode(wire(frame))
    assert info.value.kind == "shape"
    assert words in str(info.value)


def test_large_refused_frames_are_refused_by_the_typed_decoder_alone(monkeypatch):
    """Above ``WORDING_BYTES`` a frame the typed decoder refuses is not decoded again by the generic decoder
    (which would build an object for every empty map): the error is msgspec's, with where it is."""
    monkeypatch.setattr(codec, "WORDING_BYTES", 100)
    data = wire(good_frame(spans=[span().to_wire(), {**span().to_wire(), "start_ns": "1"}]))
    with pytest.raises(p.ProtocolError) as info:
        p.decode_frame_packed(data)
    assert info.value.kind == "span"
    assert "span 1" in str(info.value) and "start_ns" in str(info.value)
    bomb = wire({"v": 1, "t": "spans", "batch": "b", "sender": "s", "spans": [{}] * 1000})
    with pytest.raises(p.ProtocolError) as info:
        p.decode_frame_packed(bomb)
    assert info.value.kind == "span"


def test_a_decode_bomb_is_refused_without_the_memory_it_asks_for():
    """15 MiB of empty maps (just under the frame limit) decode into about a gigabyte of dicts with a generic
    MessagePack decoder; the trainer's decoder refuses the frame having built almost nothing. Measured in a
    fresh process, as the growth of its peak resident memory."""
    code = """
import resource, json, msgpack
from lit_sdk import protocol
n = 15 * 2**20
bomb = b"\\x85" + b"".join(msgpack.packb(x) for x in ("v", 1, "t", "spans", "batch", "b", "sender", "s", "spans"))
bomb += b"\\xdd" + n.to_bytes(4, "big") + b"\\x80" * n
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    protocol.decode_frame_packed(bomb)
    kind = None
except protocol.ProtocolError as exc:
    kind = exc.kind
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"kind": kind, "grew_mb": (after - before) / 1024}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["kind"] == "shape"
    assert result["grew_mb"] < 100, result


def test_attributes_keep_their_wire_bytes():
    float32 = bytes.fromhex("81a166ca3f000000")  # {"f": 0.5 as float32}
    span_map = raw_map(*[(k, float32 if k == "attributes" else v) for k, v in entries(span().to_wire())])
    data = raw_map(*entries({k: v for k, v in good_frame().items() if k != "spans"}), ("spans", b"\x91" + span_map))
    (packed,) = p.decode_frame_packed(data).spans
    assert packed.attributes == float32  # not re-encoded (MessagePack would write the float as float64)
    assert packed.unpack() == span(attributes={"f": 0.5})


def test_the_sdk_does_not_import_msgspec():
    """msgspec is the trainer's: agents decode acks and nacks with msgpack alone."""
    code = ("import sys, json, lit_sdk, lit_sdk.protocol as p\n"
            "p.decode_frame(p.encode_ack('b', 1, 0))\n"
            "print(json.dumps('msgspec' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) is False
