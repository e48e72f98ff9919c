"""Who may talk to the trainer: CURVE keys for lit's two ZeroMQ channels (spans: agents -> collector; dispatch:
workers <-> dispatcher), and the rule that binding anywhere but loopback needs them.

    lit keys generate ~/.lit/keys        # once, on the trainer's host (``generate_keys``)

The folder then holds a server keypair, a client keypair and the vLLM API key, in ZeroMQ's certificate format:

    server.key          the trainer's public key: copy to every worker host
    server.key_secret   the trainer's secret key (0600): stays on the trainer's host
    client.key          the workers' public key: the trainer lets in only peers that hold its secret half
    client.key_secret   the workers' secret key (0600): copy to every worker host
    api_key             bearer token of the trainer's vLLM ``/v1`` routes (0600); agents get it in their ``lit.LLM``

A server socket (a ROUTER that binds) gets ``secure_server``: CURVE encryption with the server's secret key, and a
ZAP handler (pyzmq's ``ThreadAuthenticator``, one per context) that admits only the authorised client public keys.
A client socket (a DEALER that connects) gets ``secure_client``. Both return a ``HandshakeMonitor`` that counts the
handshakes that failed (a peer without keys, with a wrong client key or a wrong server key, or one that did not
finish its handshake in time) by kind and logs each kind once: a refused peer is data, never a crash. It can also
pass each connection accepted or lost to a ``watch`` function (ZeroMQ allows one monitor per socket, so the
collector's connection limit reads the same one). ``check_bind`` refuses a non-loopback endpoint without keys, and
``check_keyless`` any endpoint without keys unless the caller opens it to every local user.

Both ends live here, in the wire package that agents and trainer share: the trainer's side (``generate_keys``,
``load_server_keys``, ``guard_server``, the ZAP allow-list, ``read_api_key`` for vLLM's key) and the agents' and
workers' side (``load_client_keys``, ``guard_client``). Light like the rest of lit_sdk: pyzmq and the standard
library only.
"""

from __future__ import annotations

import functools
import ipaddress
import itertools
import logging
import operator
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("lit")

KEYS_ENV = "LIT_KEYS_DIR"
"""Environment variable naming the keys folder on agent and worker hosts."""
SERVER_PUBLIC, SERVER_SECRET = "server.key", "server.key_secret"
CLIENT_PUBLIC, CLIENT_SECRET = "client.key", "client.key_secret"
API_KEY = "api_key"
HOW_TO_MAKE = "run `lit keys generate ~/.lit/keys` on the trainer's host"

_LOOPBACK_NAMES = ("localhost", "lo")
_HANDSHAKE_EVENTS = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "unknown_key",
}
_PROTOCOL_KINDS = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "no_key",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "bad_key",
}
_SERVER_HINTS = {
    "no_key": "a peer without CURVE keys tried to connect",
    "bad_key": "a peer's keys do not match this trainer's (a wrong server.key, or a damaged key file)",
    "unknown_key": "a peer whose client key is not in the keys folder was refused",
    "protocol": "a peer broke the ZeroMQ handshake (not a lit process?)",
    "handshake": "a peer did not finish its handshake in time (an idle connection?), or broke it",
}
KEYS_REFUSED = frozenset({"no_key", "bad_key", "unknown_key"})
"""The kinds of failed handshake that say the two ends hold keys that do not go together."""
HANDSHAKES_BROKEN = 3
"""A client whose handshakes were broken off this many times (``handshake``) takes its server for one that holds
other keys: a wrong ``server.key`` reads so on the client's side (the server cannot decrypt its hello and drops it)."""
CLIENT_REFUSED = (f"the trainer refused this process's keys: {{kind}}; copy {CLIENT_SECRET} and {SERVER_PUBLIC} from "
                f"the trainer's keys folder (its [security] keys_dir) into the folder ${KEYS_ENV} names")


class SecurityError(ValueError):
    """Keys are missing, unreadable or too open, or an endpoint needs keys it was not given; the message says
    which file or setting, and how to fix it."""


@dataclass(frozen=True)
class ServerKeys:
    """What the trainer's sockets need: its own keypair and the client public keys it lets in."""

    public: bytes
    secret: bytes
    authorized: tuple[bytes, ...]
    """Z85 client public keys allowed to connect."""
    folder: Path


