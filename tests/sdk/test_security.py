"""CURVE keys on real ZeroMQ sockets (ROUTER/DEALER over tcp://127.0.0.1): the right keys pass, a peer without
keys, with an unknown client key or with a wrong server key gets nothing through and is counted; key files are
private; a non-loopback bind without keys is refused with the command that makes them."""

from __future__ import annotations

import contextlib
import dataclasses
import stat
import time
from pathlib import Path

import pytest
import zmq

from lit_sdk import config
from lit_sdk.protocol import security
from lit_sdk.protocol.security import (
    ClientKeys,
    SecurityError,
    ServerKeys,
    check_bind,
    check_connect,
    generate_keys,
    is_local_endpoint,
    load_client_keys,
    load_server_keys,
    read_api_key,
    secure_client,
    secure_server,
)


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "keys"
    generate_keys(folder)
    return folder


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    security.stop_authenticator(context)
    context.destroy(linger=0)


def _router(ctx: zmq.Context, keys: ServerKeys | None) -> tuple[zmq.Socket, security.HandshakeMonitor | None, str]:
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    monitor = secure_server(sock, keys) if keys else None
    sock.bind("tcp://127.0.0.1:*")
    return sock, monitor, sock.last_endpoint.decode()


def _dealer(ctx: zmq.Context, endpoint: str, keys: ClientKeys | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if keys:
        secure_client(sock, keys)
    sock.connect(endpoint)
    return sock


def _send_refused(sock: zmq.Socket, data: bytes) -> None:
    """Send from a peer the trainer refuses, without waiting: the message is queued while the handshake runs, but
    once the handshake has failed the connection is gone and a blocking send would wait for ever (seen on CI under
    load, 2026-11-30, when the refusal came before the send). The refusal is what the tests count either way."""
    with contextlib.suppress(zmq.Again):
        sock.send(data, zmq.NOBLOCK)


def _wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_generate_writes_private_keys_once(keys_dir: Path):
    assert stat.S_IMODE(keys_dir.stat().st_mode) == 0o700
    names = {p.name: stat.S_IMODE(p.stat().st_mode) for p in keys_dir.iterdir()}
    assert names == {"server.key": 0o644, "server.key_secret": 0o600, "client.key": 0o644,
                     "client.key_secret": 0o600, "api_key": 0o600}
    server, client = load_server_keys(keys_dir), load_client_keys(keys_dir)
    assert server.authorized == (client.public,) and client.server_public == server.public
    assert len({server.public, server.secret, client.public, client.secret}) == 4
    assert len(read_api_key(keys_dir / "api_key")) >= 32
    before = (keys_dir / "server.key_secret").read_bytes()
    with pytest.raises(SecurityError, match="never overwrites"):
        generate_keys(keys_dir)
    assert (keys_dir / "server.key_secret").read_bytes() == before


def test_generate_refuses_a_folder_others_can_open(tmp_path: Path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(SecurityError, match="chmod 700"):
        generate_keys(shared)
    assert list(shared.iterdir()) == []


@pytest.mark.parametrize("name, load", [
    ("server.key_secret", load_server_keys),
    ("client.key_secret", load_client_keys),
    ("api_key", lambda d: read_api_key(d / "api_key")),
])
def test_secret_files_readable_by_others_are_refused(keys_dir: Path, name: str, load):
    (keys_dir / name).chmod(0o640)
    with pytest.raises(SecurityError, match=rf"{name} can be read by other users.*chmod 600"):
        load(keys_dir)


def test_missing_keys_name_the_file_and_how_to_make_them(tmp_path: Path, keys_dir: Path):
    with pytest.raises(SecurityError, match="lit keys generate"):
        load_server_keys(tmp_path / "nowhere")
    worker_host = tmp_path / "worker"
    worker_host.mkdir(mode=0o700)
    (worker_host / "client.key_secret").write_bytes((keys_dir / "client.key_secret").read_bytes())
    (worker_host / "client.key_secret").chmod(0o600)
    with pytest.raises(SecurityError, match=r"missing .*worker/server\.key: .*lit keys generate"):
        load_client_keys(worker_host)
    (worker_host / "server.key").write_bytes((keys_dir / "server.key").read_bytes())
    assert load_client_keys(worker_host).server_public == load_server_keys(keys_dir).public
    with pytest.raises(SecurityError, match="server.key_secret"):
        load_server_keys(worker_host)  # a worker host never holds the trainer's secret


def test_the_right_keys_pass_both_ways_and_nothing_is_counted(ctx: zmq.Context, keys_dir: Path):
    router, monitor, endpoint = _router(ctx, load_server_keys(keys_dir))
    dealer = _dealer(ctx, endpoint, load_client_keys(keys_dir))
    dealer.send(b"span batch")
    assert router.poll(5000), "a peer with the right keys got nothing through"
    identity, body = router.recv_multipart()
    assert body == b"span batch"
    router.send_multipart([identity, b"ack"])
    assert dealer.poll(5000) and dealer.recv() == b"ack"
    assert monitor.counts == {}


def _other_client(keys: ClientKeys) -> ClientKeys:
    public, secret = zmq.curve_keypair()
    return dataclasses.replace(keys, public=public, secret=secret)


def _wrong_server(keys: ClientKeys) -> ClientKeys:
    return dataclasses.replace(keys, server_public=zmq.curve_keypair()[0])


@pytest.mark.parametrize("client, kind", [
    (lambda keys: None, "no_key"),
    (_other_client, "unknown_key"),
    (_wrong_server, "bad_key"),
])
def test_a_peer_with_a_wrong_or_missing_key_is_refused_and_counted(ctx: zmq.Context, keys_dir: Path, client, kind):
    router, monitor, endpoint = _router(ctx, load_server_keys(keys_dir))
    dealer = _dealer(ctx, endpoint, client(load_client_keys(keys_dir)))
    _send_refused(dealer, b"a forged root span with reward 1e9")
    assert _wait_for(lambda: monitor.counts.get(kind, 0) >= 1), monitor.counts
    assert not router.poll(300), "a refused peer's message reached the trainer"
    assert set(monitor.counts) == {kind}


def test_a_peer_without_keys_passes_where_there_are_none(ctx: zmq.Context):
    """The control for the test above: the same plain DEALER gets through to an unsecured ROUTER."""
    router, _, endpoint = _router(ctx, None)
    dealer = _dealer(ctx, endpoint, None)
    dealer.send(b"hello")
    assert router.poll(5000)


def test_each_secured_socket_admits_only_its_own_clients(ctx: zmq.Context, tmp_path: Path):
    """One authenticator per context serves both channels; a key authorised on one is not on the other."""
    generate_keys(tmp_path / "a")
    generate_keys(tmp_path / "b")
    router_a, monitor_a, endpoint_a = _router(ctx, load_server_keys(tmp_path / "a"))
    router_b, monitor_b, endpoint_b = _router(ctx, load_server_keys(tmp_path / "b"))
    client_a = load_client_keys(tmp_path / "a")
    dealer_a = _dealer(ctx, endpoint_a, client_a)
    dealer_a.send(b"to a")
    assert router_a.poll(5000) and router_a.recv_multipart()[1] == b"to a"
    # a's client key, with b's server key so that the handshake gets as far as the allow list
    a_to_b = dataclasses.replace(client_a, server_public=load_server_keys(tmp_path / "b").public)
    dealer_b = _dealer(ctx, endpoint_b, a_to_b)
    _send_refused(dealer_b, b"to b")
    assert _wait_for(lambda: monitor_b.counts.get("unknown_key", 0) >= 1), monitor_b.counts
    assert not router_b.poll(300)
    assert monitor_a.counts == {}


@pytest.mark.parametrize("client, kind", [(_other_client, "unknown_key"), (_wrong_server, "handshake")])
def test_the_client_side_counts_the_trainer_refusing_it(ctx: zmq.Context, keys_dir: Path, client, kind):
    """A wrong client key is refused by name; a wrong server key only gets its hellos dropped, which the client
    takes for a refusal after ``HANDSHAKES_BROKEN`` of them (``keys_refused``)."""
    router, _, endpoint = _router(ctx, load_server_keys(keys_dir))
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    monitor = secure_client(sock, client(load_client_keys(keys_dir)))
    assert monitor.keys_refused() is None
    sock.connect(endpoint)
    assert _wait_for(lambda: monitor.keys_refused() == kind), monitor.counts
    router.close()
    assert monitor.keys_refused(since=monitor.counts) is None  # what was counted before does not count


def test_the_monitor_thread_ends_with_its_socket(ctx: zmq.Context, keys_dir: Path):
    router, monitor, _ = _router(ctx, load_server_keys(keys_dir))
    router.close()
    assert monitor.wait_stopped(5)


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:0", "tcp://*:7373", "tcp://[::]:7373", "tcp://10.1.2.3:7373",
                                      "tcp://eth0:7373", "tcp://trainer.example:7373"])
