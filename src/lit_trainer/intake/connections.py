"""How many peers the collector lets connect at once, and which connection it closes beyond that.

A ZeroMQ ROUTER has no cap on its connections, and each one is a file descriptor: a flood of idle TCP connections
(no handshake needed, so CURVE keys do not stop it) would use up the process's descriptors, and then no agent gets
in and the trainer cannot open a file. ``ConnectionLimit`` follows the socket's monitor events (a connection
accepted or lost, each naming its descriptor) and, above ``cap`` connections, shuts down the oldest one that has
not delivered a valid frame yet: an agent that has is never closed for the cap, so a flood of newcomers cannot push
it out, and a new agent is closed only if ``cap`` newer unproven connections came before its first frame. It uses
``shutdown(2)``, not ``close``: ZeroMQ sees the connection end and closes the descriptor itself, so no descriptor is
closed under it, and one that ZeroMQ closed meanwhile (and the system gave to something else) is left alone unless
it is again a connection to this listener.

ZeroMQ times idle connections out on its own, with the options the collector sets: one that has not finished its
handshake within ``handshake_s`` (``zmq.HANDSHAKE_IVL``), and one that neither completes a message nor answers a
heartbeat within ``peer_idle_s`` (``zmq.HEARTBEAT_TIMEOUT``: ZeroMQ frees what it buffered of a half-sent message).

``peer_cap`` sets ``cap``: ``max_peers``, or fewer if the descriptor limit (``RLIMIT_NOFILE``) does not leave that
many besides ``RESERVE_FDS`` for the rest of the trainer; it first raises the soft limit toward the hard one.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

import zmq

log = logging.getLogger("lit")

RESERVE_FDS = 256
"""Descriptors left to the rest of the trainer (the store, checkpoints, the vLLM servers' connections, workers'
pipes) when the descriptor limit caps the collector's peers."""
MIN_PEERS = 8
"""The cap never goes below this, however few descriptors are left."""


def peer_cap(max_peers: int, reserve: int = RESERVE_FDS) -> int:
    """``max_peers``, or as many as the descriptor limit leaves besides those open now and ``reserve`` (at least
    ``MIN_PEERS``). Raises the process's soft ``RLIMIT_NOFILE`` toward its hard limit first, as far as needed."""
    try:
        import resource
    except ImportError:  # not a Unix: no limit to read
        return max_peers
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = _open_fds()
    want = used + reserve + max_peers
    infinite = resource.RLIM_INFINITY
    if soft != infinite and soft < want:
        raised = want if hard == infinite else min(want, hard)
        if raised > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
                soft = raised
            except (ValueError, OSError) as exc:
                log.debug("lit: could not raise the open-files limit to %d: %s", raised, exc)
    room = max_peers if soft == infinite else soft - used - reserve
    cap = max(min(max_peers, room), MIN_PEERS)
    if cap < max_peers:
        log.warning("lit: the collector lets at most %d agent processes connect at once, not %d: this process may "
                    "open %d files (%d open now). Raise the hard limit (`ulimit -Hn`, or LimitNOFILE= in a systemd "
                    "unit) to let more in", cap, max_peers, soft, used)
    return cap


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


class ConnectionLimit:
    """Counts a listening socket's connections from its monitor events (``on_event``) and closes the oldest
    unproven one above ``cap`` (see the module docstring). ``vouch(fd)`` marks a connection that delivered a valid
    frame. Thread-safe: the monitor thread reports events, the collector's thread vouches."""

    def __init__(self, cap: int) -> None:
        if cap <= 0:
            raise ValueError(f"ConnectionLimit: cap must be positive, got {cap}")
        self.cap = cap
        self._lock = threading.Lock()
        self._unproven: dict[int, None] = {}  # insertion order: oldest first
        self._proven: set[int] = set()
        self._evicted = 0
        self._local: str | int | None = None

    def listen(self, endpoint: str) -> None:
        """The endpoint bound (``zmq.LAST_ENDPOINT``): a connection is shut down only if it is one to it."""
        transport, _, address = endpoint.partition("://")
        local: str | int | None = None
        if transport == "tcp":
            local = int(address.rpartition(":")[2])
        elif transport == "ipc":
            local = address
        with self._lock:
            self._local = local

    @property
    def open(self) -> int:
        with self._lock:
            return len(self._unproven) + len(self._proven)

    @property
    def evicted(self) -> int:
        """Connections shut down because the collector had ``cap`` already."""
        with self._lock:
            return self._evicted

    def vouch(self, fd: int) -> None:
        """The connection on ``fd`` delivered a valid frame: it is not closed for the cap."""
        with self._lock:
            if fd in self._unproven:
                del self._unproven[fd]
                self._proven.add(fd)

    def on_event(self, event: int, fd: int) -> None:
        """A monitor event (``security.Watch``). Never raises: it runs in the monitor's thread."""
        try:
            self._on_event(event, fd)
        except Exception:  # a bug here must not stop the monitor, which counts refused handshakes too
            log.exception("lit: the collector's connection limit failed on an event; it goes on")

    def _on_event(self, event: int, fd: int) -> None:
        with self._lock:
            if event != zmq.EVENT_ACCEPTED:
                self._unproven.pop(fd, None)
                self._proven.discard(fd)
                return
            self._proven.discard(fd)  # a descriptor reused before its end was reported
            self._unproven[fd] = None
            if len(self._unproven) + len(self._proven) <= self.cap or not self._unproven:
                return
            oldest = next(iter(self._unproven))
            del self._unproven[oldest]  # now: its own end is reported later, and must not be counted twice
            local = self._local
        if _shut_down(oldest, local):
            with self._lock:
                self._evicted += 1


def _shut_down(fd: int, local: str | int | None) -> bool:
    """``shutdown(2)`` the connection on ``fd`` if it is still one to the listener at ``local`` (a TCP port or an
    IPC path); ZeroMQ then closes it. False if ``fd`` is no longer such a connection."""
    if local is None:
        return False
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # closed, or no longer a socket
        return False
    try:
        name = sock.getsockname()
        ours = name == local if isinstance(local, str) else isinstance(name, tuple) and name[1] == local
        if ours and sock.type == socket.SOCK_STREAM:
            sock.getpeername()  # raises for the listening socket itself
            sock.shutdown(socket.SHUT_RDWR)
            return True
        return False
    except OSError:
        return False
    finally:
        sock.detach()  # the descriptor stays ZeroMQ's
