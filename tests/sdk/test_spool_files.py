"""The spool's files against damage and other users: spans are readable by their user alone; a damaged record costs
that record only, counted; anything but a regular file of this user in the folder is skipped, never opened."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import struct
import subprocess
import tempfile
import threading
import zlib
from pathlib import Path

import pytest
from ack_server import AckServer
from test_sender import counts, dead_pid, ids, orphan, segments, span

from lit_sdk._spool import Spool, owner_name
from lit_sdk._spool_files import RECORD, parse, scan
from lit_sdk.protocol import codec
from lit_sdk.sender import SpanSender

pytestmark = pytest.mark.timeout(60)

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user (nobody) needs root")


def left_behind(down_server, spool: Path, n: int, first: int = 0) -> Path:
    """The one segment a sender that shut down with the trainer away leaves (spans ``first`` to ``first + n``), as
    if its process were gone."""
    sender = SpanSender(down_server.endpoint, spool_dir=spool, max_batch_spans=10)
    for i in range(first, first + n):
        sender.submit(span(i))
    sender.shutdown(timeout=0.1)
    (path,) = segments(spool)
    orphan([path], dead_pid())
    (path,) = segments(spool)
    return path


def deliver(server, spool: Path) -> SpanSender:
    """A new agent process's sender, started and flushed (its thread adopts what the spool holds)."""
    sender = SpanSender(server.endpoint, spool_dir=spool, linger_s=0.01, ack_timeout_s=0.2)
    sender.flush(timeout=10)
    return sender


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def as_nobody(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True, text=True,
                          timeout=20, check=False)


@pytest.fixture
def down_server():
    """A collector that has a port but is not running (start() brings it up)."""
    server = AckServer().start()
    server.stop()
    yield server
    server.stop()


@pytest.fixture
def umask_022():
    old = os.umask(0o022)  # the usual one, under which the old spool was readable by all
    yield
    os.umask(old)


# -- who may look ----------------------------------------------------------------------------------------------------

def test_the_spool_folder_is_0700_and_its_files_0600(tmp_path, down_server, umask_022):
    spool = tmp_path / "spool"
    sender = SpanSender(down_server.endpoint, spool_dir=spool)
    try:
        sender.submit(span(0))
        modes = {p.suffix: oct(stat.S_IMODE(p.stat().st_mode)) for p in spool.iterdir()}
    finally:
        sender.shutdown(timeout=0)
    assert oct(stat.S_IMODE(spool.stat().st_mode)) == "0o700"
    assert modes == {".seg": "0o600", ".lock": "0o600"}


def test_a_spool_folder_open_to_others_is_closed(tmp_path, down_server, umask_022, caplog):
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o777)
    spool.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="lit"):
        sender = SpanSender(down_server.endpoint, spool_dir=spool)
        try:
            sender.submit(span(0))
            assert len(segments(spool)) == 1
        finally:
            sender.shutdown(timeout=0)
    assert stat.S_IMODE(spool.stat().st_mode) == 0o700
    assert f"the spool folder {spool} was open to other users (drwxrwxrwx); it is now 0700" in caplog.text


@pytest.mark.parametrize("folder", ["another user's", "a symlink"])
def test_a_spool_folder_not_of_this_user_is_refused_with_the_fix(tmp_path, down_server, caplog, folder):
    spool = tmp_path / "spool"
    if folder == "a symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        spool.symlink_to(tmp_path / "elsewhere")
        expected = f"the spool folder {spool} is a symbolic link, which lit does not follow: set spool_dir"
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a folder to another user (nobody) needs root")
        spool.mkdir(mode=0o700)
        os.chown(spool, NOBODY, NOBODY)
        expected = f"the spool folder {spool} belongs to uid {NOBODY}, not to this user (uid 0)"
    with caplog.at_level(logging.WARNING, logger="lit"):
        sender = SpanSender(down_server.endpoint, spool_dir=spool)
        try:
            sender.submit(span(0))
            assert sender.counts == counts(submitted=1, pending=1)  # kept in memory only
        finally:
            sender.shutdown(timeout=0)
    assert expected in caplog.text and "set spool_dir (LIT_SPOOL_DIR)" in caplog.text
    assert list(spool.iterdir()) == []  # nothing written there


