"""Another host for the tests, made on this one: a network namespace joined to this one by a veth pair, whose
processes reach this side at the pair's address only (this host's 127.0.0.1 and other addresses are out of their
reach), so that for the network they are on another host. Where no namespace can be made (not root, no ``ip``, a
container without the capability), or when ``LIT_TEST_NO_NETNS=1``, ``other_host`` gives plain processes on this
machine and its non-loopback address instead, and logs why."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import ipaddress
import itertools
import logging
import os
import re
import shutil
import socket
import struct
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)
NO_NETNS_ENV = "LIT_TEST_NO_NETNS"
_made = itertools.count()


class NetnsError(RuntimeError):
    """An ``ip`` command that makes the namespace failed."""


@dataclass(frozen=True)
class Network:
    """Where the other host's processes run, and the address at which they reach the trainer."""

    kind: str
    """``netns`` or ``host-tcp``."""
    trainer_host: str
    """The address the trainer binds; the workers reach it there."""
    namespace: str | None = None
    other_host: str = ""
    """The address at which this side reaches what runs there (the namespace's end of the pair)."""

    def command(self, *args: str) -> list[str]:
        """``args`` run where the other host's processes run."""
        return ["ip", "netns", "exec", self.namespace, *args] if self.namespace else list(args)


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def free_subnet() -> tuple[str, str]:
    """A /30 of 10.213.0.0/16 that no interface here uses: (this side's address, the namespace's)."""
    used = set(re.findall(r"inet (10\.213\.[\d.]+)/", ip("-4", "-o", "addr", "show")))
    for k in range(1 << 14):
        base = ipaddress.ip_address("10.213.0.0") + 4 * ((os.getpid() + k) % (1 << 14))
        if str(base + 1) not in used:
            return str(base + 1), str(base + 2)
    raise NetnsError("no free /30 left in 10.213.0.0/16")


@contextlib.contextmanager
def veth_namespace() -> Iterator[tuple[str, str, str]]:
    """A new network namespace joined to this one by a veth pair on a free /30: (its name, the address of the pair's
    end on this side, that of its end in the namespace). The pair and the namespace are removed on exit, and no
    process may be left in it."""
    n, pid = next(_made), os.getpid()
    name, here, there = f"lit-test-{pid}-{n}", f"lt{pid}h{n}", f"lt{pid}w{n}"  # interface names: 15 characters
    here_address, there_address = free_subnet()
    try:
        ip("netns", "add", name)
        ip("link", "add", here, "type", "veth", "peer", "name", there)
        ip("link", "set", there, "netns", name)
        ip("addr", "add", f"{here_address}/30", "dev", here)
        ip("link", "set", here, "up")
        ip("-n", name, "addr", "add", f"{there_address}/30", "dev", there)
        ip("-n", name, "link", "set", there, "up")
        ip("-n", name, "link", "set", "lo", "up")
        yield name, here_address, there_address
        left = ip("netns", "pids", name).split()
        assert not left, f"processes left in the namespace {name}: {left}"
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


@functools.cache
def transport() -> tuple[str, str]:
    """``netns`` when this process can make a network namespace with a veth pair, else ``host-tcp``; and why."""
    if os.environ.get(NO_NETNS_ENV, "") not in ("", "0"):
        return "host-tcp", f"{NO_NETNS_ENV} is set"
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "host-tcp", "network namespaces need root and iproute2's `ip`"
    try:
        with veth_namespace():
            pass
    except NetnsError as exc:
        return "host-tcp", f"no network namespace could be made: {exc}"
    return "netns", "this process can make network namespaces"


def machine_address() -> str:
    """The first non-loopback IPv4 address of an interface that is up, or 127.0.0.1 when there is none."""
    for _, name in socket.if_nameindex():
        request = struct.pack("256s", name.encode()[:15])
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                flags = struct.unpack("H", fcntl.ioctl(sock.fileno(), 0x8913, request)[16:18])[0]  # SIOCGIFFLAGS
                address = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), 0x8915, request)[20:24])  # SIOCGIFADDR
            except OSError:  # no IPv4 address
                continue
        if flags & 1 and not ipaddress.ip_address(address).is_loopback and not re.fullmatch(r"lt\d+h\d+", name):
            return address
    return "127.0.0.1"


@contextlib.contextmanager
def other_host(what: str) -> Iterator[Network]:
    """Where ``what`` runs as on another host (``transport``), logged with why."""
    kind, why = transport()
    if kind == "netns":
        with veth_namespace() as (name, here, there):
            log.warning("%s run in the network namespace %s and reach this side at %s (%s)", what, name, here, why)
            yield Network(kind, here, name, there)
    else:
        address = machine_address()
        log.warning("%s run as plain processes on this machine and reach this side at %s, not in a network "
                    "namespace: %s", what, address, why)
        yield Network(kind, address, None, address)
