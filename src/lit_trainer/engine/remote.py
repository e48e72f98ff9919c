"""A vLLM server on another host that joins a run: ``lit serve`` runs it there (``serve.py``), and the trainer
reaches it at the endpoint the config names (``inference.remote``). Its agents' calls go to its OpenAI routes like a
local server's; its weights travel over ZeroMQ, CURVE-encrypted with the trainer's own keys (``security.
load_engine_link_keys``), as frames (``weight_wire``) that ``lit serve`` writes into its host's shared memory and
reloads in place (``WeightSync``, as for a local server), tagged with the step's version.

``RemoteServer`` offers what ``Fleet`` asks of a server and of its weight sync: ``base_url``, ``llm``,
``check_alive``, ``exited``, ``push_weights``, ``push_adapters``. A remote server is never started again by the
trainer: one that stops answering is dropped from the run, and taken back at a later push once it answers again
(``Fleet``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgpack
import torch
import zmq

from lit_sdk.protocol import security
from lit_sdk.resources import LLM
from lit_trainer.engine.launch import InferenceError
from lit_trainer.engine.server import ServerDiedError, answers_health
from lit_trainer.engine.weight_sync import Adapters, SyncReport, WeightSyncError
from lit_trainer.engine.weight_wire import pack

if TYPE_CHECKING:
    from typing import Self

HELLO, WEIGHTS, ADAPTERS = b"hello", b"weights", b"adapters"
"""The requests ``lit serve`` answers (the first frame of each)."""
ADAPTER_SEPARATOR = "::"
"""An adapter's tensors travel as ``<served name>::<peft name>``."""
KEYS_FIX = "start it with --keys naming a copy of this run's [security] keys_dir"
HEALTH_EVERY_S = 1.0
"""``check_alive`` asks the server's ``/health`` at most this often (the rollouts' wait calls it every 50 ms)."""


