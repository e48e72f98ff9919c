"""Push the trainer's new weights into the running vLLM server without restarting it, and bump the weight version.

One sync, whatever the transport: pause generation -> move the weights -> reset the prefix cache -> tag the
version -> resume. The prefix cache must go: it would otherwise serve KV states computed with the old weights.
``/resume`` is sent even when a step fails, so a failed sync never leaves the agents hanging on a paused server.

In-flight requests (``weight_sync.in_flight``), default ``keep``: ``/pause?mode=keep`` freezes them, and
``/reset_prefix_cache?reset_running_requests=true`` preempts them, so on resume vLLM recomputes their KV cache with
the new weights and they go on. Tokens sampled before the sync keep the logprobs of the old weights (the behaviour
policy that really produced them, which is what the loss needs); later tokens come from the new weights. ``wait``
finishes them on the old weights first (a sync then lasts as long as the longest request); ``abort`` drops them.

Transports (``weight_sync.transport``):
- ``shm`` (CPU, or a GPU server on the trainer's host): the weights go into one safetensors file in shared memory
  (``/dev/shm``), written once and afterwards updated in place through a memory map (a memcpy, not a
  re-serialisation), then ``POST /collective_rpc {"method": "reload_weights", ...}`` (vLLM dev mode) loads it.
- ``nccl`` / ``ipc`` (GPU): vLLM's weight-transfer engines (``vllm.distributed.weight_transfer``): a broadcast over
  an NCCL group the trainer joins as rank 0, or CUDA IPC handles when trainer and vLLM share a GPU. The server needs
  ``inference.weight_transfer_backend`` set to the same name. UNTESTED: no GPU was available when this was
  written; only its CPU-side wiring is tested.
- ``mode = "lora"``: the adapter is saved into shared memory and hot-loaded with ``/v1/load_lora_adapter``
  (``load_inplace``) under ``weight_sync.lora_name``; the server needs ``inference.enable_lora``.
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests
import torch
from safetensors.torch import save_file

from lit_sdk.install import pip_install
from lit_trainer.engine.config import WeightSyncConfig
from lit_trainer.engine.launch import Credentials
from lit_trainer.engine.owned_folders import claim_folder, release_folder

if TYPE_CHECKING:
    from typing import Self

WEIGHTS_FILE = "model.safetensors"
FOLDER_PREFIX = "lit-weights-"
"""The weight sync's folder in shared memory: ``owned_folders`` removes those of killed trainers."""


@dataclass(frozen=True)
class Adapters:
    """LoRA adapters for vLLM to serve beside its base model, which stays as it is (a ``[roles]`` table's): served
    name -> (``adapter_config.json`` as a dict, the weights by peft's names)."""

    by_name: Mapping[str, tuple[Mapping[str, Any], Mapping[str, torch.Tensor]]]


class WeightSyncError(RuntimeError):
    """A step of a sync failed; the message names the route, the server's answer and what to check."""


@dataclass
class SyncReport:
    """What one sync did: the new version and the seconds of each phase, in order."""

    version: str
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


