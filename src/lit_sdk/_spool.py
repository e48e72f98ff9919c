"""The sender's disk spool: every span is appended here before it is sent, and stays until it is settled.

What survives what. A span is appended in ``submit()``, before it returns, by copying its record into the
segment being written, which is mapped into memory (``mmap``, shared with the file): once a span has ended it is in
the kernel's page cache, so it survives the process's death, ``kill -9`` included, and is delivered by the next lit
process that opens the directory. It does not survive a power loss or a kernel crash unless the kernel wrote it
back first: nothing is fsynced on the way, only what ``shutdown()`` leaves behind (``retire``). A spool that cannot
be written (a full disk, ``max_spool_bytes``, a process forked from the owner) leaves the span in memory only, where
it is delivered as long as the process lives. A segment's room is reserved on disk (``posix_fallocate``) before it
is mapped, so a full disk refuses a segment instead of killing the process on a write to the mapping.

Files. A sender owns ``{owner}.lock`` and the segments ``{owner}-{seq}.seg``, where ``owner`` is
``{host}-{pid}-{token}`` (the token tells apart senders of one process, and a restarted container's process that
got the same pid). A segment is a run of records, one span each, MessagePack-encoded as it goes in a ``spans``
frame (the layout, and how a damaged segment is read: ``_spool_files``). A record is released once its span is
acknowledged, refused or dropped; a segment whose records are all released is emptied (the one being written) or
deleted (the others).

Who may look: the folder is ``0700``, its files ``0600``, and only this user's regular files in it are opened
(``_spool_files``). A folder that is refused leaves the spool keeping nothing, as a full disk does, and says why.

Ownership. Every live sender holds an exclusive ``flock`` on its lock file; the kernel lets go of it when the
process dies, ``kill -9`` included, and on a file system that shares locks between hosts (local disks, NFSv4) the
lock says whether the owner lives wherever it runs; a pid says that only on its own host, and not after it is
reused. An adopter claims a dead owner's segments only while it holds that owner's lock (taken without waiting),
each with an atomic rename to a name of its own, so that of two adopters exactly one takes each file. Segments
with no lock file were left by a sender that shut down; they are claimed by the rename alone.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import logging
import mmap
import os
import re
import socket
import sys
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from lit_sdk._spool_files import (
    END,
    HEAD,
    RECORD,
    Refused,
    is_own_file,
    open_regular,
    own_directory,
    read_payloads,
    record_header,
    scan,
    segment_head,
)

log = logging.getLogger("lit")

SEGMENT_BYTES = 4 << 20
"""The room reserved for a segment (more for a span that needs it): once full, a new one is started."""

_SEGMENT = re.compile(r"^(.+-\d+-[0-9a-f]+)-(\d+)\.seg$")
"""``{owner}-{seq}.seg`` (``owner_name``)."""


class LostRecord(Exception):
    """Records that were written cannot be read back; their spans are lost."""

    def __init__(self, n_spans: int, message: str):
        super().__init__(message)
        self.n_spans = n_spans


@dataclass(eq=False, slots=True)
class Segment:
    path: Path
    fd: int = -1
    """Open while this is the segment being written; -1 once closed."""
    mm: mmap.mmap | None = None
    """The segment being written, mapped: appending is a copy into the page cache, with no system call (a
    ``write`` would let go of the GIL, and any other thread of the agent could keep it for milliseconds)."""
    capacity: int = 0
    size: int = 0
    generation: int = 0
    """Raised each time the segment being written is emptied: its records of before are settled."""
    outstanding: int = 0
    """Records neither acknowledged, refused nor dropped. The file goes (or is emptied) when this is 0."""
    unread: list[Entry] = field(default_factory=list)
    """Records whose span the sender does not hold in memory, by offset: to be read back before they are sent."""
    min_unread_seq: int | None = None
    """Cache of the smallest ``seq`` in ``unread`` (None: to be computed)."""


@dataclass(eq=False, slots=True)
class Entry:
    """One span in the sender's care: where its record lies (``segment`` None: in memory only) and its order."""

    segment: Segment | None
    offset: int
    length: int
    """Bytes of the record, header included."""
    seq: int
    """The sender's sequence number of the span; 0 for adopted ones (older than anything)."""
    sent: bool = False
    """Already counted as sent by this sender."""

    def __lt__(self, other: Entry) -> bool:  # for bisect: unread records in file order
        return self.offset < other.offset