@dataclass(frozen=True)
class ClientKeys:
    """What an agent's or worker's socket needs: its keypair and the trainer's public key."""

    public: bytes
    secret: bytes
    server_public: bytes
    folder: Path


def generate_keys(folder: str | os.PathLike[str]) -> list[Path]:
    """Write a server keypair, a client keypair and a vLLM API key into ``folder`` (created 0700; secret files
    0600, created so from the start). Refuses to overwrite any of them. Returns the files written."""
    import secrets

    folder = Path(folder).expanduser()
    names = (SERVER_PUBLIC, SERVER_SECRET, CLIENT_PUBLIC, CLIENT_SECRET, API_KEY)
    existing = [str(folder / n) for n in names if (folder / n).exists()]
    if existing:
        raise SecurityError(f"{folder} already holds keys ({', '.join(existing)}): lit never overwrites keys; "
                            "choose another folder, or delete these files first")
    if folder.exists() and folder.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecurityError(f"{folder} can be opened by other users: give a new folder, or `chmod 700 {folder}`")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)  # whatever the umask
    written = []
    for name in ("server", "client"):
        public, secret = zmq.curve_keypair()
        written.append(_write_private(folder / f"{name}.key", _certificate(public, None), mode=0o644))
        written.append(_write_private(folder / f"{name}.key_secret", _certificate(public, secret)))
    written.append(_write_private(folder / API_KEY, secrets.token_urlsafe(32) + "\n"))
    return written


def load_server_keys(folder: str | os.PathLike[str]) -> ServerKeys:
    """The trainer's keys from a ``lit keys generate`` folder: ``server.key_secret`` and ``client.key``."""
    folder = _folder(folder)
    public, secret = _load(folder / SERVER_SECRET, secret=True)
    client_public, _ = _load(folder / CLIENT_PUBLIC, secret=False)
    return ServerKeys(public, secret, (client_public,), folder)


def load_client_keys(folder: str | os.PathLike[str]) -> ClientKeys:
    """A worker's keys from a folder holding ``client.key_secret`` and ``server.key`` (copied from the trainer)."""
    folder = _folder(folder)
    public, secret = _load(folder / CLIENT_SECRET, secret=True)
    server_public, _ = _load(folder / SERVER_PUBLIC, secret=False)
    return ClientKeys(public, secret, server_public, folder)


def load_engine_link_keys(folder: str | os.PathLike[str]) -> tuple[ServerKeys, ClientKeys]:
    """The keys of the link between a trainer and a vLLM server it uses on another host (``lit serve``): the
    trainer's own keypair (``server.key_secret``) at both ends, so that only who holds it gets in, never a worker,
    whose client key opens the dispatcher and the collector only. (``lit serve``'s side, the trainer's side)."""
    folder = _folder(folder)
    public, secret = _load(folder / SERVER_SECRET, secret=True)
    return ServerKeys(public, secret, (public,), folder), ClientKeys(public, secret, public, folder)


def read_api_key(path: str | os.PathLike[str]) -> str:
    """The bearer token in ``path`` (``api_key`` of a keys folder), after checking nobody else can read it."""
    path = Path(path).expanduser()
    _check_private(path)
    key = path.read_text().strip()
    if not key:
        raise SecurityError(f"{path} is empty: put the API key in it, or {HOW_TO_MAKE}")
    return key


def keys_dir_from_env() -> Path | None:
    """``$LIT_KEYS_DIR`` as a path, or None when it is unset or empty."""
    raw = os.environ.get(KEYS_ENV, "").strip()
    return Path(raw).expanduser() if raw else None


def endpoint_host(endpoint: str) -> str | None:
    """The host of a ``tcp://HOST:PORT`` endpoint (brackets of an IPv6 address removed); None for ``ipc://`` and
    ``inproc://``, which other machines cannot reach."""
    transport, sep, address = endpoint.partition("://")
    if not sep:
        raise SecurityError(f"{endpoint!r} is not a ZeroMQ endpoint like tcp://127.0.0.1:7373")
    if transport in ("ipc", "inproc"):
        return None
    address = address.rpartition(";")[2]  # tcp://source;destination: the destination is bound or reached
    host = address.rpartition(":")[0] if ":" in address else address
    return host.strip("[]")