def separate_aliases(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors, with a copy for each name that aliases an earlier one (tied embeddings:
    ``lm_head.weight`` is ``embed_tokens.weight``). safetensors refuses tensors that share memory; the head is
    kept under its own name because lit serves tied models untied on CPU (see ``served_model.untied_view``), and a
    tied server simply skips it."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        out[name] = tensor.detach().clone() if key in seen else tensor.detach()
        seen.add(key)
    return out


class ShmCheckpoint:
    """One safetensors file that is written once, then updated in place through a memory map.

    Re-serialising every weight on every sync costs far more than copying into the mapped pages, a memcpy
    (bench/README.md).
    The file is rewritten from scratch only when names, shapes or dtypes change.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / WEIGHTS_FILE
        self._layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._map: mmap.mmap | None = None

    def write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        layout = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
        if layout != self._layout:
            self._rewrite(tensors)
            self._layout = layout
            return
        with torch.no_grad():
            for name, tensor in tensors.items():
                self._views[name].copy_(tensor)
        self._map.flush()

    def _rewrite(self, tensors: Mapping[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        self.close()
        self.folder.mkdir(parents=True, exist_ok=True)
        separate = separate_aliases(tensors)
        save_file({name: t.contiguous().cpu() for name, t in separate.items()}, str(self.path))
        with self.path.open("r+b") as fh:
            self._map = mmap.mmap(fh.fileno(), 0)
        header_len = int.from_bytes(self._map[:8], "little")
        header = json.loads(self._map[8 : 8 + header_len])
        for name, tensor in tensors.items():
            start, end = header[name]["data_offsets"]
            flat = torch.frombuffer(self._map, dtype=tensor.dtype, count=tensor.numel(), offset=8 + header_len + start)
            assert flat.numel() * flat.element_size() == end - start, name
            self._views[name] = flat.view(tensor.shape)

    def close(self) -> None:
        self._views.clear()
        self._layout = None
        if self._map is not None:
            self._map.close()
            self._map = None


class WeightSync:
    """Pushes weights into one vLLM server at ``base_url``; holds the shared-memory folder and the version counter.

    The server's routes for weight sync need its admin token (``route_guard``) and the LoRA route its API key too:
    ``credentials`` are those of the server (``InferenceServer.credentials``; None: send none); ``api_key``
    replaces the API key."""

    def __init__(self, base_url: str, config: WeightSyncConfig, api_key: str | None = None, version: int = 0,
                 credentials: Credentials | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.config = config
        self.version = version
        self.session = requests.Session()
        if credentials is not None:
            self.session.headers.update(credentials.headers())
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        shm_root = config.shm_dir if os.path.isdir(config.shm_dir) else tempfile.gettempdir()
        self.folder, self._owner_fd = claim_folder(Path(shm_root), FOLDER_PREFIX)
        self.checkpoint = ShmCheckpoint(self.folder / "full")
        self._transfer = None
        self._latest: Mapping[str, torch.Tensor] = {}  # what the GPU transports send: the latest push's tensors

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Free the shared memory (and the GPU transfer group, if one was opened)."""
        self.checkpoint.close()
        release_folder(self.folder, self._owner_fd)
        self._owner_fd = -1
        if self._transfer is not None:
            self._transfer.shutdown()
            self._transfer = None

    def push_weights(
        self, weights: torch.nn.Module | Mapping[str, torch.Tensor], version: str | None = None
    ) -> SyncReport:
        """Make the server generate with ``weights`` from now on and tag them ``version`` (default: previous + 1).

        ``weights`` is a model or its state dict (what ``Fleet`` pushes: the policy's, in the serving dtype). The GPU
        transports send the named tensors of the latest push (a model's: its parameters).
        """
        if self.config.mode == "lora":
            raise WeightSyncError("weight_sync.mode is 'lora': call push_lora(adapter) instead")
        report = self._start_report(version)
        clock = _Clock(report)
        if self.config.transport == "shm":
            state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
            with clock("serialize"):
                self.checkpoint.write(state)

            def move() -> None:
                self.rpc("reload_weights", weights_path=str(self.checkpoint.folder))

        else:
            self._latest = dict(weights.named_parameters()) if isinstance(weights, torch.nn.Module) else weights
            move = self._transfer_engine().send_weights
        self._paused_round(clock, "reload" if self.config.transport == "shm" else "transfer", move, report.version)
        return report

    def push_lora(self, adapter: Any, version: str | None = None) -> SyncReport:
        """Hot-load a LoRA adapter (a PEFT model, or a folder holding ``adapter_config.json``) under ``lora_name``."""
        if self.config.mode != "lora":
            raise WeightSyncError("weight_sync.mode is 'full': set mode = 'lora' to push adapters")
        report = self._start_report(version)
        clock = _Clock(report)
        if isinstance(adapter, (str, os.PathLike)):
            folder = Path(adapter)
        else:
            folder = self.folder / "lora"
            with clock("serialize"):
                adapter.save_pretrained(str(folder))
        body = {"lora_name": self.config.lora_name, "lora_path": str(folder), "load_inplace": True}
        self._paused_round(clock, "load_adapter", lambda: self.post("/v1/load_lora_adapter", json=body), report.version)
        return report

    def push_adapters(self, adapters: Adapters, version: str | None = None) -> SyncReport:
        """Hot-load every adapter of ``adapters`` in place under its served name (new names are added), in one
        paused round, all tagged ``version``: written into this server's shared-memory folder, then
        ``/v1/load_lora_adapter`` each (the server needs ``inference.enable_lora``)."""
        report = self._start_report(version)
        clock = _Clock(report)
        folders = {}
        with clock("serialize"):
            for name, (config, state) in adapters.by_name.items():
                folders[name] = folder = self.folder / "lora" / name
                folder.mkdir(parents=True, exist_ok=True)
                tensors = {k: v.detach().contiguous() for k, v in state.items()}
                save_file(tensors, str(folder / "adapter_model.safetensors"))
                (folder / "adapter_config.json").write_text(json.dumps(config, default=str))

        def move() -> None:
            for name, folder in folders.items():
                self.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder),
                                                         "load_inplace": True})

        self._paused_round(clock, "load_adapter", move, report.version)
        return report

    def _start_report(self, version: str | None) -> SyncReport:
        self.version += 1
        return SyncReport(version=str(self.version) if version is None else str(version))

    def _paused_round(self, clock: _Clock, move_phase: str, move, version: str) -> None:
        with clock("pause"):
            self.post("/pause", params={"mode": self.config.in_flight})
        try:
            with clock(move_phase):
                move()
            with clock("reset_cache"):
                answer = self.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
            if not answer.get("success", False):
                raise WeightSyncError(f"vLLM could not reset its prefix cache ({answer}); old KV states may remain")
            with clock("version"):
                self.post("/update_weight_version", json={"new_version": version})
        finally:
            with clock("resume"):
                self.post("/resume")

    def sleep(self) -> None:
        """Put the server to sleep (``inference.layout = "colocated"``): its weights go to host memory, its KV cache
        is freed, until ``wake_up``. Needs ``--enable-sleep-mode``."""
        self.post("/sleep", params={"level": "1", "mode": self.config.in_flight})

    def wake_up(self) -> None:
        """Wake a sleeping server with the weights it had; WeightSyncError when it does not say it is awake."""
        answer = self.post("/wake_up")
        if answer.get("status") != "awake":
            raise WeightSyncError(f"vLLM did not wake up ({answer}): it cannot serve the next rollouts")

    def rpc(self, method: str, **kwargs: str) -> Any:
        """``POST /collective_rpc``: call ``method`` on every vLLM worker (needs the server's dev mode)."""
        return self.post("/collective_rpc", json={"method": method, "kwargs": kwargs})

    def post(self, route: str, params: dict | None = None, json: dict | None = None) -> dict:
        url = f"{self.base_url}{route}"
        try:
            response = self.session.post(url, params=params, json=json, timeout=self.config.request_timeout_s)
        except requests.Timeout as exc:
            raise WeightSyncError(
                f"{route} took longer than {self.config.request_timeout_s:.0f} s (weight_sync.request_timeout_s)"
            ) from exc
        except requests.ConnectionError as exc:
            raise WeightSyncError(f"cannot reach vLLM at {self.base_url} for {route}: is the server running?") from exc
        if response.status_code == 404:
            raise WeightSyncError(
                f"vLLM has no route {route}: start it with VLLM_SERVER_DEV_MODE=1 (inference.weight_sync)"
                + (
                    " and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (inference.enable_lora)"
                    if "lora" in route
                    else ""
                )
            )
        if not response.ok:
            raise WeightSyncError(f"{route} failed with HTTP {response.status_code}: {response.text[:2000]}")
        return response.json() if response.content and "json" in response.headers.get("content-type", "") else {}

    def weight_version(self) -> str:
        """The version the server reports (``GET /weight_info``)."""
        response = self.session.get(f"{self.base_url}/weight_info", timeout=self.config.request_timeout_s)
        response.raise_for_status()
        return response.json()["weight_version"]

    def _transfer_engine(self):
        if self._transfer is None:
            self._transfer = open_transfer_engine(self.base_url, self.config, lambda: self._latest, self.session)
        return self._transfer


