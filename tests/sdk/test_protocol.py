"""The wire format: round trips, and every kind of bad frame rejected with its kind and a readable reason."""

from __future__ import annotations

import msgpack
import pytest

from lit_sdk import protocol as p


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


@pytest.mark.parametrize("decode", [p.decode_frame, p.decode_frame_packed])
@pytest.mark.parametrize(
    ("data", "kind", "words"),
    [
        (b"\xc1garbage", "decode", "not a MessagePack frame"),
        (b"", "decode", "not a MessagePack frame"),
        (wire([1, 2]), "shape", "a frame is a map"),
        (wire(good_frame(v=2)), "version", "version 2 is not supported"),
        (wire({k: v for k, v in good_frame().items() if k != "v"}), "version", "None"),
        (wire(good_frame(t="pickle")), "type", "unknown frame type 'pickle'"),
        (wire(good_frame(batch=7)), "shape", "'batch' must be a string"),
        (wire(good_frame(spans="x")), "shape", "needs 'sender'"),
        (wire(good_frame(spans=[1])), "span", "span 0 is not a map"),
        (wire(good_frame(spans=[{**span().to_wire(), "trace_id": "XYZ"}])), "span", "'trace_id' must be 32"),
        (wire(good_frame(spans=[{**span().to_wire(), "parent_id": 5}])), "span", "'parent_id' must be 16"),
        (wire(good_frame(spans=[{k: v for k, v in span().to_wire().items() if k != "name"}])), "span", "'name'"),
        (wire(good_frame(spans=[{**span().to_wire(), "status": 9}])), "span", "status must be 0, 1 or 2"),
        (wire(good_frame(spans=[{**span().to_wire(), "attributes": []}])), "span", "attributes must be a map"),
        (wire(good_frame(spans=[{**span().to_wire(), "start_ns": "1"}])), "span", "must be integers"),
        (wire(good_frame(spans=[{**span().to_wire(), "events": {}}])), "span", "events must be a list"),
        (wire({"v": 1, "t": "ack", "batch": "b", "stored": "3", "duplicates": 0}), "shape", "integer 'stored'"),
        # What only decoding the attributes finds, which the packed decoder must find too:
        (bad_utf8_attribute(), "decode", "not a MessagePack frame"),
        (wire(good_frame(spans=[{**span().to_wire(), "attributes": {1: "x"}}])), "decode", "not a MessagePack frame"),
        (wire(good_frame()) + b"\x00", "decode", "not a MessagePack frame"),  # trailing bytes
    ],
)
def test_bad_frames_are_rejected_with_their_kind(decode, data, kind, words):
    with pytest.raises(p.ProtocolError) as info:
        decode(data)
    assert info.value.kind == kind
    assert words in str(info.value)


@pytest.mark.parametrize("decode", [p.decode_frame, p.decode_frame_packed])
def test_oversized_frames_are_refused_before_decoding(monkeypatch, decode):
    monkeypatch.setattr(p, "MAX_FRAME_BYTES", 10)
    with pytest.raises(p.ProtocolError) as info:
        decode(p.encode_ack("b", 1, 0) + b"x" * 10)
    assert info.value.kind == "too_large"


def test_packed_spans_keep_the_wire_bytes_and_unpack_to_the_records():
    records = [span(), span(span_id="b" * 16, parent_id="a" * 16, rollout_id=None, attributes={}, events=[])]
    frame = p.decode_frame_packed(p.encode_spans("batch-1", "worker-1", records))
    assert (frame.batch, frame.sender) == ("batch-1", "worker-1")
    assert [s.unpack() for s in frame.spans] == records
    for packed, record in zip(frame.spans, records, strict=True):
        assert packed.attributes == msgpack.packb(record.attributes, use_bin_type=True)
        assert packed.events == msgpack.packb(record.events, use_bin_type=True)
        assert packed == p.pack_span(record)


def test_packed_decoding_takes_any_key_order_and_other_frames():
    """Keys in another order than the SDK's go the slow way, to the same result."""
    reordered = [dict(reversed(list(s.to_wire().items()))) for s in [span(), span(span_id="c" * 16)]]
    data = wire(good_frame(spans=reordered, extra="ignored"))
    assert [s.unpack() for s in p.decode_frame_packed(data).spans] == p.decode_frame(data).spans
    assert p.decode_frame_packed(p.encode_ack("b", 3, 1)) == p.AckFrame("b", 3, 1)
    assert p.decode_frame_packed(p.encode_nack("b", "why")) == p.NackFrame("b", "why")