def is_loopback_host(host: str) -> bool:
    """True for ``localhost``, the ``lo`` interface and loopback addresses (127.0.0.0/8, ::1). Wildcards
    (``0.0.0.0``, ``*``, ``::``), other addresses, interfaces and host names are not."""
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local_endpoint(endpoint: str) -> bool:
    """True when only this machine can reach ``endpoint``: a loopback TCP address, ``ipc://`` or ``inproc://``."""
    host = endpoint_host(endpoint)
    return host is None or is_loopback_host(host)


def check_bind(endpoint: str, keys: ServerKeys | None, what: str, setting: str) -> None:
    """Refuse to bind ``endpoint`` beyond loopback without keys. ``what``: the channel (``the collector``);
    ``setting``: the config key that sets the endpoint (``collector.endpoint``)."""
    if keys is None and not is_local_endpoint(endpoint):
        raise SecurityError(
            f"{what} would listen on {endpoint} ({setting}), which other machines can reach, without keys: anyone "
            f"could connect. {HOW_TO_MAKE} and set [security] keys_dir to that folder (lit then uses CURVE keys on "
            "both channels and the folder's api_key for vLLM), or bind to tcp://127.0.0.1"
        )


def check_keyless(keys: ServerKeys | None, open_to_local_users: bool, what: str, exposes: str) -> None:
    """Refuse a trainer's listener without keys unless its caller said every user of this machine may reach it:
    loopback is no boundary on a shared host. ``what``: the class (``Collector``); ``exposes``: what any local user
    then gets. ``lit train`` always has keys (``services.with_keys``)."""
    if keys is None and not open_to_local_users:
        raise SecurityError(
            f"{what}: without keys any user of this machine {exposes}. Pass keys=security.load_server_keys(FOLDER) "
            f"as lit train does (`lit keys generate FOLDER` makes them; peers then need {KEYS_ENV}=FOLDER), or "
            "open_to_local_users=True where every local user is trusted"
        )


def check_connect(endpoint: str, keys: ClientKeys | None, what: str) -> None:
    """Refuse to reach a trainer beyond loopback without keys (it would refuse this peer anyway)."""
    if keys is None and not is_local_endpoint(endpoint):
        raise SecurityError(
            f"{what} connects to {endpoint}, another machine, without keys: copy {CLIENT_SECRET} and "
            f"{SERVER_PUBLIC} from the trainer's keys folder ({HOW_TO_MAKE} if there is none) into a folder here "
            f"(chmod 700) and set {KEYS_ENV} to it"
        )


def secure_server(sock: zmq.Socket, keys: ServerKeys, watch: Watch | None = None) -> HandshakeMonitor:
    """Make ``sock`` (before it binds) a CURVE server that admits only ``keys.authorized`` client keys; count
    the handshakes it refuses (and pass connection events to ``watch``: ``HandshakeMonitor``). Close the returned
    monitor's socket by closing ``sock``."""
    domain = _ALLOWED.add(sock.context, keys.authorized)
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    sock.zap_domain = domain.encode()
    try:  # no ZAP handler must mean "refused", never "everyone in" (a DRAFT option in some libzmq builds)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    except (AttributeError, zmq.ZMQError):
        pass
    return HandshakeMonitor(sock, "refused peers", _SERVER_HINTS, watch)