@as_root
def test_another_user_cannot_read_a_spooled_span(down_server, umask_022):
    base = Path(tempfile.mkdtemp())  # under /tmp: the folders above the spool are open to all, as a home may be
    try:
        base.chmod(0o755)
        spool = base / "spool"
        sender = SpanSender(down_server.endpoint, spool_dir=spool)
        try:
            sender.submit(span(0))
            (path,) = segments(spool)
            assert b"step-0" in path.read_bytes()  # the span is there, for its own user
            read = as_nobody("/bin/sh", "-c", 'cat "$1" > /dev/null', "sh", str(path))
            listed = as_nobody("/bin/ls", str(spool))
        finally:
            sender.shutdown(timeout=0)
        assert read.returncode != 0 and "Permission denied" in read.stderr, read
        assert listed.returncode != 0 and "Permission denied" in listed.stderr, listed
        spool.chmod(0o755)  # even with the folder opened by hand, the file itself stays closed
        read = as_nobody("/bin/sh", "-c", 'cat "$1" > /dev/null', "sh", str(path))
        assert read.returncode != 0 and "Permission denied" in read.stderr, read
    finally:
        shutil.rmtree(base)


# -- damage ----------------------------------------------------------------------------------------------------------

def test_one_flipped_byte_in_the_middle_costs_only_its_record_and_is_counted(tmp_path, down_server, caplog):
    spool = tmp_path / "spool"
    path = left_behind(down_server, spool, 30)
    records = scan(path).records
    offset, length = records[12]
    flip(path, offset + length // 2)  # in the payload of the 13th span of 30
    down_server.start()
    with caplog.at_level(logging.WARNING, logger="lit"):
        sender = deliver(down_server, spool)
        try:
            assert sender.counts == counts(submitted=30, sent=29, acknowledged=29, dropped=1, corrupt=1)
        finally:
            sender.shutdown(timeout=0)
    assert down_server.span_ids() == ids(range(30)) - ids(range(12, 13))
    assert f"1 spans in the spool segments left at {spool} were damaged on disk" in caplog.text
    assert "torn" not in caplog.text


def test_any_one_flipped_byte_of_a_middle_record_costs_that_record_alone(tmp_path, down_server):
    """Every byte of the header and payload: a damaged length or magic is resynchronised on the next record."""
    path = left_behind(down_server, tmp_path / "spool", 5)
    data = path.read_bytes()
    good = parse(data)
    assert good.records and good.lost == good.torn == 0
    offset, length = good.records[2]
    for at in range(offset, offset + length):
        damaged = bytearray(data)
        damaged[at] ^= 0x5A
        scanned = parse(bytes(damaged))
        assert scanned.records == good.records[:2] + good.records[3:], at
        assert (scanned.lost, scanned.torn) == (1, 0), at


def test_damage_in_the_last_record_is_a_torn_tail_not_a_loss(tmp_path, down_server):
    path = left_behind(down_server, tmp_path / "spool", 5)
    data = path.read_bytes()
    good = parse(data)
    offset, length = good.records[-1]
    for damaged in (data[:-7], data[: offset + RECORD.size // 2], data[:offset + 3] + b"\0" + data[offset + 4 :]):
        scanned = parse(damaged)
        assert scanned.records == good.records[:-1]
        assert (scanned.lost, scanned.torn) == (0, 1)


def test_records_settled_before_an_emptying_are_never_read_again(tmp_path):
    spool = Spool(tmp_path / "spool", owner_name("abcd"), 1 << 30)
    try:
        first = [spool.append(codec.packb({"i": i, "pad": "x" * 50}), i) for i in range(5)]
        spool.release(first)  # all settled: the segment is emptied in place
        last = spool.append(codec.packb({"i": 5}), 5)
        (path,) = segments(tmp_path / "spool")
        data = path.read_bytes()
        assert parse(data).records == [(last.offset, last.length)]
        # Even with the one live record's header damaged, the settled ones behind it stay settled.
        damaged = bytearray(data)
        damaged[last.offset] ^= 0xFF
        assert parse(bytes(damaged)).records == []
    finally:
        spool.retire()


def test_a_segment_without_lits_head_or_records_sends_nothing_and_is_cleared(tmp_path, down_server):
    """Records in another layout (length and CRC only: no head, no record magic) are not spans lit wrote: nothing of
    them is sent, and the file does not stay to be read again by every sender."""
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    payloads = [codec.packb(span(i)) for i in range(3)]
    other = b"".join(struct.pack(">II", len(p), zlib.crc32(p)) + p for p in payloads)
    (spool / f"host-{dead_pid()}-abcd-000001.seg").write_bytes(other + bytes(100))
    down_server.start()
    sender = deliver(down_server, spool)
    try:
        assert sender.counts.acknowledged == 0
    finally:
        sender.shutdown(timeout=0)
    assert down_server.span_ids() == set() and segments(spool) == []


# -- what lies in the folder -------------------------------------------------------------------------------------

def test_a_fifo_and_symlinks_in_the_folder_are_skipped_and_start_does_not_hang(tmp_path, down_server, umask_022,
                                                                                caplog):
    spool = tmp_path / "spool"
    left_behind(down_server, spool, 10)  # a real orphan, to be delivered beside what was planted
    outside = left_behind(down_server, tmp_path / "outside", 5, first=100)  # spans someone wants sent
    pid = dead_pid()
    fifo, link = spool / f"host-{pid}-aaaa-000001.seg", spool / f"host-{pid}-bbbb-000001.seg"
    os.mkfifo(fifo)
    link.symlink_to(outside)
    os.mkfifo(spool / f"host-{pid}-cccc.lock")  # a FIFO lock, with a segment of its owner
    shutil.copy(outside, spool / f"host-{pid}-cccc-000001.seg")
    down_server.start()
    result: list = []

    def start() -> None:
        sender = deliver(down_server, spool)
        result.append(sender.shutdown(timeout=1))

    with caplog.at_level(logging.WARNING, logger="lit"):
        thread = threading.Thread(target=start, daemon=True)
        thread.start()
        thread.join(timeout=30)
    assert not thread.is_alive(), "a new sender hung on what was planted in its spool folder"
    assert result == [counts(submitted=10, sent=10, acknowledged=10)]
    assert down_server.span_ids() == ids(range(10))
    assert f"skipped {fifo} in the spool folder: a prw-r--r--" in caplog.text
    assert f"skipped {link} in the spool folder: a lrwxrwxrwx" in caplog.text
    assert f"its lock {spool}/host-{pid}-cccc.lock is not a regular file (mode prw-r--r--)" in caplog.text
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and link.is_symlink() and outside.exists()  # left alone


def test_a_segment_of_another_user_is_not_adopted(tmp_path, down_server, caplog):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user (nobody) needs root")
    spool = tmp_path / "spool"
    path = left_behind(down_server, spool, 5)
    os.chown(path, NOBODY, NOBODY)  # planted by nobody (its spans are forged as far as this user knows)
    down_server.start()
    with caplog.at_level(logging.WARNING, logger="lit"):
        sender = deliver(down_server, spool)
        try:
            assert sender.counts == counts()
        finally:
            sender.shutdown(timeout=0)
    assert down_server.span_ids() == set() and path.exists()
    assert f"skipped {path} in the spool folder: a -rw------- of uid {NOBODY}" in caplog.text