def test_a_non_loopback_bind_without_keys_is_refused_with_the_fix(endpoint: str, keys_dir: Path):
    assert not is_local_endpoint(endpoint)
    with pytest.raises(SecurityError, match=r"lit keys generate .*\[security\] keys_dir") as raised:
        check_bind(endpoint, None, "the collector", "collector.endpoint")
    assert endpoint in str(raised.value) and "collector.endpoint" in str(raised.value)
    check_bind(endpoint, load_server_keys(keys_dir), "the collector", "collector.endpoint")
    with pytest.raises(SecurityError, match="LIT_KEYS_DIR"):
        check_connect(endpoint, None, "lit worker")


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:0", "tcp://127.0.0.2:7373", "tcp://localhost:7373",
                                      "tcp://[::1]:7373", "tcp://lo:7373", "ipc:///tmp/lit.sock", "inproc://spans"])
def test_loopback_and_local_endpoints_need_no_keys(endpoint: str):
    assert is_local_endpoint(endpoint)
    check_bind(endpoint, None, "the collector", "collector.endpoint")
    check_connect(endpoint, None, "lit worker")


def test_the_sdk_finds_the_keys_folder_in_its_argument_or_lit_keys_dir(monkeypatch, tmp_path: Path):
    monkeypatch.delenv("LIT_KEYS_DIR", raising=False)
    assert config.resolve().keys_dir is None
    monkeypatch.setenv("LIT_KEYS_DIR", str(tmp_path / "env"))
    assert config.resolve().keys_dir == tmp_path / "env"
    assert config.resolve(keys_dir=tmp_path / "arg").keys_dir == tmp_path / "arg"