def secure_client(sock: zmq.Socket, keys: ClientKeys, refused: str = CLIENT_REFUSED) -> HandshakeMonitor:
    """Give ``sock`` (before it connects) the client keypair and the trainer's public key; count failed
    handshakes (the trainer does not know this key, or ``server.key`` is not the trainer's), logged as ``refused``
    says (``{kind}``: the kind of failure)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public
    return HandshakeMonitor(sock, "cannot connect", refused)


def guard_server(sock: zmq.Socket, endpoint: str, keys: ServerKeys | None, what: str, setting: str,
                 watch: Watch | None = None) -> HandshakeMonitor | None:
    """Before ``sock.bind(endpoint)``: refuse a non-loopback endpoint without keys (``check_bind``), and with keys
    make ``sock`` a CURVE server (``secure_server``). The monitor counting refused peers (and passing connection
    events to ``watch``), or None without keys and without ``watch``."""
    check_bind(endpoint, keys, what, setting)
    if keys is not None:
        return secure_server(sock, keys, watch)
    return HandshakeMonitor(sock, "refused peers", _SERVER_HINTS, watch) if watch is not None else None


def guard_client(sock: zmq.Socket, endpoint: str, keys: ClientKeys | None, what: str,
                 refused: str = CLIENT_REFUSED) -> HandshakeMonitor | None:
    """Before ``sock.connect(endpoint)``: refuse a trainer on another machine without keys (``check_connect``),
    and with keys make ``sock`` a CURVE client (``secure_client``). The monitor, or None without keys."""
    check_connect(endpoint, keys, what)
    return secure_client(sock, keys, refused) if keys is not None else None


def client_keys(folder: str | os.PathLike[str] | None = None) -> ClientKeys | None:
    """The client keys in ``folder``, else in ``$LIT_KEYS_DIR``; None when neither is set."""
    folder = folder or keys_dir_from_env()
    return load_client_keys(folder) if folder else None


Watch = Callable[[int, int], None]
"""Called with a ZeroMQ monitor event (``zmq.EVENT_ACCEPTED``, ``EVENT_DISCONNECTED``, ``EVENT_CLOSED``) and its
value: the connection's file descriptor."""
WATCHED_EVENTS = (zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED)


class HandshakeMonitor:
    """Counts a socket's failed handshakes by kind (``no_key``, ``bad_key``, ``unknown_key``, ``protocol``,
    ``handshake``) from its ZeroMQ monitor events, and logs each kind once, with its line of ``hints`` (one for
    every kind, ``{kind}`` standing for the kind); with ``watch``, also calls it for each
    of ``WATCHED_EVENTS`` (in the monitor's thread, in the order ZeroMQ reports them). One daemon thread, which
    ends when the socket is closed."""

    _ids = itertools.count()

    def __init__(self, sock: zmq.Socket, label: str, hints: dict[str, str] | str, watch: Watch | None = None
                 ) -> None:
        self.label = label
        self._hints = hints
        self._watch = watch
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._stopped = threading.Event()
        address = f"inproc://lit-handshakes-{os.getpid()}-{next(self._ids)}"
        events = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | \
            zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_MONITOR_STOPPED
        if watch is not None:
            events |= functools.reduce(operator.or_, WATCHED_EVENTS)
        sock.monitor(address, events)
        # A plain (not asyncio) socket in the same context, whatever the monitored socket's class.
        self._pair = zmq.Socket(sock.context, zmq.PAIR)
        self._pair.linger = 0
        self._pair.connect(address)
        self._thread = threading.Thread(target=self._run, name="lit-handshakes", daemon=True)
        self._thread.start()

    @property
    def counts(self) -> dict[str, int]:
        """Refused handshakes so far, by kind."""
        with self._lock:
            return dict(self._counts)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def keys_refused(self, since: Mapping[str, int] | None = None) -> str | None:
        """The kind of failure that says the other end holds other keys (``KEYS_REFUSED``, or ``handshake``
        ``HANDSHAKES_BROKEN`` times), once counted (after ``since``: earlier ``counts``); None before."""
        counts = {kind: n - (since or {}).get(kind, 0) for kind, n in self.counts.items()}
        refused = {kind for kind, n in counts.items() if n > 0} & KEYS_REFUSED
        if refused:
            return min(refused)
        return "handshake" if counts.get("handshake", 0) >= HANDSHAKES_BROKEN else None

    def wait_stopped(self, timeout: float) -> bool:
        """Wait until the monitored socket is closed and the thread has ended."""
        return self._stopped.wait(timeout)

    def _run(self) -> None:
        try:
            while True:
                frames = self._pair.recv_multipart()
                if len(frames) != 2 or len(frames[0]) != 6:
                    continue
                event, value = struct.unpack("=HI", frames[0])
                if event == zmq.EVENT_MONITOR_STOPPED:
                    return
                if event in _HANDSHAKE_EVENTS:
                    self._count(_PROTOCOL_KINDS.get(value, _HANDSHAKE_EVENTS[event]))
                elif self._watch is not None and event in WATCHED_EVENTS:
                    self._watch(event, value)
        except zmq.ZMQError:  # the context is terminating
            pass
        finally:
            self._pair.close()
            self._stopped.set()

    def _count(self, kind: str) -> None:
        with self._lock:
            first = kind not in self._counts
            self._counts[kind] = self._counts.get(kind, 0) + 1
        if first:
            hint = self._hints[kind] if isinstance(self._hints, dict) else self._hints.format(kind=kind)
            log.warning("lit: %s: %s (counted, logged once per kind)", self.label, hint)


