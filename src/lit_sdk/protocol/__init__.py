"""The wire between agents and the trainer, shared by both ends: versioned MessagePack frames with a type tag, never
pickle, and who may talk over it.

Two channels (see docs/protocol.md): ``spans`` (agents deliver finished spans to the collector, which
acknowledges them; ``packed`` is the trainer's fast decoder for it) and ``dispatch`` (the trainer hands rollouts
to workers). Both use ``codec``'s MessagePack settings, version, size limit and first checks. This package turns
typed records into bytes and bytes back into validated records, and says in words what is wrong with a frame.
``security`` holds both ends of each channel's handshake: the trainer's keys and guards as well as the agents'.
The rest of ``lit_sdk`` (the agent SDK) is above this package and never below it (import-linter).
"""

from lit_sdk.protocol.codec import MAX_FRAME_BYTES, MAX_MESSAGE_BYTES, PART_BYTES, VERSION, ProtocolError
from lit_sdk.protocol.dispatch import (
    ROLLOUT_STATUSES,
    TO_TRAINER,
    TO_WORKER,
    Bye,
    DispatchMessage,
    Done,
    Heartbeat,
    Hello,
    Run,
    Stop,
    ToTrainer,
    ToWorker,
    Welcome,
    Who,
    decode_dispatch,
    encode_dispatch,
)
from lit_sdk.protocol.packed import decode_frame_packed
from lit_sdk.protocol.spans import (
    ACK,
    BUSY,
    NACK,
    PACKED_FIELDS,
    PART,
    SPAN_FIELDS,
    SPANS,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_UNSET,
    STATUSES,
    AckFrame,
    AttrValue,
    BusyFrame,
    Frame,
    NackFrame,
    PackedFrame,
    PackedSpan,
    PackedSpansFrame,
    PartFrame,
    SpanRecord,
    SpansFrame,
    decode_frame,
    encode_ack,
    encode_busy,
    encode_nack,
    encode_parts,
    encode_span_dicts,
    encode_spans,
    pack_span,
)

__all__ = [
    "ACK", "BUSY", "MAX_FRAME_BYTES", "MAX_MESSAGE_BYTES", "NACK", "PART", "PART_BYTES", "SPANS", "STATUS_ERROR",
    "STATUS_OK", "STATUS_UNSET", "VERSION", "PACKED_FIELDS", "SPAN_FIELDS", "STATUSES",
    "AckFrame", "AttrValue", "BusyFrame", "Frame", "NackFrame", "PackedFrame", "PackedSpan", "PackedSpansFrame",
    "PartFrame", "ProtocolError", "SpanRecord", "SpansFrame", "decode_frame", "decode_frame_packed", "encode_ack",
    "encode_busy", "encode_nack", "encode_parts", "encode_span_dicts", "encode_spans", "pack_span",
    # dispatch
    "ROLLOUT_STATUSES", "TO_TRAINER", "TO_WORKER", "Bye", "DispatchMessage", "Done", "Heartbeat", "Hello", "Run",
    "Stop", "ToTrainer", "ToWorker", "Welcome", "Who", "decode_dispatch", "encode_dispatch",
]
