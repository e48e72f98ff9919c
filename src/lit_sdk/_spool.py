"""The sender's disk spool: where batches of spans wait while the trainer is away, so that none is lost.

A spool directory holds append-only segment files named ``{pid}-{token}-{seq}.seg``: the pid of the process and the
token of the sender that own the file (one process may run several senders; the token tells them apart, and tells
a live sender's files from those of a dead process that had the same pid, as in a restarted container). A segment
is a run of records, each a header ``>II`` (payload length, CRC-32 of the payload) and a payload, the MessagePack
array ``[batch_id, n_spans, frame]`` whose ``frame`` is the encoded ``spans`` frame, ready to be sent again. A
process killed mid-write leaves a torn last record: reading stops there and keeps every record before it. A segment
is fsynced when it is closed and deleted once every batch in it has been acknowledged (or refused, or dropped).

Segments whose owner is gone are adopted by the next sender that opens the directory: it claims each one with an
atomic rename to a name of its own, so that two adopters never both take the same file.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import sys
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from lit_sdk.protocol import codec

log = logging.getLogger("lit")

SEGMENT_BYTES = 4 << 20
"""A segment is closed (and fsynced) and a new one started once it is this large."""

_HEADER = struct.Struct(">II")
_live_tokens: set[str] = set()
"""Tokens of the spools alive in this process: their files are not orphans, though the pid is ours."""
_NAME = re.compile(r"^(\d+)-([0-9a-f]+)-(\d+)\.seg$")


class SpoolFull(OSError):
    """Writing the record would take the spool over its byte limit."""


class LostRecord(Exception):
    """A record that was written cannot be read back; its spans are lost."""

    def __init__(self, n_spans: int, message: str):
        super().__init__(message)
        self.n_spans = n_spans


@dataclass(frozen=True, slots=True)
class Entry:
    """Where one batch lies in a segment."""

    offset: int
    length: int
    """Bytes of the record, header included."""
    n_spans: int
    first_seq: int
    """The sender's sequence number of the batch's first span; 0 for adopted batches (older than anything)."""


@dataclass(eq=False, slots=True)
class Segment:
    path: Path
    unread: deque[Entry] = field(default_factory=deque)
    """Records not (or no longer) held in memory by the sender, oldest first."""
    outstanding: int = 0
    """Records neither acknowledged, refused nor dropped. The file goes when this is 0 and the segment is closed."""
    size: int = 0
    min_seq: int = sys.maxsize
    """The smallest ``first_seq`` ever written here: a bound, not exact, once records are acknowledged."""
    closed: bool = True


@dataclass(eq=False, slots=True)
class Batch:
    """One batch of spans, as the frame that carries it, wherever it is: in memory, on the wire or on disk."""

    batch_id: str
    frame: bytes
    n: int
    first_seq: int
    """The sending process's sequence number of its first span; 0 for one adopted from another process."""
    sent: bool = False
    """Already counted as sent by this sender."""
    attempts: int = 0
    resend_at: float = 0.0
    home: tuple[Segment, Entry] | None = None
    """The spool record that holds it too, if it was read back from one."""


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one we may not signal counts: it is someone's)."""
    if pid <= 0:
        return True  # not a pid we could have written; leave the file alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def scan(path: Path) -> tuple[list[Entry], int]:
    """The valid records of a segment and the number of bytes after them (a torn or corrupt tail), ignored."""
    data = path.read_bytes()
    entries: list[Entry] = []
    offset = 0
    while len(data) - offset >= _HEADER.size:
        length, crc = _HEADER.unpack_from(data, offset)
        end = offset + _HEADER.size + length
        payload = data[offset + _HEADER.size : end]
        record = _unpack(payload) if end <= len(data) and zlib.crc32(payload) == crc else None
        if record is None:
            break
        entries.append(Entry(offset, end - offset, record[1], 0))
        offset = end
    return entries, len(data) - offset


def _unpack(payload: bytes) -> tuple[str, int, bytes] | None:
    try:
        batch_id, n_spans, frame = codec.unpackb(payload)
    except Exception:
        return None
    if not isinstance(batch_id, str) or not isinstance(n_spans, int) or not isinstance(frame, bytes):
        return None
    return batch_id, n_spans, frame


