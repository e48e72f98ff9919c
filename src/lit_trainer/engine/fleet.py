"""The vLLM servers of a run, as one fleet: started together, a weight sync into each, the policy's weights pushed
into every one, and a server that died started again alone, on its port, with the current weights.

    with Fleet(inference, weight_sync, weights=policy.state_dict) as fleet:   # every server loads at once
        fleet.push_weights(policy.state_dict(), version="3")                  # into each server in turn
        fleet.check()                                                          # ServerDiedError if one died

With several servers (``inference.servers``) each gets its own cores or GPUs (``placement``) and its own port
(``port``, ``port + 1``, ... or a free one each); the weight sync of server ``i`` meets on NCCL port
``nccl_master_port + i``. A server dying is recovered from wherever it is noticed: during a push (``push_weights``)
or by whoever saw a request fail (``restart``); ``restarts`` counts the servers started again. With asynchronous
rollouts a restart may come from another thread while the loop changes the weights: the loop ``hold``s the fleet
meanwhile, so a server started again never gets weights half updated.

Servers on other hosts (``inference.remote``, each run by ``lit serve``: ``remote.py``) join a fleet that takes
weights, after the local ones: the current weights reach them when the fleet is ready and at every push. One that
stops answering is dropped instead of started again (``dropped``, counted in ``restarts``), and each later push
asks whether it answers again, then takes it back with that push's weights.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from lit_trainer.engine.config import InferenceConfig, WeightSyncConfig
from lit_trainer.engine.launch import resolve_api_key, server_ports
from lit_trainer.engine.logprob_check import LogprobGap, Sample, logprob_gap, sample_from_vllm
from lit_trainer.engine.remote import RemoteServer, connect_remotes
from lit_trainer.engine.server import InferenceServer, ServerDiedError
from lit_trainer.engine.weight_sync import Adapters, SyncReport, WeightSync, WeightSyncError

if TYPE_CHECKING:
    from typing import Self

Weights = Callable[[], "Mapping[str, Any] | Adapters"]
"""What gives the policy's current weights (its ``state_dict``), for a server started again."""

Score = Callable[[Sequence[Sample]], Sequence[torch.Tensor]]
"""The trainer's logprobs of a server's samples' response tokens (``logprob_check.score`` on its model)."""

REJOIN_WAIT_S = 3.0
"""How long a weight push waits for a dropped remote server's ``lit serve`` to answer before it goes on without it."""

SERVING_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                  "float16": torch.float16, "half": torch.float16}
"""``inference.dtype`` values lit casts the pushed weights to; ``auto`` leaves them as the trainer holds them."""