def owner_name(token: str) -> str:
    """``{host}-{pid}-{token}``: who wrote a file, for people and for a lock file name."""
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64] or "host"
    return f"{host}-{os.getpid()}-{token}"


class Spool:
    """The segments one sender owns in one directory. Thread-safe: callers append, the sender's thread does the
    rest."""

    def __init__(self, directory: Path, owner: str, max_bytes: int):
        self.directory = directory
        self.owner = owner
        self.max_bytes = max_bytes
        self.bytes = 0
        """Bytes in the segment files this spool owns."""
        self._lock = threading.Lock()
        self._lock_fd = -1
        self._pid = os.getpid()
        self._segments: list[Segment] = []  # oldest first; the last is being written when its fd is open
        self._seq = 0
        self._failed: str | None = None  # why the last append failed, until one succeeds
        self._directory_ok = False
        self._refused: str | None = None  # why the folder is not used (not ours, a symlink)

    # -- the callers' side ---------------------------------------------------------------------------------------

    def append(self, payload: bytes, seq: int) -> Entry:
        """Write one span's record; its entry (with ``segment`` None if it could not be written)."""
        payload_crc = zlib.crc32(payload)
        length = RECORD.size + len(payload)
        with self._lock:
            if os.getpid() != self._pid:  # a forked child: the mapping is its parent's, where it must not write
                self._failed_once(OSError("this process was forked from the one that owns the spool"))
                return Entry(None, 0, length, seq)
            try:
                segment = self._writable(length)
                self._write(segment, payload, payload_crc)
            except OSError as exc:
                self._failed_once(exc)
                return Entry(None, 0, length, seq)
            entry = Entry(segment, segment.size, length, seq)
            segment.size += length
            segment.outstanding += 1
            self.bytes += length
            self._failed = None
            return entry

    def set_aside(self, entry: Entry) -> None:
        """The sender no longer holds this (written) span in memory: it is read back from the file later."""
        with self._lock:
            self._set_aside(entry)

    # -- the sender thread's side --------------------------------------------------------------------------------

    def write_late(self, entry: Entry, payload: bytes) -> bool:
        """Write the record of a span kept in memory only (its first write failed) and set it aside; whether it
        could be."""
        written = self.append(payload, entry.seq)
        if written.segment is None:
            return False
        entry.segment, entry.offset = written.segment, written.offset
        self.set_aside(entry)
        return True

    def release(self, entries: list[Entry]) -> None:
        """These spans are settled (acknowledged, refused or dropped): their records need not be kept."""
        with self._lock:
            for entry in entries:
                if entry.segment is not None:
                    self._release(entry.segment)
                    entry.segment = None

    def take(self, max_spans: int, max_bytes: int) -> list[tuple[bytes, Entry]]:
        """Read back the oldest set-aside spans, at least one (if any) and at most ``max_spans`` and (past the
        first) ``max_bytes`` of records. Raises LostRecord for records that cannot be read back (released)."""
        with self._lock:
            segment = next((s for s in self._segments if s.unread), None)
            if segment is None:
                return []
            entries: list[Entry] = []
            total = 0
            for entry in segment.unread:
                if entries and (len(entries) >= max_spans or total + entry.length > max_bytes):
                    break
                entries.append(entry)
                total += entry.length
            del segment.unread[: len(entries)]
            segment.min_unread_seq = None
        try:
            payloads = read_payloads(segment.path, [(e.offset, e.length) for e in entries])
        except OSError as exc:
            payloads, why = [None] * len(entries), str(exc)
        else:
            why = "its bytes changed on disk"
        lost = [e for e, p in zip(entries, payloads, strict=True) if p is None]
        if lost:
            self.release(lost)
            raise LostRecord(len(lost), f"{len(lost)} spans in the spool segment {segment.path} cannot be read "
                                        f"back: {why}")
        return [(p, e) for e, p in zip(entries, payloads, strict=True) if p is not None]

    def min_seq(self) -> int:
        """The smallest sequence number of a set-aside span (sys.maxsize: none)."""
        with self._lock:
            best = sys.maxsize
            for segment in self._segments:
                if segment.unread:
                    if segment.min_unread_seq is None:
                        segment.min_unread_seq = min(e.seq for e in segment.unread)
                    best = min(best, segment.min_unread_seq)
            return best

    def has_unread(self) -> bool:
        with self._lock:
            return any(s.unread for s in self._segments)

    def adopt(self) -> tuple[list[Entry], int]:
        """Claim the segments of owners that are gone: the entries of their spans, set aside, oldest first, and how
        many spans in them were lost to damage. Raises OSError for a folder that is not this user's."""
        if not os.path.lexists(self.directory):
            return [], 0
        with self._lock:
            self._own_directory()
        names = sorted(os.listdir(self.directory))
        by_owner: dict[str, list[str]] = {}
        for name in names:
            match = _SEGMENT.match(name)
            if match and match[1] != self.owner:
                by_owner.setdefault(match[1], []).append(name)
        adopted: list[Entry] = []
        n_segments = lost = 0
        for owner, files in by_owner.items():
            with self._owner_gone(owner) as gone:
                if gone:
                    entries, claimed, damaged = self._claim(files)
                    adopted.extend(entries)
                    n_segments += claimed
                    lost += damaged
        if adopted:
            log.info("lit: adopted %d spans in %d spool segments left at %s by senders that are gone",
                     len(adopted), n_segments, self.directory)
        if lost:
            log.warning("lit: %d spans in the spool segments left at %s were damaged on disk (a checksum failed) and "
                        "are lost; the spans around them are delivered (see counts.corrupt)", lost, self.directory)
        return adopted, lost

    def retire(self) -> None:
        """Close for good at shutdown: sync the segments still holding spans, delete the others, let go of the
        lock. What is left is an orphan from now on, for the next sender to adopt."""
        with self._lock:
            for segment in list(self._segments):
                self._close(segment)  # cut to its records first, so that the size is synced too
                if segment.outstanding <= 0:
                    self._delete(segment)
                    continue
                try:
                    fd = open_regular(segment.path, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                except OSError as exc:
                    log.warning("lit: could not sync the spool segment %s: %s", segment.path, exc)
            if self._lock_fd >= 0:
                with contextlib.suppress(OSError):
                    (self.directory / f"{self.owner}.lock").unlink()
                os.close(self._lock_fd)  # the lock goes with the descriptor
                self._lock_fd = -1

    # -- inside ----------------------------------------------------------------------------------------------------

    def _writable(self, record_bytes: int) -> Segment:
        """The segment to append to, opened (with the owner's lock taken first) when needed. Raises OSError."""
        if self.bytes + record_bytes > self.max_bytes:
            raise OSError(f"the spool is full (max_spool_bytes={self.max_bytes})")
        current = self._segments[-1] if self._segments and self._segments[-1].mm is not None else None
        if current is not None and current.size + record_bytes + RECORD.size <= current.capacity:
            return current
        if current is not None:
            self._close(current)
        if self._lock_fd < 0:
            self._take_own_lock()
        self._seq += 1
        path = self.directory / f"{self.owner}-{self._seq:06d}.seg"
        capacity = -(-max(SEGMENT_BYTES, HEAD.size + record_bytes + RECORD.size) // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            # Blocks reserved now: a write through the mapping to a page the disk has no room for would kill the
            # process (SIGBUS); this fails instead, and the spans stay in memory.
            os.posix_fallocate(fd, 0, capacity)
            mm = mmap.mmap(fd, capacity)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        mm[: HEAD.size] = segment_head(0)
        segment = Segment(path, fd, mm=mm, capacity=capacity, size=HEAD.size)
        self._segments.append(segment)
        self.bytes += HEAD.size
        return segment

    def _write(self, segment: Segment, payload: bytes, payload_crc: int) -> None:
        """Append one record (room for it and a zero header after it was checked): in the page cache, where it
        survives the process, when this returns."""
        assert segment.mm is not None
        start = segment.size
        body, end = start + RECORD.size, start + RECORD.size + len(payload)
        # The zero header after it first: a process killed in between leaves a torn last record, never a good one
        # followed by a settled one.
        segment.mm[end : end + RECORD.size] = END
        segment.mm[start:body] = record_header(len(payload), segment.generation, payload_crc)
        segment.mm[body:end] = payload

    def _own_directory(self) -> None:
        """``own_directory`` once (call with _lock held); a refusal stands for the life of the spool."""
        if self._directory_ok:
            return
        if self._refused is not None:
            raise OSError(self._refused)
        try:
            own_directory(self.directory)
        except Refused as exc:
            self._refused = str(exc)
            raise
        self._directory_ok = True

    def _take_own_lock(self) -> None:
        """Create and lock ``{owner}.lock`` under a temporary name, then rename it: an adopter never sees it
        unlocked while this sender lives."""
        self._own_directory()
        final = self.directory / f"{self.owner}.lock"
        temp = self.directory / f".{self.owner}.lock.new"
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(temp, final)
        except OSError:
            os.close(fd)
            raise
        self._lock_fd = fd

    @contextlib.contextmanager
    def _owner_gone(self, owner: str):
        """Whether ``owner`` is gone, holding its lock (if it still has one) until the block ends."""
        path = self.directory / f"{owner}.lock"
        try:
            fd = open_regular(path, os.O_RDWR)
        except FileNotFoundError:
            # It shut down and removed its lock: a live sender's lock file is there before its first segment.
            yield True
            return
        except Refused as exc:
            log.warning("lit: left alone the spool segments of %s: its lock %s; remove what is not lit's from %s",
                        owner, exc, self.directory)
            yield False
            return
        except OSError:
            yield False
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                yield False  # alive, wherever it runs (or another adopter is at it)
                return
            yield True
            with contextlib.suppress(OSError):
                path.unlink()  # while we hold it: whoever opens it after finds nothing left to claim
        finally:
            os.close(fd)

    def _claim(self, files: list[str]) -> tuple[list[Entry], int, int]:
        """Rename ``files`` to names of ours and read their records; their entries, how many files were claimed and
        how many spans in them were lost to damage."""
        entries: list[Entry] = []
        claimed = lost = 0
        for name in files:
            if not is_own_file(self.directory / name):
                continue
            try:
                with self._lock:
                    if self._lock_fd < 0:
                        self._take_own_lock()  # our claimed files must be ours in the eyes of the next adopter
                    self._seq += 1
                    path = self.directory / f"{self.owner}-{self._seq:06d}.seg"
                os.rename(self.directory / name, path)
            except FileNotFoundError:
                continue  # another adopter took it first
            except OSError as exc:
                log.warning("lit: could not claim the spool segment %s: %s", name, exc)
                continue
            try:
                scanned = scan(path)
            except Refused as exc:  # swapped since it was looked at: it is not a segment, and it is ours now
                log.warning("lit: removed %s from the spool folder: %s", name, exc)
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            except OSError as exc:
                log.warning("lit: could not read the spool segment %s: %s", path, exc)
                continue  # it stays, under our name; the next process tries again
            if scanned.torn:
                log.warning("lit: ignored a torn record at the end of the spool segment %s (its writer was killed "
                            "while writing it)", name)
            claimed += 1
            lost += scanned.lost
            segment = Segment(path, size=scanned.size, outstanding=len(scanned.records))
            segment.unread = [Entry(segment, offset, length, 0) for offset, length in scanned.records]
            with self._lock:
                self.bytes += segment.size
                self._segments.insert(0, segment)  # older than anything this sender wrote
                if not scanned.records:
                    self._delete(segment)
            entries.extend(segment.unread)
        return entries, claimed, lost

    def _set_aside(self, entry: Entry) -> None:
        segment = entry.segment
        assert segment is not None
        bisect.insort(segment.unread, entry)
        if segment.min_unread_seq is not None:
            segment.min_unread_seq = min(segment.min_unread_seq, entry.seq)

    def _release(self, segment: Segment) -> None:
        segment.outstanding -= 1
        if segment.outstanding > 0:
            return
        if segment.mm is None:
            self._delete(segment)
            return
        # The segment being written: empty it, so that a kill -9 now leaves nothing to send again. A new generation
        # settles every record in it at once (the zero header after the head only spares readers a look at them).
        segment.generation += 1
        segment.mm[: HEAD.size] = segment_head(segment.generation)
        segment.mm[HEAD.size : HEAD.size + RECORD.size] = END
        self.bytes -= segment.size - HEAD.size
        segment.size = HEAD.size

    def _close(self, segment: Segment) -> None:
        if segment.mm is not None:
            segment.mm.close()
            segment.mm = None
            with contextlib.suppress(OSError):
                os.ftruncate(segment.fd, segment.size)  # give back the room reserved and not used
        if segment.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(segment.fd)
            segment.fd = -1

    def _delete(self, segment: Segment) -> None:
        self._close(segment)
        try:
            segment.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("lit: could not delete the delivered spool segment %s: %s", segment.path, exc)
        self._segments.remove(segment)
        self.bytes -= segment.size

    def _failed_once(self, exc: OSError) -> None:
        why = str(exc)
        if why != self._failed:
            self._failed = why
            log.warning("lit: the spool at %s cannot keep spans (%s); they stay in memory only, where a crash of "
                        "this process loses them", self.directory, why)
