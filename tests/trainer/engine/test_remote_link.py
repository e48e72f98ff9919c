"""The link between a trainer and ``lit serve`` on another host, without vLLM: the weights' frames (``weight_wire``)
and what ``lit serve`` makes of them (``serve.Host``), over a real CURVE-encrypted ZeroMQ link with the trainer's
keys (``RemoteServer``). Only who holds the trainer's keypair gets in, a worker's keys do not; a bad message gets an
error and loads nothing. ``Host``'s weight sync is a stand-in that records what it would load (a real ``lit serve``
with vLLM, in a network namespace: tests/e2e/test_remote_server.py)."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import msgpack
import pytest
import torch
import zmq

from lit_sdk.protocol import security
from lit_trainer.engine.remote import WEIGHTS, RemoteServer
from lit_trainer.engine.serve import Host
from lit_trainer.engine.server import ServerDiedError
from lit_trainer.engine.weight_sync import Adapters, SyncReport, WeightSyncError
from lit_trainer.engine.weight_wire import WireError, pack, unpack


def test_tensors_travel_whole_with_their_dtypes_and_shapes():
    tensors = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.tensor([1.5, -2.0]).bfloat16(),
               "c": torch.zeros(0, 4), "d": torch.tensor(7)}
    tensors["e"] = tensors["a"].t()  # not contiguous, and sharing a's memory
    header, out = unpack([bytes(memoryview(f)) for f in pack({"version": "3"}, tensors)])
    assert header == {"version": "3"}
    assert list(out) == list(tensors)
    for name, tensor in tensors.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name


@pytest.mark.parametrize("frames, error", [
    ([b"\xc1"], "not a weights message"),
    ([msgpack.packb({"tensors": [["a", "float32", [2]]]})], "names 1 tensors for 0 frames"),
    ([msgpack.packb({"tensors": [["a", "complex64", [2]]]}), b"\0" * 16], "a bad tensor entry"),
    ([msgpack.packb({"tensors": [["a", "float32", [-2]]]}), b""], "a bad tensor entry"),
    ([msgpack.packb({"tensors": [["a", "float32", [3]]]}), b"\0" * 8], "a: 8 bytes for a float32 tensor of shape"),
])
def test_frames_that_do_not_make_their_tensors_are_refused(frames, error):
    with pytest.raises(WireError, match=error):
        unpack(frames)


class RecordingSync:
    """A stand-in for ``lit serve``'s ``WeightSync`` into its vLLM: records what it would load."""

    def __init__(self):
        self.loaded = []

    def push_weights(self, state, version):
        self.loaded.append((version, {k: v.clone() for k, v in state.items()}))
        return SyncReport(version, {"reload": 0.5})

    def push_adapters(self, adapters, version):
        if "broken" in adapters.by_name:
            raise WeightSyncError("/v1/load_lora_adapter failed with HTTP 400")
        self.loaded.append((version, {n: (c, sorted(s)) for n, (c, s) in adapters.by_name.items()}))
        return SyncReport(version, {"load_adapter": 0.25})


@pytest.fixture
def link(tmp_path):
    """``lit serve``'s answering loop (``Host`` on a stand-in server and sync) in a thread, on a free port of
    127.0.0.1 with the trainer's keys; yields (keys folder, endpoint, host)."""
    security.generate_keys(tmp_path / "keys")
    server_keys, _ = security.load_engine_link_keys(tmp_path / "keys")
    host = Host(SimpleNamespace(port=8123, model_name="policy"), RecordingSync())
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    security.secure_server(sock, server_keys)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def answer_all():
        while not stop.is_set():
            if sock.poll(50):
                identity, *frames = sock.recv_multipart()
                sock.send_multipart([identity, msgpack.packb(host.answer(frames))])
        sock.close(linger=0)

    thread = threading.Thread(target=answer_all, daemon=True)
    thread.start()
    yield tmp_path / "keys", f"tcp://127.0.0.1:{port}", host
    stop.set()
    thread.join(5)


def test_the_trainer_learns_the_server_and_its_pushes_are_loaded_with_their_version(link):
    keys, endpoint, host = link
    _, client = security.load_engine_link_keys(keys)
    remote = RemoteServer(endpoint, client, "the-run-key", timeout_s=10).connect()
    assert (remote.port, remote.model_name, remote.version) == (8123, "policy", "0")
    assert remote.openai_url == "http://127.0.0.1:8123/v1" and remote.llm(0.7, 16).api_key == "the-run-key"
    weights = {"w": torch.randn(3, 4), "b": torch.randn(4).bfloat16()}
    report = remote.push_weights(weights, "1")
    assert report.version == "1" and report.seconds["remote_reload"] == 0.5 and report.seconds["send"] >= 0
    version, loaded = host.sync.loaded[-1]
    assert version == "1" and all(torch.equal(loaded[k], weights[k]) for k in weights)
    adapters = Adapters({"policy-writer": ({"r": 16, "target_modules": {"q_proj"}}, {"lora_A": torch.ones(2, 2)})})
    remote.push_adapters(adapters, "2")
    assert host.sync.loaded[-1] == ("2", {"policy-writer": ({"r": 16, "target_modules": "{'q_proj'}"}, ["lora_A"])})
    assert remote.connect().version == "2" and host.version == "2"
    remote.close()


def test_a_push_the_server_cannot_load_is_refused_and_changes_nothing(link):
    keys, endpoint, host = link
    remote = RemoteServer(endpoint, security.load_engine_link_keys(keys)[1], None, timeout_s=10)
    with pytest.raises(WeightSyncError, match="refused the weights of version 3: .*HTTP 400"):
        remote.push_adapters(Adapters({"broken": ({}, {"x": torch.ones(1)})}), "3")
    with pytest.raises(WeightSyncError, match="adapter names must be"):
        remote.push_adapters(Adapters({"../../etc": ({}, {"x": torch.ones(1)})}), "3")
    assert host.answer([WEIGHTS, msgpack.packb({"tensors": []})]) == {"error": "the push names no version"}
    assert host.answer([b"format c:"]) == {"error": "unknown request b'format c:'"}
    assert host.sync.loaded == [] and host.version == "0"
    remote.close()


def test_other_keys_are_refused_at_once_and_a_silent_server_is_named(link, tmp_path):
    keys, endpoint, host = link
    worker = RemoteServer(endpoint, security.load_client_keys(keys), None, timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(ServerDiedError, match=f"lit serve at {endpoint} refused this trainer's keys "
                       r"\(unknown_key\): start it with --keys naming a copy of this run's \[security\] keys_dir"):
        worker.connect()
    assert time.monotonic() - t0 < 10  # at the refusal, not at the timeout
    security.generate_keys(tmp_path / "another-run")  # lit serve started with another run's keys
    stranger = RemoteServer(endpoint, security.load_engine_link_keys(tmp_path / "another-run")[1], None, timeout_s=60)
    with pytest.raises(ServerDiedError, match=r"refused this trainer's keys \(handshake\): start it with --keys"):
        stranger.connect()  # its hello is dropped every time: 3 times say so
    assert time.monotonic() - t0 < 20
    assert host.sync.loaded == []
    with socket.socket() as free:  # a port where nothing listens
        free.bind(("127.0.0.1", 0))
        silent = f"tcp://127.0.0.1:{free.getsockname()[1]}"
    trainer = RemoteServer(silent, security.load_engine_link_keys(keys)[1], None, timeout_s=1)
    with pytest.raises(ServerDiedError, match=f"lit serve at {silent} did not answer hello within 1 s: is it running"):
        trainer.connect()
