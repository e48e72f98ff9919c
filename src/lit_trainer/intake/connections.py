"""How many peers a listening socket (the collector's, the dispatcher's) lets connect at once, and which connection
it closes beyond that.

A ZeroMQ ROUTER has no cap on its connections, and each one is a file descriptor: a flood of idle TCP connections
(no handshake needed, so CURVE keys do not stop it) would use up the process's descriptors, and then no peer gets
in and the trainer cannot open a file. ``ConnectionLimit`` follows the socket's monitor events (a connection
accepted or lost, each naming its descriptor) and, above ``cap`` connections, shuts down the oldest one that has
not delivered a valid message yet: a peer that has is never closed for the cap, so a flood of newcomers cannot push
it out, and a new peer is closed only if ``cap`` newer unproven connections came before its first message. It uses
``shutdown(2)``, not ``close``: ZeroMQ sees the connection end and closes the descriptor itself, so no descriptor is
closed under it, and one that ZeroMQ closed meanwhile (and the system gave to something else) is left alone unless
it is again a connection to this listener.

ZeroMQ times idle connections out on its own, with the options the owner sets: one that has not finished its
handshake within ``handshake_s`` (``zmq.HANDSHAKE_IVL``), and, where the owner reads all the time (the collector),
one that neither completes a message nor answers a heartbeat within ``peer_idle_s`` (``zmq.HEARTBEAT_TIMEOUT``).

``ConnectionLimit.claim`` sets ``cap`` (``peer_cap``): ``max_peers``, or fewer if the descriptor limit
(``RLIMIT_NOFILE``) does not leave that many besides ``RESERVE_FDS`` for the rest of the trainer and the room the
process's other listeners may still fill (their cap less their open connections, until ``release``): the collector
and the dispatcher share one process's descriptors, so a flood on one port never takes the other's. It first
raises the soft limit toward the hard one.
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
pipes) when the descriptor limit caps the peers of its listeners: one reserve for the process, however many
listeners claim connections."""
MIN_PEERS = 8
"""The cap never goes below this, however few descriptors are left."""


def peer_cap(max_peers: int, reserve: int = RESERVE_FDS, what: str = "a listener") -> int:
    """``max_peers``, or as many as the descriptor limit leaves besides those open now and ``reserve`` (at least
    ``MIN_PEERS``). Raises the process's soft ``RLIMIT_NOFILE`` toward its hard limit first, as far as needed.
    ``what`` names the listener in the warning."""
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
        log.warning("lit: %s lets at most %d peers connect at once, not %d: this process may open %d files (%d "
                    "open now, %d kept for the rest of the trainer and its other listeners). Raise the hard limit "
                    "(`ulimit -Hn`, or LimitNOFILE= in a systemd unit) to let more in", what, cap, max_peers, soft,
                    used, reserve)
    return cap


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


_claimed: set[ConnectionLimit] = set()
"""The limits of this process's open listeners (``ConnectionLimit.claim`` until ``release``)."""
_claim_lock = threading.Lock()


class ConnectionLimit:
    """Counts a listening socket's connections from its monitor events (``on_event``) and closes the oldest
    unproven one above ``cap`` (see the module docstring). ``vouch(fd)`` marks a connection that delivered a valid
    message. Thread-safe: the monitor thread reports events, the socket's owner vouches. ``what`` names the listener
    in logs."""

    def __init__(self, cap: int, what: str = "a listener") -> None:
        if cap <= 0:
            raise ValueError(f"ConnectionLimit: cap must be positive, got {cap}")
        self.cap = cap
        self.what = what
        self._lock = threading.Lock()
        self._unproven: dict[int, None] = {}  # insertion order: oldest first
        self._proven: set[int] = set()
        self._evicted = 0
        self._local: str | int | None = None

    @classmethod
    def claim(cls, max_peers: int, what: str) -> ConnectionLimit:
        """A limit of ``peer_cap(max_peers)`` connections, counting the room of the other listeners of this process
        as taken, and itself counted so by later claims until ``release``."""
        with _claim_lock:
            taken = sum(limit.room for limit in _claimed)
            limit = cls(peer_cap(max_peers, RESERVE_FDS + taken, what), what)
            _claimed.add(limit)
        return limit

    def release(self) -> None:
        """The listener is closed: its room goes back to the process. Idempotent."""
        with _claim_lock:
            _claimed.discard(self)

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
    def room(self) -> int:
        """Connections it may still take: ``cap`` less those open (each open one holds a descriptor already)."""
        with self._lock:
            return max(self.cap - len(self._unproven) - len(self._proven), 0)

    @property
    def evicted(self) -> int:
        """Connections shut down because ``cap`` were open already."""
        with self._lock:
            return self._evicted

    def vouch(self, fd: int) -> None:
        """The connection on ``fd`` delivered a valid message: it is not closed for the cap."""
        with self._lock:
            if fd in self._unproven:
                del self._unproven[fd]
                self._proven.add(fd)

    def doubt(self, fd: int) -> None:
        """The peer on ``fd`` went silent and its owner gave up on it: it is the first closed for the cap (its
        descriptor may be another connection's by now, which is then closed first only if the cap is reached before
        it delivers its next message)."""
        with self._lock:
            if fd in self._proven:
                self._proven.discard(fd)
                self._unproven = {fd: None, **self._unproven}

    def on_event(self, event: int, fd: int) -> None:
        """A monitor event (``security.Watch``). Never raises: it runs in the monitor's thread."""
        try:
            self._on_event(event, fd)
        except Exception:  # a bug here must not stop the monitor, which counts refused handshakes too
            log.exception("lit: the connection limit of %s failed on an event; it goes on", self.what)

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