def transfer_init_info(config: WeightSyncConfig, inference_world_size: int):
    """vLLM's trainer-side init info for the GPU transports: the trainer is rank 0 of a group of 1 + vLLM's workers."""
    if config.transport == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(
            master_address=config.nccl_master_address,
            master_port=config.nccl_master_port,
            world_size=1 + inference_world_size,
            rank=0,
        )
    if config.transport == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(rank=0)
    raise WeightSyncError(f"transport {config.transport!r} has no vLLM weight-transfer engine")


def open_transfer_engine(base_url: str, config: WeightSyncConfig, latest: Callable[[], Mapping[str, torch.Tensor]],
                         session: requests.Session):
    """Rendezvous with the server's weight-transfer engine (GPU transports; UNTESTED on a GPU).

    NCCL: the server's workers join the trainer's group during ``/init_weight_transfer_engine`` (run on a side
    thread by vLLM while the trainer opens rank 0). Every later ``send_weights()`` replays the named tensors that
    ``latest()`` gives then (the weights of that push) through ``/start_weight_update``, ``/update_weights``
    (concurrent with the broadcast), ``/finish_weight_update``.
    """
    try:
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource, materialize_full_tensor
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError as exc:
        raise WeightSyncError(
            f"transport {config.transport!r} needs vLLM in the trainer's environment: {pip_install('vllm-gpu')}"
        ) from exc
    response = session.get(f"{base_url}/get_world_size", timeout=config.request_timeout_s)
    if response.status_code == 404:
        raise WeightSyncError("vLLM has no /get_world_size: start it with inference.weight_sync = true")
    response.raise_for_status()
    init_info = transfer_init_info(config, int(response.json()["world_size"]))
    client = HTTPVLLMWeightSyncClient(base_url, timeout=config.request_timeout_s)

    class LatestWeights(WeightSource):
        """vLLM's source of the trainer's weights: each round, the named tensors of the latest push, in order."""

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in latest().items()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in latest().items():
                yield name, materialize_full_tensor(tensor)

    return WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=LatestWeights())


class _Clock:
    """``with clock("phase"):`` adds the block's wall time to the report under that phase."""

    def __init__(self, report: SyncReport) -> None:
        self.report = report
        self._phase = ""
        self._t0 = 0.0

    def __call__(self, phase: str) -> _Clock:
        self._phase = phase
        return self

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc_info) -> None:
        seconds = time.perf_counter() - self._t0
        self.report.seconds[self._phase] = self.report.seconds.get(self._phase, 0.0) + seconds