def test_the_guards_check_the_endpoint_then_secure_the_socket(ctx: zmq.Context, keys_dir: Path, monkeypatch):
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    with pytest.raises(SecurityError, match="lit keys generate"):
        security.guard_server(router, "tcp://0.0.0.0:0", None, "the dispatcher", "dispatch_endpoint.endpoint")
    assert security.guard_server(router, "tcp://127.0.0.1:0", None, "the dispatcher", "x") is None
    monitor = security.guard_server(router, "tcp://0.0.0.0:0", load_server_keys(keys_dir), "the dispatcher", "x")
    router.bind("tcp://127.0.0.1:*")
    monkeypatch.setenv("LIT_KEYS_DIR", str(keys_dir))
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    assert security.guard_client(dealer, router.last_endpoint.decode(), security.client_keys(), "lit worker")
    dealer.connect(router.last_endpoint.decode())
    dealer.send(b"hello")
    assert router.poll(5000) and monitor.counts == {}
    monkeypatch.delenv("LIT_KEYS_DIR")
    assert security.client_keys() is None


def test_no_handler_means_nobody_gets_in(ctx: zmq.Context, keys_dir: Path):
    """Fail closed: with the ZAP thread gone, even the right keys are refused (ZAP_ENFORCE_DOMAIN). Once, on CI
    under load (2026-11-29), a handshake got no refusal within 5 s (not in 15 runs here beside two busy cores).
    The likely cause, not confirmed: ZeroMQ closes the stopped thread's ZAP socket in the background, and a
    handshake in that moment waits for an answer that never comes. Nothing gets in either way; a new client after
    5 s quiet meets no handler at all."""
    router, monitor, endpoint = _router(ctx, load_server_keys(keys_dir))
    security.stop_authenticator(ctx)
    for _ in range(3):
        dealer = _dealer(ctx, endpoint, load_client_keys(keys_dir))
        _send_refused(dealer, b"x")
        if _wait_for(lambda: monitor.total >= 1):
            break
        dealer.close()
    assert monitor.total >= 1, monitor.counts
    assert not router.poll(300)
