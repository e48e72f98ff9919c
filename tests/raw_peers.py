"""Raw TCP peers for the listeners' connection tests (collector and dispatcher): a flood of connections that never
say a word, a peer speaking as much of ZeroMQ's wire protocol (ZMTP 3.0: https://rfc.zeromq.org/spec/23/) as it
needs, and whether the listener has closed one."""

from __future__ import annotations

import select
import socket
import struct
from collections.abc import Callable

from waiting import wait_until

FLOOD_BATCH = 50
"""Connections a flood opens at once: under a listener's backlog (ZeroMQ's default 100). Past it, on a loaded
machine, the rest wait for SYN retries (1, 3, 7, 15, 31 s) and were still connecting when a test's 30 s ran out."""


def flood(endpoint: str, n: int) -> list[socket.socket]:
    """``n`` TCP connections to ``endpoint`` that never say a word (connected without waiting for each)."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    socks = []
    for _ in range(n):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex((host, int(port)))
        socks.append(sock)
    return socks


def flood_until(endpoint: str, full: Callable[[], object], accepted: Callable[[], int], most: int = 700
                ) -> list[socket.socket]:
    """Idle connections to ``endpoint``, ``FLOOD_BATCH`` at a time, each batch ``accepted()`` (the flood's
    connections the listener has taken so far) before the next, until ``full()`` or ``most`` are open."""
    socks: list[socket.socket] = []
    while len(socks) < most and not full():
        socks += flood(endpoint, min(FLOOD_BATCH, most - len(socks)))
        sent = len(socks)
        wait_until(lambda n=sent: full() or accepted() >= n, f"the listener accepting {sent} idle connections")
    return socks


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end has closed ``sock`` (reads whatever came before, without waiting)."""
    try:
        while readable(sock):
            if not sock.recv(65536):
                return True
    except OSError:  # reset
        return True
    return False


def readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read, or its end (``poll``: no limit on descriptor numbers)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def zmtp_connect(endpoint: str, timeout_s: float = 10.0) -> socket.socket:
    """A TCP connection that has done ZeroMQ's NULL handshake as a DEALER: the listener now reads its messages."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    sock.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + b"\0" * 32)
    read_exactly(sock, 64)  # the listener's greeting
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    sock.sendall(b"\x04" + bytes([len(body)]) + body)
    flags = read_exactly(sock, 1)[0]  # the listener's READY
    read_exactly(sock, struct.unpack(">Q", read_exactly(sock, 8))[0] if flags & 0x02 else read_exactly(sock, 1)[0])
    return sock


def send_message(sock: socket.socket, body: bytes) -> None:
    """One ZeroMQ message of one frame, on a connection of ``zmtp_connect``."""
    header = b"\x00" + bytes([len(body)]) if len(body) < 256 else b"\x02" + struct.pack(">Q", len(body))
    sock.sendall(header + body)


def read_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("the listener closed the connection during the handshake")
        out += chunk
    return out
