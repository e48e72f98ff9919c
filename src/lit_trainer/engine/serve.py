"""``lit serve``: a vLLM server on this host for a trainer on another (``remote.py`` is the trainer's side).

It starts the config's vLLM server here (``InferenceServer``: the model, the run's API key from its keys folder),
then listens for the trainer on ``listen`` with the trainer's own CURVE keypair (``security.load_engine_link_keys``:
only who holds ``server.key_secret`` gets in). It answers:

- ``hello``: the server's port, served name and weight version;
- ``weights`` / ``adapters``: frames of tensors (``weight_wire``), loaded into the server in place through this
  host's shared memory, as a local trainer's push is (``WeightSync``), tagged with the version they carry; the
  answer holds the seconds of each phase.

A bad message gets an error answer and changes nothing. When the vLLM server dies, ``lit serve`` stops with its
error (a process manager may start it again; the trainer takes it back at its next push).
"""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from typing import Any

import msgpack
import zmq

from lit_sdk.protocol import security
from lit_trainer.engine.config import InferenceConfig, WeightSyncConfig
from lit_trainer.engine.remote import ADAPTER_SEPARATOR, ADAPTERS, HELLO, WEIGHTS
from lit_trainer.engine.server import InferenceServer
from lit_trainer.engine.weight_sync import Adapters, SyncReport, WeightSync, WeightSyncError
from lit_trainer.engine.weight_wire import WireError, unpack

ADAPTER_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def serve(inference: InferenceConfig, weight_sync: WeightSyncConfig, keys_dir: str, listen: str) -> None:
    """Run the server and answer the trainer until the server dies (``ServerDiedError``) or Ctrl-C."""
    server_keys, _ = security.load_engine_link_keys(keys_dir)
    with InferenceServer(replace(inference, servers=1)) as server, \
            WeightSync(server.base_url, replace(weight_sync, transport="shm"), credentials=server.credentials) as sync:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            security.guard_server(sock, listen, server_keys, "lit serve", "--listen")
            sock.bind(listen)
            print(f"lit serve: vLLM serves {inference.model} as {server.model_name!r} at {server.openai_url}; a "
                  f"trainer with the keys of {keys_dir} adds it with: inference.remote = "
                  f"[\"{sock.getsockopt_string(zmq.LAST_ENDPOINT)}\"] (this host's address in place of 0.0.0.0)",
                  file=sys.stderr, flush=True)
            host = Host(server, sync)
            while True:
                server.check_alive()
                if sock.poll(1000):
                    identity, *frames = sock.recv_multipart(copy=True)
                    sock.send_multipart([identity, msgpack.packb(host.answer(frames))])
        finally:
            sock.close(linger=0)


class Host:
    """The server of ``lit serve`` and its weight sync, answering the trainer's requests."""

    def __init__(self, server: InferenceServer, sync: WeightSync) -> None:
        self.server, self.sync = server, sync
        self.version = "0"
        """The version of the weights the server holds (the config's model's: 0)."""

    def answer(self, frames: list[bytes]) -> dict[str, Any]:
        """What one request gets: the server's facts, or the seconds of a push; ``{"error": ...}`` for a bad one,
        which changes nothing."""
        kind = frames[0] if frames else b""
        try:
            if kind == HELLO:
                return {"port": self.server.port, "served_model_name": self.server.model_name,
                        "version": self.version}
            if kind in (WEIGHTS, ADAPTERS):
                header, tensors = unpack(frames[1:])
                version = header.get("version")
                if not isinstance(version, str) or not version:
                    raise WireError("the push names no version")
                report = self.load(kind, header, tensors, version)
                self.version = version
                print(f"lit serve: weights of version {version} loaded in {report.total_s:.2f} s "
                      f"({sum(len(f) for f in frames[2:]) / 1e6:.0f} MB)", file=sys.stderr, flush=True)
                return {"seconds": report.seconds, "version": version}
            return {"error": f"unknown request {kind[:40]!r}"}
        except (WireError, WeightSyncError) as exc:
            return {"error": str(exc)}

    def load(self, kind: bytes, header: dict[str, Any], tensors: dict[str, Any], version: str) -> SyncReport:
        """Load a push's tensors into the server as ``version``: whole weights, or adapters by served name."""
        if kind == WEIGHTS:
            return self.sync.push_weights(tensors, version=version)
        configs = header.get("adapters")
        if not isinstance(configs, dict) or not configs:
            raise WireError("an adapters push names no adapter")
        bad = [name for name, config in configs.items()
               if not (isinstance(name, str) and ADAPTER_NAME.fullmatch(name) and isinstance(config, dict))]
        if bad:  # a name becomes a folder of this host's shared memory
            raise WireError(f"adapter names must be letters, digits, '.', '_' or '-' (got {bad[:3]})")
        by_name: dict[str, tuple[dict, dict]] = {str(name): (config, {}) for name, config in configs.items()}
        for key, tensor in tensors.items():
            name, _, param = key.partition(ADAPTER_SEPARATOR)
            if name not in by_name or not param:
                raise WireError(f"tensor {key!r} belongs to no adapter the push names")
            by_name[name][1][param] = tensor
        return self.sync.push_adapters(Adapters(by_name), version=version)
