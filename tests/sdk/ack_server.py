"""A stand-in for the trainer's collector in the sender's tests: a real ZeroMQ ROUTER on 127.0.0.1, in a thread.

It decodes every frame with ``protocol.decode_frame`` (putting together those that come in parts), keeps the spans
it receives deduplicated by span id, and answers each ``spans`` frame with an ``ack`` (stored, duplicates).
Switches: ``mode = "silent"`` keeps the spans but answers nothing (a collector whose acks are lost), ``mode =
"nack"`` refuses every frame, ``busy = n`` answers the next ``n`` frames in parts ``busy`` (no room now), and
``stop()`` then ``start()`` brings it back on the same port, like a trainer that restarts. The real collector
(``lit_trainer/collector.py``) is built by another issue; this one only plays its part on the wire.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq

from lit_sdk import protocol

ACK, SILENT, NACK = "ack", "silent", "nack"
NACK_REASON = "the test server refuses everything"
_BUSY = object()


class AckServer:
    def __init__(self) -> None:
        self.port: int | None = None
        self.mode = ACK
        self.frames = 0
        """Spans frames received (resends included)."""
        self.deliveries = 0
        """Spans received, duplicates included."""
        self.bad_frames = 0
        self.busy = 0
        """Frames in parts still to be answered ``busy``."""
        self._parts: dict[bytes, bytearray] = {}
        self._spans: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        assert self.port is not None, "start the server first"
        return f"tcp://127.0.0.1:{self.port}"

    def start(self) -> AckServer:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.port is None:
            self.port = sock.bind_to_random_port("tcp://127.0.0.1")
        else:
            self._bind_again(sock)
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, args=(sock,), name="ack-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(5)
            assert not self._thread.is_alive(), "the ack server did not stop"
            self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def spans(self) -> list[dict[str, Any]]:
        """The distinct spans received, in wire form, in the order they first arrived."""
        with self._lock:
            return list(self._spans.values())

    def span_ids(self) -> set[str]:
        with self._lock:
            return set(self._spans)

    @property
    def duplicates(self) -> int:
        with self._lock:
            return self.deliveries - len(self._spans)

    def wait_for(self, n_spans: int, timeout: float = 5.0) -> bool:
        """Whether at least ``n_spans`` distinct spans arrived within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.span_ids()) >= n_spans:
                return True
            time.sleep(0.01)
        return len(self.span_ids()) >= n_spans

    def _bind_again(self, sock: zmq.Socket) -> None:
        deadline = time.monotonic() + 5
        while True:  # the old socket's port is freed by ZeroMQ's I/O thread, a moment after close
            try:
                sock.bind(self.endpoint)
                return
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    sock.close()
                    raise
                time.sleep(0.02)

    def _serve(self, sock: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(20):
                    continue
                identity, *_, data = sock.recv_multipart()
                reply = self._handle(identity, data)
                if reply is not None:
                    sock.send_multipart([identity, reply])
        finally:
            sock.close(linger=0)

    def _handle(self, identity: bytes, data: bytes) -> bytes | None:
        try:
            frame = protocol.decode_frame(data)
            if isinstance(frame, protocol.PartFrame):
                whole = self._assemble(identity, frame)
                if not isinstance(whole, bytes):
                    return protocol.encode_busy(frame.batch) if whole is _BUSY else None
                frame = protocol.decode_frame(whole)
        except protocol.ProtocolError as exc:
            with self._lock:
                self.bad_frames += 1
            return protocol.encode_nack("", str(exc))
        if not isinstance(frame, protocol.SpansFrame):
            with self._lock:
                self.bad_frames += 1
            return None
        with self._lock:
            self.frames += 1
            if self.mode == NACK:
                return protocol.encode_nack(frame.batch, NACK_REASON)  # refused: not stored
            self.deliveries += len(frame.spans)
            new = [s for s in frame.spans if s.span_id not in self._spans]
            for span in new:
                self._spans[span.span_id] = span.to_wire()
            if self.mode == SILENT:
                return None
        return protocol.encode_ack(frame.batch, len(new), len(frame.spans) - len(new))

    def _assemble(self, identity: bytes, part: protocol.PartFrame) -> bytes | object | None:
        """The whole frame when ``part`` completes one, ``_BUSY`` for a first part to be answered ``busy`` (the
        parts after it are not kept), else None."""
        if part.offset == 0:
            self._parts.pop(identity, None)
            with self._lock:
                if self.busy > 0:
                    self.busy -= 1
                    return _BUSY
            self._parts[identity] = bytearray()
        kept = self._parts.get(identity)
        if kept is None or len(kept) != part.offset:
            return None
        kept += part.data
        if len(kept) < part.total:
            return None
        del self._parts[identity]
        return bytes(kept)