class _AllowList:
    """The ZAP callback of one context's authenticator: each secured socket has its own domain and keys."""

    _ids = itertools.count()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_context: dict[int, tuple[ThreadAuthenticator, dict[str, frozenset[bytes]]]] = {}

    def add(self, context: zmq.Context, keys: tuple[bytes, ...]) -> str:
        """Register ``keys`` under a new ZAP domain on ``context`` (starting its authenticator once)."""
        domain = f"lit-{os.getpid()}-{next(self._ids)}"
        with self._lock:
            entry = self._by_context.get(id(context))
            if entry is None or not entry[0].is_alive():
                auth = ThreadAuthenticator(context, log=logging.getLogger("lit.zap"))
                auth.start()  # binds the ZAP endpoint before this returns
                entry = self._by_context[id(context)] = (auth, {})
            auth, domains = entry
            domains[domain] = frozenset(keys)
            auth.configure_curve_callback(domain, _Provider(domains))
        return domain

    def stop(self, context: zmq.Context) -> None:
        """Stop ``context``'s authenticator (before ``context.term()``; its sockets would block it)."""
        with self._lock:
            entry = self._by_context.pop(id(context), None)
        if entry is not None:
            entry[0].stop()


class _Provider:
    def __init__(self, domains: dict[str, frozenset[bytes]]) -> None:
        self.domains = domains

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.domains.get(domain, frozenset())


_ALLOWED = _AllowList()


def stop_authenticator(context: zmq.Context) -> None:
    """Stop the ZAP thread ``secure_server`` started on ``context``; needed only before ``context.term()``."""
    _ALLOWED.stop(context)


def _folder(folder: str | os.PathLike[str]) -> Path:
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise SecurityError(f"no keys folder at {path}: {HOW_TO_MAKE}, and copy {CLIENT_SECRET} and "
                            f"{SERVER_PUBLIC} from it to worker hosts")
    return path


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        where = "the trainer's keys folder" if path.name in (SERVER_SECRET, CLIENT_PUBLIC) else \
            "the trainer's keys folder (copy it here)"
        raise SecurityError(f"missing {path}: it comes from {where}; {HOW_TO_MAKE} if there is none")
    if secret:
        _check_private(path)
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise SecurityError(f"{path} is not a ZeroMQ key file ({exc}): {HOW_TO_MAKE}") from None
    if secret and not secret_key:
        raise SecurityError(f"{path} holds no secret key: use the {path.name} that `lit keys generate` wrote")
    return public, secret_key


def _check_private(path: Path) -> None:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise SecurityError(f"missing {path}: {HOW_TO_MAKE}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecurityError(f"{path} can be read by other users (mode {stat.filemode(mode)}): run "
                            f"`chmod 600 {path}`, and keep secret keys out of shared folders")


def _write_private(path: Path, text: str, mode: int = 0o600) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, mode)  # whatever the umask
    return path


def _certificate(public: bytes, secret: bytes | None) -> str:
    """ZeroMQ's certificate format (what ``zmq.auth.load_certificate`` and czmq read)."""
    kind = "**Secret** Certificate\n#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions." \
        if secret else "Public Certificate\n#   Exchange securely, or use a secure mechanism to verify the contents"
    lines = [f"#   ****  Generated on {time.strftime('%Y-%m-%d %H:%M:%S')} by lit  ****", f"#   ZeroMQ CURVE {kind}",
             "", "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"
