"""The spool's files (see ``_spool``): how a segment's records are laid out and read back, damage included, and who
may open what in the spool folder.

Layout (format 2). A segment opens with a head ``HEAD``: ``SEGMENT_MAGIC`` (what the file is, and its format), the
generation and the CRC-32 of both. Records follow, each a header ``RECORD`` (``RECORD_MAGIC``, payload length,
generation, the payload's CRC-32, the CRC-32 of the header before it) and the payload; a header of zeros ends the
records (the unused room of a mapped segment). The segment being written is emptied by raising the generation in
its head: records of another generation are spans already settled, never to be sent again.

Damage. A record whose header checks out but whose payload does not is skipped by its length; one whose header does
not is skipped to the next ``RECORD_MAGIC`` whose header checks out. Either is counted lost (``Scanned.lost``) and
every record after it is kept. Damage after the last good record is a torn tail: its writer was killed while writing
it, so no one was told the span was kept; it is logged, not counted.

Who may look. Spans carry prompts and completions: the folder is ``0700`` and its files ``0600``. A folder of this
user that is open to others is closed (``chmod 0700``, logged); one of another user, or a symlink, is refused.
Only regular files of this user are opened there, without following symlinks and without blocking: anything else
under a spool name is skipped and logged.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import struct
import zlib
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger("lit")

SEGMENT_MAGIC = b"lit-seg2"
HEAD = struct.Struct(">8sII")
"""``SEGMENT_MAGIC``, generation, CRC-32 of the two."""
RECORD_MAGIC = b"\xc1lit"
"""0xc1 is the one byte MessagePack never uses, so a payload seldom holds it; a payload that does costs a header
check while resynchronising, never a wrong record (the header's own CRC must pass too)."""
RECORD = struct.Struct(">4sIIII")
"""``RECORD_MAGIC``, payload length, generation, payload CRC-32, CRC-32 of the 16 bytes before it."""
END = bytes(RECORD.size)
_OPEN_TO_OTHERS = 0o077


class Scanned(NamedTuple):
    """What a segment holds."""

    records: list[tuple[int, int]]
    """The good records as (offset, length), header included."""
    lost: int
    """Damaged records with good ones after them: spans lost to damage."""
    torn: int
    """Damaged records after the last good one: a writer killed mid-write."""
    size: int


class Refused(OSError):
    """A file or folder of the spool that lit will not use: not a regular file (or a folder) of this user."""


def segment_head(generation: int) -> bytes:
    fields = HEAD.pack(SEGMENT_MAGIC, generation, 0)[:-4]
    return fields + zlib.crc32(fields).to_bytes(4, "big")


def record_header(length: int, generation: int, payload_crc: int) -> bytes:
    fields = RECORD.pack(RECORD_MAGIC, length, generation, payload_crc, 0)[:-4]
    return fields + zlib.crc32(fields).to_bytes(4, "big")


def read_payloads(path: Path, records: list[tuple[int, int]]) -> list[bytes | None]:
    """The payloads of the records at ``records`` (offset, length) in a segment; None for one that does not check
    out."""
    out: list[bytes | None] = []
    fd = open_regular(path, os.O_RDONLY)
    try:
        for offset, length in records:
            record = os.pread(fd, length, offset)
            out.append(payload_of(record) if len(record) == length else None)
    finally:
        os.close(fd)
    return out


def payload_of(record: bytes) -> bytes | None:
    """The payload of one record read back whole (header included), or None if it does not check out."""
    fields = _header(record, 0)
    payload = record[RECORD.size :]
    if fields is None or fields[0] != len(payload) or fields[2] != zlib.crc32(payload):
        return None
    return payload


def open_regular(path: Path, flags: int) -> int:
    """Open ``path`` only if it is a regular file of this user, else raise Refused. A FIFO would block the open
    or the read (every new agent process would hang at start), a symlink would have lit read or write what it
    points to, and another user's file could hold spans forged by them."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused(f"{path} is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)})")
        if st.st_uid != os.geteuid():
            raise Refused(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
    except OSError:
        os.close(fd)
        raise
    return fd


def own_directory(directory: Path) -> None:
    """Create ``directory`` ``0700``, or make sure the one there is this user's and close it to others. Raises
    Refused, naming the fix, for a symlink or another user's folder (and OSError for what cannot be created)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno != errno.ELOOP and not directory.is_symlink():  # Linux says ENOTDIR for a symlink here
            raise
        raise Refused(f"the spool folder {directory} is a symbolic link, which lit does not follow: set "
                         "spool_dir (LIT_SPOOL_DIR) to the folder itself") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise Refused(f"the spool folder {directory} belongs to uid {st.st_uid}, not to this user (uid "
                             f"{os.geteuid()}), who could read the spans or plant others: set spool_dir "
                             "(LIT_SPOOL_DIR) to a folder of your own")
        if st.st_mode & _OPEN_TO_OTHERS:
            os.fchmod(fd, 0o700)
            log.warning("lit: the spool folder %s was open to other users (%s); it is now 0700 (drwx------)",
                        directory, stat.filemode(st.st_mode))
    finally:
        os.close(fd)


def is_own_file(path: Path) -> bool:
    """Whether ``path`` is a regular file of this user, looked at without opening it; if not, it is logged and
    should be left alone."""
    try:
        st = os.lstat(path)
    except OSError:
        return True  # gone, or cannot be looked at: opening it says which
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
        return True
    log.warning("lit: skipped %s in the spool folder: a %s of uid %d, not a segment lit wrote; remove it", path,
                stat.filemode(st.st_mode), st.st_uid)
    return False


def scan(path: Path) -> Scanned:
    """Read a segment (only if it is a regular file of this user: see ``open_regular``)."""
    fd = open_regular(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as file:
        return parse(file.read())


def parse(data: bytes) -> Scanned:
    """The records of a segment's bytes, and what was damaged."""
    # A damaged head (None): the records may still be good; the first one's generation stands in for the head's.
    return _parse_records(data, _head_generation(data))


def _head_generation(data: bytes) -> int | None:
    if len(data) < HEAD.size:
        return None
    magic, generation, crc = HEAD.unpack_from(data)
    ok = magic == SEGMENT_MAGIC and zlib.crc32(data[: HEAD.size - 4]) == crc
    return generation if ok else None


def _header(data: bytes, pos: int) -> tuple[int, int, int] | None:
    """(payload length, generation, payload CRC) of the record header at ``pos`` if it checks out."""
    if len(data) - pos < RECORD.size or data[pos : pos + len(RECORD_MAGIC)] != RECORD_MAGIC:
        return None
    _, length, generation, payload_crc, crc = RECORD.unpack_from(data, pos)
    if zlib.crc32(data[pos : pos + RECORD.size - 4]) != crc:
        return None
    return length, generation, payload_crc


def _next_header(data: bytes, pos: int, generation: int | None) -> int | None:
    """The offset of the next record header of ``generation`` that checks out, from ``pos``; None if there is none
    before the end or before a header of another generation (a settled record: the live ones are behind)."""
    while (pos := data.find(RECORD_MAGIC, pos)) >= 0:
        fields = _header(data, pos)
        if fields is not None:
            return pos if generation is None or fields[1] == generation else None
        pos += 1
    return None


def _parse_records(data: bytes, generation: int | None) -> Scanned:
    records: list[tuple[int, int]] = []
    lost = damaged = 0  # damaged: bad records since the last good one
    pos = HEAD.size
    while len(data) - pos >= RECORD.size and data[pos : pos + RECORD.size] != END:
        fields = _header(data, pos)
        if fields is None:  # its length cannot be trusted: on to the next header that checks out
            damaged += 1
            found = _next_header(data, pos + 1, generation)
            if found is None:
                break
            pos = found
            continue
        length, record_generation, payload_crc = fields
        if generation is None:
            generation = record_generation
        elif record_generation != generation:
            break  # settled before the segment was emptied
        end = pos + RECORD.size + length
        if end <= len(data) and zlib.crc32(data[pos + RECORD.size : end]) == payload_crc:
            records.append((pos, end - pos))
            lost, damaged = lost + damaged, 0
        else:
            damaged += 1
        pos = end
    if 0 < len(data) - pos < RECORD.size and data[pos:].strip(b"\0"):
        damaged += 1  # a header cut short
    return Scanned(records, lost, damaged, len(data))