class Spool:
    """The segments one sender owns in one directory, the last of which may be open for writing."""

    def __init__(self, directory: Path, token: str, max_bytes: int):
        self.directory = directory
        self.max_bytes = max_bytes
        self.bytes = 0
        """Bytes in the segment files this spool owns."""
        self._pid = os.getpid()
        self._token = token
        _live_tokens.add(token)
        self._segments: deque[Segment] = deque()
        self._writer: BinaryIO | None = None
        self._seq = 0
        self._sent: set[str] = set()  # ids of the batches kept after they were counted as sent

    def adopt(self) -> int:
        """Claim the segments of dead owners; the number of spans adopted."""
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return 0
        n_segments = n_spans = 0
        for name in names:
            match = _NAME.match(name)
            if match is None:
                continue
            pid, token = int(match[1]), match[2]
            if (pid == self._pid and token in _live_tokens) or (pid != self._pid and pid_alive(pid)):
                continue
            path = self._next_path()
            try:
                os.rename(self.directory / name, path)
            except FileNotFoundError:
                continue  # another adopter took it first
            try:
                entries, torn = scan(path)
            except OSError as exc:
                log.warning("lit: could not read the spool segment %s: %s", path, exc)
                continue  # it stays, under our name; the next process tries again
            if torn:
                log.warning("lit: ignored %d torn bytes at the end of the spool segment %s", torn, name)
            if not entries:
                path.unlink()
                continue
            segment = Segment(path, deque(entries), len(entries), path.stat().st_size, min_seq=0)
            self._segments.appendleft(segment)  # older than anything this sender will write
            self.bytes += segment.size
            n_segments += 1
            n_spans += sum(e.n_spans for e in entries)
        if n_segments:
            log.info("lit: adopted %d spans in %d spool segments left at %s by processes that exited",
                     n_spans, n_segments, self.directory)
        return n_spans

    def keep(self, batch: Batch) -> bool:
        """Put a batch the sender no longer holds in memory on disk: True if written now, False if its record was
        still in its file. Raises OSError (SpoolFull included) when it cannot be kept."""
        if batch.sent:
            self._sent.add(batch.batch_id)
        if batch.home is not None:
            batch.home[0].unread.appendleft(batch.home[1])
            return False
        try:
            self._write(batch)
        except OSError:
            self._sent.discard(batch.batch_id)
            raise
        return True

    def take(self, max_spans: int) -> Batch | None:
        """Read the oldest unread batch back into memory, if it has at most ``max_spans`` spans.
        Raises LostRecord when its record cannot be read back."""
        segment = next((s for s in self._segments if s.unread), None)
        if segment is None or segment.unread[0].n_spans > max_spans:
            return None
        if not segment.closed:
            self.close()  # records are read back only from a closed (synced) file
        entry = segment.unread.popleft()
        try:
            with open(segment.path, "rb") as f:
                f.seek(entry.offset)
                data = f.read(entry.length)
        except OSError as exc:
            record, why = None, str(exc)
        else:
            payload = data[_HEADER.size :]
            intact = len(data) == entry.length and _HEADER.unpack_from(data) == (len(payload), zlib.crc32(payload))
            record, why = (_unpack(payload) if intact else None), "its bytes changed on disk"
        if record is None:
            self._release(segment)
            raise LostRecord(entry.n_spans, f"a batch in the spool segment {segment.path} cannot be read: {why}")
        batch_id, n_spans, frame = record
        return Batch(batch_id, frame, n_spans, entry.first_seq, sent=batch_id in self._sent, home=(segment, entry))

    def release(self, batch: Batch) -> None:
        """The batch is settled (acknowledged, refused or dropped): its record need not be kept."""
        self._sent.discard(batch.batch_id)
        if batch.home is not None:
            self._release(batch.home[0])

    def close(self) -> None:
        """Sync and close the segment being written, if any."""
        if self._writer is None:
            return
        segment, writer, self._writer = self._segments[-1], self._writer, None
        segment.closed = True
        try:
            writer.flush()
            os.fsync(writer.fileno())
        except OSError as exc:
            log.warning("lit: could not sync the spool segment %s: %s", segment.path, exc)
        finally:
            writer.close()
        if segment.outstanding <= 0:
            self._delete(segment)

    def retire(self) -> None:
        """Close for good: the files left are orphans from now on, to be adopted by the next sender."""
        self.close()
        _live_tokens.discard(self._token)

    def min_seq(self) -> int:
        return min((s.min_seq for s in self._segments if s.outstanding > 0), default=sys.maxsize)

    def has_unread(self) -> bool:
        return any(s.unread for s in self._segments)

    def _write(self, batch: Batch) -> None:
        payload = codec.packb([batch.batch_id, batch.n, batch.frame])
        record = _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
        if self.bytes + len(record) > self.max_bytes:
            raise SpoolFull(f"the spool is full (max_spool_bytes={self.max_bytes})")
        segment = self._segments[-1] if self._writer is not None else None
        if segment is None or segment.size >= SEGMENT_BYTES:
            segment = self._open_segment()
        assert self._writer is not None
        try:
            self._writer.write(record)
        except OSError:
            self._abandon_writer(segment)
            raise
        segment.unread.append(Entry(segment.size, len(record), batch.n, batch.first_seq))
        segment.outstanding += 1
        segment.size += len(record)
        segment.min_seq = min(segment.min_seq, batch.first_seq)
        self.bytes += len(record)

    def _release(self, segment: Segment) -> None:
        segment.outstanding -= 1
        if segment.outstanding <= 0 and segment.closed:
            self._delete(segment)

    def _next_path(self) -> Path:
        self._seq += 1
        return self.directory / f"{self._pid}-{self._token}-{self._seq:06d}.seg"

    def _open_segment(self) -> Segment:
        self.close()
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._next_path()
        # Unbuffered, so that a killed process leaves every record written (bar a torn last one) in the file.
        self._writer = open(path, "ab", buffering=0)
        segment = Segment(path, closed=False)
        self._segments.append(segment)
        return segment

    def _abandon_writer(self, segment: Segment) -> None:
        """After a failed write: cut the torn record off (so that an adopter reads past nothing) and close."""
        try:
            assert self._writer is not None
            self._writer.truncate(segment.size)
        except OSError:
            pass  # the reader stops at the torn record; it costs the records after it, and there are none
        self.close()

    def _delete(self, segment: Segment) -> None:
        try:
            segment.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("lit: could not delete the delivered spool segment %s: %s", segment.path, exc)
        self._segments.remove(segment)
        self.bytes -= segment.size