def for_serving(state: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """The weights in vLLM's serving dtype (``inference.dtype``): floating-point tensors cast on the device they are
    on, before they travel (a bfloat16 server gets half the bytes of float32 master weights); names that share a
    tensor (tied embeddings) still share its cast. ``auto``: as they are (vLLM casts them as it loads them)."""
    target = SERVING_DTYPES.get(dtype)
    if target is None:
        return dict(state)
    cast: dict[int, Any] = {}
    out = {}
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.dtype != target:
            if id(tensor) not in cast:
                cast[id(tensor)] = tensor.detach().to(target)
            tensor = cast[id(tensor)]
        out[name] = tensor
    return out


@dataclass
class PushReport:
    """One push of the weights into every server, one after the other: each server's ``SyncReport``."""

    version: str
    reports: list[SyncReport]

    @property
    def total_s(self) -> float:
        """The whole push (the servers were synced one after the other)."""
        return sum(r.total_s for r in self.reports)

    @property
    def slowest_s(self) -> float:
        """The slowest server's sync."""
        return max((r.total_s for r in self.reports), default=0.0)


class Fleet:
    """``inference.servers`` vLLM servers and, when it takes weights (``weights``: what gives the policy's current
    state dict), a ``WeightSync`` into each. Without ``weights`` (``lit eval``) it only serves: no sync is opened,
    and a server started again serves the config's model."""

    def __init__(self, inference: InferenceConfig, weight_sync: WeightSyncConfig | None = None,
                 weights: Weights | None = None, keys_dir: str = "", version: str = "0") -> None:
        if weights is not None and weight_sync is None:
            raise ValueError("a fleet that takes weights needs a WeightSyncConfig")
        self.inference, self.weight_sync, self.weights, self.keys_dir = inference, weight_sync, weights, keys_dir
        self.servers: list[InferenceServer | RemoteServer] = []
        """The local servers, then the remote ones (``inference.remote``, only when the fleet takes weights)."""
        self.syncs: list[WeightSync | RemoteServer] = []
        self.dropped: set[int] = set()
        """The remote servers left out of the run since they stopped answering, by index."""
        self.restarts = 0
        """Servers started again after they died."""
        self.version = version
        """The weight version the servers hold: the last one pushed; at first, that of ``weights`` (a resumed
        run's step; the base model's is 0), which a remote server gets when it joins."""
        self._pushed: dict[int, str] = {}
        """The version this fleet pushed into each server last, by index: a push of it again skips that server."""
        self._lock = threading.RLock()
        self.stopped = False
        """``stop`` was called: no server is started again."""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> Self:
        """Start every server and open their syncs; on any failure stop what was started and raise."""
        return self.launch().wait_ready()

    def launch(self) -> Self:
        """Launch every server and return at once (``wait_ready`` waits for them; their URLs are known now). All
        are launched from this thread (a server gets SIGTERM when the thread that launched it ends), so that they
        load at once. On a failure, stop what was started and raise."""
        many = f"{self.inference.servers} vLLM servers" if self.inference.servers > 1 else "vLLM"
        print(f"lit: starting {many} on {self.inference.model} (about a minute on CPU)", file=sys.stderr, flush=True)
        try:
            for index, port in enumerate(server_ports(self.inference)):
                server = InferenceServer(replace(self.inference, port=port), index=index)
                self.servers.append(server)
                server.launch()
            if self.weights is not None and self.inference.remote:
                self.servers += connect_remotes(self.inference.remote, self.keys_dir, resolve_api_key(self.inference),
                                                self.inference.served_model_name, self.weight_sync.request_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, meanwhile: Callable[[float], None] | None = None) -> Self:
        """Wait for every launched server, then open their syncs; on any failure stop every server and raise.
        ``meanwhile(seconds)`` is called between the health checks instead of sleeping that long (the trainer
        answers its workers' hellos while vLLM loads)."""
        try:
            for server in self.servers:
                if isinstance(server, InferenceServer):
                    server.wait_ready(meanwhile)
            self.syncs = [self._open_sync(i) for i in range(len(self.servers))] if self.weights else []
            for index, sync in enumerate(self.syncs):  # a remote server may hold another run's weights
                if isinstance(sync, RemoteServer):
                    self._push(index, self._latest(), self.version)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Close the syncs and stop every server, the last started first; none is started again after. Idempotent.
        Waits for a server being started again in another thread (``restart_server``) to be up first."""
        with self._lock:
            self.stopped = True
            for sync in self.syncs:
                sync.close()
            for server in reversed(self.servers):
                server.stop()

    @property
    def base_urls(self) -> list[str]:
        """Every server's ``http://host:port``, in server order."""
        return [s.base_url for s in self.servers]

    @property
    def serving(self) -> list[InferenceServer | RemoteServer]:
        """The servers that take rollouts now: all but the remote ones dropped."""
        return [s for i, s in enumerate(self.servers) if i not in self.dropped]

    @property
    def pids(self) -> list[int]:
        """The process of every running server (for the memory metrics)."""
        return [s.process.pid for s in self.servers if s.process is not None]

    def check(self) -> None:
        """Raise ``ServerDiedError`` if a server has died (a remote one: stopped answering)."""
        for server in self.serving:
            server.check_alive()

    @contextlib.contextmanager
    def asleep(self) -> Iterator[None]:
        """With ``inference.layout = "colocated"``: every local server sleeps during the block (its weights in host
        memory, its KV cache freed: the update may use that GPU memory) and wakes after it, also when it raises.
        Otherwise nothing happens. Remote servers never sleep."""
        local = [sync for sync in self.syncs if not isinstance(sync, RemoteServer)]
        if self.inference.layout != "colocated" or not local:
            yield
            return
        for sync in local:
            sync.sleep()
        try:
            yield
        finally:
            for sync in local:
                sync.wake_up()

    def hold(self) -> threading.RLock:
        """Held by the loop while it changes the policy's weights and pushes them, so that a server started again
        meanwhile from another thread (``restart``) gets whole weights of a version the others hold."""
        return self._lock

    def push_weights(self, state: Mapping[str, Any], version: str) -> PushReport | None:
        """Push ``state`` into every server in turn, tagged ``version``; a server that has died (during the update,
        or during this push) is started again with the current weights instead. The report; None when a server was
        started again (that took the time)."""
        with self._lock:
            reports, died = [], []
            served = state if isinstance(state, Adapters) else for_serving(state, self.inference.dtype)
            for index in sorted(self.dropped):
                self._take_back(index)
            for index in range(len(self.syncs)):
                if index in self.dropped or self._pushed.get(index) == version:
                    continue
                server = self.servers[index]
                try:
                    server.check_alive()
                    reports.append(self._push(index, served, version))
                except (ServerDiedError, WeightSyncError) as exc:
                    if not server.exited(within_s=5.0):  # an error of a live server is no death: it stops the run
                        raise
                    died.append((index, exc))
            for index, exc in died:
                self.restart_server(index, version, f"before the weights of step {version} reached it "
                                                    f"({first_line(exc)})")
            self.version = version
            return None if died else PushReport(version, reports)

    def restart(self, when: str, restarts_seen: int | None = None) -> None:
        """Start the servers that died ``when`` again (all of them when none is seen exited: the caller saw one
        die), with the current weights as the version the servers hold. ``restarts_seen``: ``restarts`` when the
        caller began what saw the death; if a server was started again since (by the loop's weight push, which
        found it dead too), there is nothing left to do."""
        with self._lock:
            if restarts_seen is not None and self.restarts != restarts_seen:
                return
            serving = [i for i in range(len(self.servers)) if i not in self.dropped]
            dead = [i for i in serving if self.servers[i].exited()]
            for index in dead or [i for i in serving if isinstance(self.servers[i], InferenceServer)]:
                self.restart_server(index, self.version, when)

    def restart_server(self, index: int, version: str, when: str) -> None:
        """Start server ``index`` again after it died ``when``, on its port (the agents' calls name its URL), with
        its own cores or GPUs, and push the current weights into it as ``version``; the others are left alone. A
        remote server is dropped instead (``dropped``) until a later push finds it answering."""
        with self._lock:
            old = self.servers[index]
            if isinstance(old, RemoteServer):
                self._drop(index, when)
                return
            if self.stopped:
                raise ServerDiedError(f"vLLM ({old.base_url}) died {when}, while the run was stopping: it is not "
                                      "started again")
            which = f"vLLM server {index} ({old.base_url})" if len(self.servers) > 1 else "vLLM"
            print(f"lit: {which} died {when}; starting it again with the current weights", file=sys.stderr)
            if self.syncs:
                self.syncs[index].close()
            old.stop()
            print(f"lit: restarting vLLM on port {old.port}", file=sys.stderr, flush=True)
            self.servers[index] = InferenceServer(replace(self.inference, port=old.port), index=index).start()
            self.restarts += 1
            if self.weights is not None:
                self.syncs[index] = self._open_sync(index)
                self._push(index, self._latest(), version)

    def drop_silent_remotes(self, when: str) -> bool:
        """Drop the remote servers that stopped answering ``when`` (``_drop``); whether there was one."""
        with self._lock:
            silent = [i for i, s in enumerate(self.servers)
                      if i not in self.dropped and isinstance(s, RemoteServer) and s.exited()]
            for index in silent:
                self._drop(index, when)
            return bool(silent)

    def _drop(self, index: int, when: str) -> None:
        """Leave remote server ``index`` out: no rollouts, no pushes, until ``_take_back`` finds it answering."""
        server = self.servers[index]
        print(f"lit: the remote vLLM server at {server.base_url} stopped answering {when}; the run goes on without "
              "it, and takes it back at a weight push once it answers again", file=sys.stderr, flush=True)
        server.close()
        self.dropped.add(index)
        self._pushed.pop(index, None)  # what it holds when it answers again is not known
        self.restarts += 1

    def _take_back(self, index: int) -> None:
        """Remote server ``index`` back into the run if ``lit serve`` answers there (at the same address), for the
        push under way to give it the weights; still dropped otherwise."""
        server = self.servers[index]
        assert isinstance(server, RemoteServer)
        url = server.base_url
        try:
            server.connect(timeout_s=REJOIN_WAIT_S)
        except ServerDiedError:
            return
        if server.base_url != url or not server.is_healthy():
            print(f"lit: lit serve at {server.endpoint} answers with its vLLM at {server.base_url}, not {url} as "
                  "before, or not ready: it stays out of the run (start it with the same --port)", file=sys.stderr)
            server.close()
            return
        self.dropped.discard(index)
        print(f"lit: the remote vLLM server at {url} answers again: taken back with this push",
              file=sys.stderr, flush=True)

    def _latest(self) -> Adapters | dict[str, Any]:
        """The policy's current weights as the servers take them (``for_serving``), for a server that joins."""
        assert self.weights is not None
        latest = self.weights()
        return latest if isinstance(latest, Adapters) else for_serving(latest, self.inference.dtype)

    def _push(self, index: int, state: Adapters | Mapping[str, Any], version: str) -> SyncReport:
        """Whole weights (in the serving dtype) or adapters into server ``index``."""
        sync = self.syncs[index]
        self._pushed.pop(index, None)
        report = (sync.push_adapters(state, version=version) if isinstance(state, Adapters)
                  else sync.push_weights(state, version=version))
        self._pushed[index] = version
        return report

    def logprob_gaps(self, score: Score, prompts: Sequence[Sequence[int]], tolerance: float,
                     max_tokens: int = 8, model: str | None = None) -> dict[str, LogprobGap]:
        """Each server's logprobs of greedy continuations of ``prompts`` against the trainer's (``score``: its
        logprobs of a server's samples), by base URL: whether the weights pushed last reached every server.
        ``model``: the served model to ask (an adapter's name; default the base model's). A remote server that
        stops answering meanwhile is dropped, and not in the result."""
        gaps = {}
        with self._lock:  # no server is being started again meanwhile (asynchronous rollouts)
            for index, s in enumerate(self.servers):
                if index in self.dropped:
                    continue
                try:
                    s.check_alive()
                    samples = sample_from_vllm(s.base_url, model or s.model_name, prompts, max_tokens=max_tokens,
                                               api_key=s.api_key)
                except Exception as exc:
                    if not s.exited(within_s=5.0):
                        raise
                    if isinstance(s, RemoteServer):
                        self._drop(index, f"during the sync check ({first_line(exc)})")
                        continue
                    s.check_alive()  # it died under the request: say so, with its log
                    raise
                gaps[s.base_url] = logprob_gap(samples, score(samples), tolerance)
        return gaps

    def _open_sync(self, index: int) -> WeightSync | RemoteServer:
        assert self.weight_sync is not None
        if isinstance(self.servers[index], RemoteServer):  # it takes the weights itself, over the network
            return self.servers[index]
        config = self.weight_sync
        if index:  # each server's NCCL group meets on a port of its own
            config = replace(config, nccl_master_port=config.nccl_master_port + index)
        server = self.servers[index]
        return WeightSync(server.base_url, config, credentials=server.credentials)


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (its type when it has none), for a one-line report."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