class RemoteServer:
    """The vLLM server that ``lit serve`` runs at ``endpoint`` (``tcp://HOST:PORT``), for this run: its API key is
    the run's (``api_key``), the link's keys are the trainer's (``keys``). ``connect`` asks it where its OpenAI
    routes are; then it serves and takes weights like a local server. ``timeout_s``: how long a request to
    ``lit serve`` may take (a push waits for the reload)."""

    process = None
    """No process of this host: the memory metrics and the restarts leave it out."""
    credentials = None

    def __init__(self, endpoint: str, keys: security.ClientKeys, api_key: str | None, timeout_s: float) -> None:
        self.endpoint, self.keys, self.api_key, self.timeout_s = endpoint, keys, api_key, timeout_s
        self.host = security.endpoint_host(endpoint) or "127.0.0.1"
        self.port: int | None = None
        self.model_name = ""
        self.version = ""
        """The weight version ``lit serve`` said its server holds, at the last hello or push."""
        self._sock: zmq.Socket | None = None
        self._monitor: security.HandshakeMonitor | None = None
        self._healthy_at = 0.0

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def openai_url(self) -> str:
        return f"{self.base_url}/v1"

    def llm(self, temperature: float, max_tokens: int | None) -> LLM:
        return LLM(self.openai_url, self.model_name, api_key=self.api_key or "EMPTY", temperature=temperature,
                   max_tokens=max_tokens)

    def connect(self, timeout_s: float | None = None) -> Self:
        """Say hello (waiting up to ``timeout_s``, default ``self.timeout_s``) and learn the server's port, served
        name and weight version; ``InferenceError`` naming the fix when ``lit serve`` does not answer."""
        answer = self._request([HELLO], timeout_s or self.timeout_s, "hello")
        self.port, self.model_name = int(answer["port"]), str(answer["served_model_name"])
        self.version = str(answer["version"])
        return self

    def is_healthy(self) -> bool:
        return answers_health(self.base_url)

    def exited(self, within_s: float = 0.0) -> bool:
        """Whether the server stopped answering ``/health`` (asked until ``within_s`` has passed)."""
        deadline = time.monotonic() + within_s
        while self.is_healthy():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)
        return True

    def check_alive(self) -> None:
        """``ServerDiedError`` when ``/health`` does not answer (asked at most every ``HEALTH_EVERY_S``)."""
        if time.monotonic() - self._healthy_at < HEALTH_EVERY_S:
            return
        if not self.is_healthy():
            raise ServerDiedError(f"the vLLM server at {self.base_url} (lit serve at {self.endpoint}) stopped "
                                  "answering")
        self._healthy_at = time.monotonic()

    def push_weights(self, state: Mapping[str, torch.Tensor], version: str) -> SyncReport:
        """Send the whole weights (in the serving dtype) and have them loaded as ``version``."""
        return self._push([WEIGHTS, *pack({"version": version}, state)], version)

    def push_adapters(self, adapters: Adapters, version: str) -> SyncReport:
        """Send every adapter of ``adapters`` and have them hot-loaded as ``version``."""
        configs = {name: json.loads(json.dumps(config, default=str)) for name, (config, _) in adapters.by_name.items()}
        tensors = {f"{name}{ADAPTER_SEPARATOR}{key}": t for name, (_, state) in adapters.by_name.items()
                   for key, t in state.items()}
        return self._push([ADAPTERS, *pack({"version": version, "adapters": configs}, tensors)], version)

    def _push(self, frames: list[Any], version: str) -> SyncReport:
        t0 = time.perf_counter()
        answer = self._request(frames, self.timeout_s, f"the weights of version {version}")
        report = SyncReport(version, {f"remote_{k}": float(v) for k, v in answer["seconds"].items()})
        report.seconds["send"] = max(0.0, time.perf_counter() - t0 - report.total_s)  # the rest of the round trip
        self.version = version
        return report

    def close(self) -> None:
        """Close the link (the server stays up: it is ``lit serve``'s)."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock, self._monitor = None, None

    stop = close

    def _request(self, frames: list[Any], timeout_s: float, what: str) -> dict[str, Any]:
        """Send ``frames`` and wait for the answer; on no answer the link is closed (the next request opens a new
        one: a late answer never meets a later request)."""
        if self._sock is None:
            self._sock = zmq.Context.instance().socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.IMMEDIATE, 1)  # writable once the server let this link in
            refused = f"lit serve at {self.endpoint} refused this trainer's keys ({{kind}}): {KEYS_FIX}"
            self._monitor = security.guard_client(self._sock, self.endpoint, self.keys, f"lit serve at {self.endpoint}",
                                                  refused)
            self._sock.connect(self.endpoint)
        deadline, since = time.monotonic() + timeout_s, self._monitor.counts if self._monitor else {}
        if self._ready(zmq.POLLOUT, deadline, since) and self._send(frames):
            if self._ready(zmq.POLLIN, deadline, since):
                answer = msgpack.unpackb(self._sock.recv())
                if "error" in answer:
                    raise WeightSyncError(f"lit serve at {self.endpoint} refused {what}: {answer['error']}")
                return answer
        self.close()
        raise ServerDiedError(f"lit serve at {self.endpoint} did not answer {what} within {timeout_s:.0f} s: is it "
                              "running there, with the keys of this run's [security] keys_dir, and is its port open "
                              "to this host?")

    def _send(self, frames: list[Any]) -> bool:
        """Queue ``frames`` on a link ``_ready`` found writable; False when it dropped meanwhile."""
        try:
            self._sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _ready(self, event: int, deadline: float, since: dict[str, int]) -> bool:
        """Whether the link is ready for ``event`` (``zmq.POLLOUT``: lit serve let it in; ``POLLIN``: an answer
        came) before ``deadline``; ``ServerDiedError`` at once when lit serve refuses this trainer's keys (failed
        handshakes counted ``since`` the request began)."""
        while True:
            refused = self._monitor.keys_refused(since) if self._monitor else None
            if refused:
                self.close()
                raise ServerDiedError(f"lit serve at {self.endpoint} refused this trainer's keys ({refused}): "
                                      f"{KEYS_FIX}")
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._sock.poll(int(min(left, 0.2) * 1000) or 1, event):
                return True


def connect_remotes(endpoints: list[str] | tuple[str, ...], keys_dir: str, api_key: str | None, served_name: str,
                    timeout_s: float) -> list[RemoteServer]:
    """A connected ``RemoteServer`` for each endpoint; ``InferenceError`` naming the fix when one does not answer
    or serves the model under another name than the run's agents call (``served_name``)."""
    _, keys = security.load_engine_link_keys(keys_dir)
    remotes = []
    for endpoint in endpoints:
        print(f"lit: asking lit serve at {endpoint} for its vLLM server (up to {timeout_s:.0f} s)", file=sys.stderr,
              flush=True)
        try:
            remote = RemoteServer(endpoint, keys, api_key, timeout_s).connect()
        except ServerDiedError as exc:
            raise InferenceError(str(exc)) from None
        if remote.model_name != served_name:
            remote.close()
            raise InferenceError(f"lit serve at {endpoint} serves its model as {remote.model_name!r} and this run's "
                                 f"agents call {served_name!r}: start it with the run's config (inference."
                                 "served_model_name)")
        remotes.append(remote)
    return remotes
