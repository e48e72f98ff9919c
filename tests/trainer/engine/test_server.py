"""The vLLM server lit starts: configuration checks, clear errors with fake interpreters, no orphan process when its
parent dies (a stand-in server, ``_vllm_stand_in.py``, started by lit's own code), and (marked ``vllm``) the real
server: token ids and logprobs, a tool call round trip, and vLLM's engine core gone with a crashed trainer.

The real orphan test comes first in this file so that it runs before the session server starts (never two at once).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
import requests
from stand_in_vllm import STAND_IN, fake_model, fake_server, script

from lit_sdk.install import pip_install
from lit_sdk.processes import group_members
from lit_trainer.engine._shm import free_orphan_segments
from lit_trainer.engine.config import InferenceConfig, WeightSyncConfig
from lit_trainer.engine.launch import (
    InferenceError,
    PortBusyError,
    VLLMNotInstalledError,
    build_command,
    build_env,
    compile_cache_dir,
    link_compile_cache,
    pick_port,
    resolve_device,
    vllm_python,
)
from lit_trainer.engine.owned_folders import claim_folder, release_folder, remove_abandoned
from lit_trainer.engine.served_model import TOOL_TEMPLATE, chat_template_for, prune_views, untied_view
from lit_trainer.engine.server import PRIVATE_PREFIX, InferenceServer, ServerDiedError, StartupTimeoutError

HARNESS = textwrap.dedent(
    """
    import json, signal, sys, time
    from lit_trainer.engine.config import InferenceConfig
    from lit_trainer.engine.server import InferenceServer

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if started in the background
    with InferenceServer(InferenceConfig(**json.loads(sys.argv[1]))) as server:
        print(json.dumps({"pid": server.process.pid, "private_dir": str(server._private_dir)}), flush=True)
        time.sleep(3600)
    """
)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_core_dies_with_a_crashed_trainer(prepared_model: Path, tmp_path: Path, short_temp: Path):
    """The parent-death signal reaches only vLLM's API server; whatever it started goes only because vLLM stops it
    on SIGTERM. The stand-in below assumes that, and a vLLM upgrade could change it: this checks it on the real one
    (on CPU one process since launch.ONE_PROCESS, with its own helpers such as torch's compile workers)."""
    config = {"model": str(prepared_model), "log_dir": str(tmp_path), "cpu_kv_cache_gb": 1}
    _kill_the_parent_and_find_no_orphan(config, "SIGKILL", tmp_path, short_temp, sockets=True)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT"])
def test_server_dies_with_its_parent(how: str, tmp_path: Path, short_temp: Path):
    """SIGKILL: the trainer crashes (no atexit runs; the kernel's parent-death signal must do it). SIGINT: Ctrl-C.
    The server is the stand-in for vLLM, run by lit's start-up code through a fake interpreter."""
    python = fake_server(tmp_path, f'exec {sys.executable} {STAND_IN} "$@"')
    config = {"model": str(fake_model(tmp_path / "m")), "python": str(python), "log_dir": str(tmp_path),
              "startup_timeout_s": 60}  # fmt: skip
    _kill_the_parent_and_find_no_orphan(config, how, tmp_path, short_temp)


def _kill_the_parent_and_find_no_orphan(config: dict, how: str, tmp_path: Path, temp: Path,
                                        sockets: bool = False) -> None:
    """Start an ``InferenceServer(InferenceConfig(**config))`` in a harness process (the trainer), send the harness
    the signal ``how``, and check that no process of the server's group outlives it by a minute, and that the
    server's private folder (with vLLM's sockets in it, when ``sockets``) goes: at once on SIGINT, and on SIGKILL
    at the next launch's sweep (its owner is gone). ``temp``: the harness's temporary directory."""
    # the compile cache of this machine's other vLLM starts (torch's default, under /tmp), not a cold one in ``temp``
    inductor = str(compile_cache_dir())
    harness = subprocess.Popen([sys.executable, "-c", HARNESS, json.dumps(config)], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "TMPDIR": str(temp), "TORCHINDUCTOR_CACHE_DIR": inductor})
    pgid = None
    try:
        line = harness.stdout.readline()
        assert line, f"the harness exited ({harness.wait()}) before the server was up; logs in {tmp_path}"
        started = json.loads(line)
        pgid, private_dir = started["pid"], Path(started["private_dir"])
        assert len(group_members(pgid)) >= 1, "expected the server's process group"
        assert private_dir.parent == temp and private_dir.name.startswith(PRIVATE_PREFIX)
        assert stat.S_IMODE(private_dir.stat().st_mode) == 0o700
        if sockets:  # vLLM's sockets and file store, none of them in the temporary directory itself
            inside = list(private_dir.iterdir())
            assert [p for p in inside if p.is_socket()] and [p for p in inside if p.name.startswith("vllm_dist_")], \
                inside
        assert _left_in(temp) == [private_dir.name]
        os.kill(harness.pid, getattr(signal, how))
        harness.wait(timeout=60)
        deadline = time.monotonic() + 60
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert group_members(pgid) == [], f"orphans after {how} of the parent: {group_members(pgid)}"
        if how == "SIGKILL":  # no clean-up ran: the folder stays until a sweep finds its owner gone
            assert private_dir.is_dir()
            assert remove_abandoned(temp, PRIVATE_PREFIX) > 0
        assert _left_in(temp) == []
    finally:
        harness.kill()
        if pgid is not None and group_members(pgid):  # a failed run leaves no orphan behind either
            os.killpg(pgid, signal.SIGKILL)


def test_non_loopback_host_needs_an_api_key():
    with pytest.raises(ValueError, match="inference.api_key"):
        InferenceConfig(host="0.0.0.0")
    assert InferenceConfig(host="0.0.0.0", api_key="k").api_key == "k"
    assert InferenceConfig(host="::1").api_key is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"port": 70000}, "inference.port"),
        ({"device": "tpu"}, "inference.device"),
        ({"max_model_len": 0}, "inference.max_model_len"),
        ({"cpu_kv_cache_gb": 0}, "inference.cpu_kv_cache_gb"),
        ({"gpu_memory_utilization": 1.5}, "inference.gpu_memory_utilization"),
        ({"device": "cpu", "weight_transfer_backend": "nccl"}, "inference.weight_transfer_backend"),
        ({"startup_timeout_s": 0}, "inference.startup_timeout_s"),
    ],
)
def test_inference_config_names_the_bad_field(kwargs: dict, field: str):
    with pytest.raises(ValueError, match=field):
        InferenceConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mode": "delta"}, "weight_sync.mode"),
        ({"transport": "rdma"}, "weight_sync.transport"),
        ({"in_flight": "drop"}, "weight_sync.in_flight"),
        ({"mode": "lora", "transport": "nccl"}, "weight_sync.mode"),
        ({"logprob_tolerance": 0}, "weight_sync.logprob_tolerance"),
    ],
)
def test_weight_sync_config_names_the_bad_field(kwargs: dict, field: str):
    with pytest.raises(ValueError, match=field):
        WeightSyncConfig(**kwargs)


def test_busy_port_is_refused_with_the_setting_to_change():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortBusyError, match="inference.port"):
            pick_port(InferenceConfig(port=port))
    assert pick_port(InferenceConfig(port=0)) > 0


def test_api_key_goes_through_the_environment_only(tmp_path: Path):
    config = InferenceConfig(host="0.0.0.0", api_key="secret-key", device="cpu")
    cmd = build_command(config, fake_model(tmp_path), 8000, "python")
    assert "secret-key" not in " ".join(cmd)
    assert build_env(config, base={})["VLLM_API_KEY"] == "secret-key"
    # A key in the trainer's own environment must not leak into a server that was configured without one.
    assert "VLLM_API_KEY" not in build_env(InferenceConfig(device="cpu"), base={"VLLM_API_KEY": "stray"})


def test_vllm_keeps_its_temporary_files_in_the_servers_private_folder(tmp_path: Path):
    """Its sockets and its executor's file store (vLLM leaves them in the temporary directory at every start), but
    not torch's compile cache, which later starts load; the sockets stay in the trainer's temporary directory when
    the folder is too deep for a socket's path (107 bytes). The trainer's own settings of either win."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    short = Path(tempfile.gettempdir()) / "lit-vllm-x"  # pytest's tmp_path is too deep for a socket on some hosts
    env = build_env(InferenceConfig(device="cpu"), base={"TMPDIR": "/elsewhere"}, private_dir=short)
    assert env["TMPDIR"] == env["VLLM_RPC_BASE_PATH"] == env["PYTHONPATH"] == str(short)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir()  # torch's default in the trainer's process
    deep = Path(tempfile.gettempdir()) / ("d" * 80)
    env = build_env(InferenceConfig(device="cpu"), base={}, private_dir=deep)
    assert env["TMPDIR"] == str(deep) and env["VLLM_RPC_BASE_PATH"] == tempfile.gettempdir()
    theirs = {"VLLM_RPC_BASE_PATH": "/run/x", "TORCHINDUCTOR_CACHE_DIR": "/cache/y"}
    env = build_env(InferenceConfig(device="cpu"), base=theirs, private_dir=tmp_path)
    assert {key: env[key] for key in theirs} == theirs


def test_the_private_folder_links_to_the_compile_cache_and_goes_without_it(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    """Torch puts its precompiled headers under the temporary directory whatever TORCHINDUCTOR_CACHE_DIR says: the
    server's folder links there, so they outlive the server (each start compiled them again without the link)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this process's temporary directory
    folder, fd = claim_folder(tmp_path, PRIVATE_PREFIX)
    link_compile_cache(folder)
    link = folder / compile_cache_dir().name
    assert compile_cache_dir().parent == tmp_path and link.resolve() == compile_cache_dir()
    (link / "precompiled_headers").mkdir()  # as torch does, through the link
    release_folder(folder, fd)
    assert not folder.exists() and (compile_cache_dir() / "precompiled_headers").is_dir()


def test_cpu_environment_binds_threads_and_enables_weight_sync():
    env = build_env(InferenceConfig(device="cpu", cpu_threads_bind="0-3", cpu_kv_cache_gb=3), base={})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    assert build_env(InferenceConfig(device="cpu", enable_lora=True), base={})["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    assert "VLLM_CPU_KVCACHE_SPACE" not in build_env(InferenceConfig(device="cuda"), base={})


def test_each_of_several_cpu_servers_runs_on_its_share_of_the_cores(tmp_path: Path):
    """The whole server process on its cores (placement.server_cores), through lit's own start-up code (the
    stand-in for vLLM): its API server and engine threads too, not only vLLM's OpenMP threads."""
    mine = sorted(os.sched_getaffinity(0))
    python = fake_server(tmp_path, f'exec {sys.executable} {STAND_IN} "$@"')
    config = InferenceConfig(model=str(fake_model(tmp_path / "m")), python=str(python), log_dir=str(tmp_path),
                             device="cpu", servers=len(mine), startup_timeout_s=60)
    servers = [InferenceServer(config, index=i).launch() for i in range(len(mine))]
    try:
        for server in servers:
            server.wait_ready()
        assert [sorted(os.sched_getaffinity(s.process.pid)) for s in servers] == [[core] for core in mine]
    finally:
        for server in servers:
            server.stop()
    one = InferenceServer(replace(config, servers=1)).start()
    try:
        assert sorted(os.sched_getaffinity(one.process.pid)) == mine
    finally:
        one.stop()


def test_wait_ready_does_what_it_is_given_between_its_checks(tmp_path: Path):
    """``meanwhile(0.5)`` instead of each half-second sleep while the server loads (the trainer answers its workers'
    hellos then: services.py), until ``/health`` answers."""
    python = fake_server(tmp_path, f'sleep 1.5; exec {sys.executable} {STAND_IN} "$@"')
    config = InferenceConfig(model=str(fake_model(tmp_path / "m")), python=str(python), log_dir=str(tmp_path),
                             startup_timeout_s=60)
    asked: list[float] = []
    server = InferenceServer(config).launch()
    try:
        server.wait_ready(meanwhile=lambda seconds: (asked.append(seconds), time.sleep(seconds)))
        assert len(asked) >= 2 and set(asked) == {0.5} and server.is_healthy()
    finally:
        server.stop()


def test_a_cpu_server_is_one_process():
    """launch.ONE_PROCESS: the engine in the API server's process and the model in the engine's (measured there:
    a start 20 s shorter and more tokens/s); a value in the trainer's environment wins; tensor parallelism and CUDA
    keep vLLM's own processes."""
    model = Path("/models/m")
    assert build_env(InferenceConfig(device="cpu"), base={})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert build_env(InferenceConfig(device="cpu"), base={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
                     )["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    cmd = build_command(InferenceConfig(device="cpu"), model, 8000, "python")
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "uni"
    for config in (InferenceConfig(device="cpu", tensor_parallel_size=2), InferenceConfig(device="cuda")):
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in build_env(config, base={})
        assert "--distributed-executor-backend" not in build_command(config, model, 8000, "python")


def test_cpu_servers_cache_prompts_in_small_blocks():
    """inference.cpu_block_size: 32 on CPU unless 0 (vLLM's 128) or --block-size in extra_args (the last wins in
    vLLM's parser); never on CUDA; 16 (which vLLM's CPU kernels refuse at start) is refused in the config."""
    model = Path("/models/m")

    def block_sizes(config: InferenceConfig) -> list[str]:
        cmd = build_command(config, model, 8000, "python")
        return [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--block-size"]

    assert block_sizes(InferenceConfig(device="cpu")) == ["32"]
    assert block_sizes(InferenceConfig(device="cpu", cpu_block_size=0)) == []
    assert block_sizes(InferenceConfig(device="cpu", extra_args=["--block-size", "64"])) == ["32", "64"]
    assert block_sizes(InferenceConfig(device="cuda")) == []
    for bad in (16, -32):
        with pytest.raises(ValueError, match="inference.cpu_block_size must be 0"):
            InferenceConfig(cpu_block_size=bad)


def test_cpu_servers_use_the_compile_cache_that_loads():
    assert build_env(InferenceConfig(device="cpu"), base={})["VLLM_USE_AOT_COMPILE"] == "0"
    assert build_env(InferenceConfig(device="cpu"), base={"VLLM_USE_AOT_COMPILE": "1"})["VLLM_USE_AOT_COMPILE"] == "1"
    assert "VLLM_USE_AOT_COMPILE" not in build_env(InferenceConfig(device="cuda"), base={})


def test_tool_template_only_for_models_without_one(tmp_path: Path):
    plain = fake_model(tmp_path / "plain", template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tooled = fake_model(tmp_path / "tooled", template="{% if tools %}{{ tools | tojson }}{% endif %}")
    assert chat_template_for(InferenceConfig(), plain) == TOOL_TEMPLATE
    assert chat_template_for(InferenceConfig(), tooled) is None
    assert chat_template_for(InferenceConfig(chat_template="model"), plain) is None
    cmd = build_command(InferenceConfig(device="cpu"), plain, 8000, "python")
    assert cmd[cmd.index("--chat-template") + 1] == str(TOOL_TEMPLATE)
    assert cmd[cmd.index("--tool-call-parser") + 1] == "hermes"
    assert "--enable-auto-tool-choice" in cmd
    assert "--enable-auto-tool-choice" not in build_command(InferenceConfig(tool_call_parser=""), plain, 1, "p")


def test_tied_model_is_served_untied_with_its_own_head(tmp_path: Path):
    import torch
    from safetensors.torch import load_file, save_file

    model = fake_model(tmp_path / "tied")
    (model / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    embed = torch.randn(8, 4)
    save_file(
        {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(4)},
        str(model / "model.safetensors"),
    )
    view = untied_view(model, tmp_path / "views")
    assert (view / "config.json").resolve() == (model / "config.json").resolve()
    torch.testing.assert_close(load_file(str(view / "lm_head.safetensors"))["lm_head.weight"], embed)
    assert untied_view(model, tmp_path / "views") == view  # made once
    cmd = build_command(InferenceConfig(device="cpu"), model, 8000, "python", view)
    assert cmd[cmd.index("--model") + 1] == str(view)
    assert json.loads(cmd[cmd.index("--hf-overrides") + 1]) == {"tie_word_embeddings": False}
    (model / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    assert untied_view(model, tmp_path / "other-views") is None


def test_views_of_models_that_are_gone_are_deleted_when_a_view_is_made(tmp_path: Path):
    """Each view copies its model's embedding; a run resumed from checkpoint after checkpoint (or a test's temporary
    model) would leave one behind per model folder, forever, without this."""

    import torch
    from safetensors.torch import save_file

    def tied(name: str) -> Path:
        model = fake_model(tmp_path / name)
        (model / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
        save_file({"model.embed_tokens.weight": torch.randn(8, 4)}, str(model / "model.safetensors"))
        return model

    views = tmp_path / "views"
    old, kept = untied_view(tied("step-5"), views), untied_view(tied("step-10"), views)
    half_made = views / "0123456789abcdef"  # another process between mkdir and its first link: not touched
    half_made.mkdir()
    shutil.rmtree(tmp_path / "step-5")  # the run pruned that checkpoint
    assert old.is_dir()
    new = untied_view(tied("step-15"), views)
    assert sorted(views.iterdir()) == sorted([kept, new, half_made])
    assert (kept / "lm_head.safetensors").is_file()
    assert prune_views(views) == [] and prune_views(tmp_path / "no-views-yet") == []


def test_vllm_runs_from_its_own_environment_inside_lits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``inference.python`` when set; else ``<sys.prefix>/vllm/bin/python`` (run.sh's layout) when it exists; else
    this interpreter. ``device = "auto"`` asks vLLM's environment, not this one, whether it has vllm-cpu."""
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert vllm_python(InferenceConfig()) == sys.executable
    (tmp_path / "vllm" / "bin").mkdir(parents=True)
    # a vLLM environment with vllm-cpu: the probe is `-c "import importlib.metadata ...distribution('vllm-cpu')"`
    has_vllm_cpu = '[ "$1" = "-c" ] && case "$2" in *vllm-cpu*) exit 0;; esac\nexit 1'
    own = script(tmp_path / "vllm" / "bin" / "python", has_vllm_cpu)
    assert vllm_python(InferenceConfig()) == str(own)
    assert vllm_python(InferenceConfig(python="/opt/elsewhere/python")) == "/opt/elsewhere/python"
    assert build_command(InferenceConfig(), tmp_path, 8000, str(own))[-2:] == ["--distributed-executor-backend", "uni"]
    assert resolve_device(InferenceConfig()) == "cpu"
    cuda = script(tmp_path / "cuda-python", "exit 1")  # an environment whose vLLM is not vllm-cpu
    assert resolve_device(InferenceConfig(python=str(cuda))) == "cuda"
    assert resolve_device(InferenceConfig(python=str(tmp_path / "missing"))) == "cuda"  # launch says it is missing


def test_missing_vllm_names_the_extra(tmp_path: Path):
    # The same interpreter without site-packages: it runs, but cannot import vllm.
    python = script(tmp_path / "python-without-vllm", f'exec {sys.executable} -S "$@"')
    config = InferenceConfig(model=str(fake_model(tmp_path / "m")), python=str(python), log_dir=str(tmp_path))
    with pytest.raises(VLLMNotInstalledError, match=re.escape(pip_install("vllm"))):
        InferenceServer(config).start()


def test_server_that_runs_out_of_memory_says_so_with_its_log(tmp_path: Path):
    python = fake_server(tmp_path, 'echo "loading..."; echo "torch.OutOfMemoryError: out of memory" >&2; exit 1')
    config = InferenceConfig(model=str(fake_model(tmp_path / "m")), python=str(python), log_dir=str(tmp_path))
    with pytest.raises(ServerDiedError, match="cpu_kv_cache_gb") as info:
        InferenceServer(config).start()
    assert "OutOfMemoryError" in str(info.value)  # the tail of the log is in the message


def test_a_gpu_with_too_little_free_for_vllms_share_names_the_setting(tmp_path: Path):
    """vLLM on a GPU stops at start when the card has less free than ``gpu_memory_utilization`` asks (the trainer's
    policy, loaded first, on the same GPU). No GPU here: a stand-in server prints vLLM's own words (vLLM 0.32's
    ``request_memory``) and exits, as the real one does."""
    words = ("ValueError: Free memory on device cuda:0 (60.1/139.8 GiB) on startup is less than desired GPU memory "
             "utilization (0.5, 69.9 GiB). Decrease GPU memory utilization or reduce GPU memory used by other "
             "processes.")
    python = fake_server(tmp_path, f'echo "{words}" >&2; exit 1')
    config = InferenceConfig(model=str(fake_model(tmp_path / "m")), python=str(python), log_dir=str(tmp_path))
    with pytest.raises(ServerDiedError) as info:
        InferenceServer(config).start()
    assert ("vLLM asks for inference.gpu_memory_utilization = 0.5 of the GPU, and less is free there (the trainer's "
            "policy, loaded first, may share that GPU): lower inference.gpu_memory_utilization, or make the policy "
            'smaller (policy.lora_rank, policy.precision = "bf16", policy.shard)') in str(info.value)
    assert words in str(info.value)  # and the log's tail


def test_a_max_model_len_longer_than_the_model_names_the_setting(tmp_path: Path):
    """What lit's own check leaves to vLLM (a length in the tokenizer's config, say): vLLM 0.32's words, printed
    by a stand-in server."""
    words = ("ValueError: User-specified max_model_len (2048) is greater than the derived max_model_len "
             "(max_position_embeddings=1024 or model_max_length=None in model's config.json).")
    python = fake_server(tmp_path, f'echo "{words}" >&2; exit 1')
    config = InferenceConfig(model=str(fake_model(tmp_path / "m")), python=str(python), log_dir=str(tmp_path))
    with pytest.raises(ServerDiedError, match=re.escape(
            "inference.max_model_len = 2048 is longer than the model was made for (the log names its length): "
            "lower inference.max_model_len")):
        InferenceServer(config).start()


def test_startup_timeout_names_the_setting_and_kills_the_server(tmp_path: Path):
    python = fake_server(tmp_path, "exec sleep 600")
    config = InferenceConfig(
        model=str(fake_model(tmp_path / "m")),
        python=str(python),
        log_dir=str(tmp_path),
        startup_timeout_s=1.0,
    )
    server = InferenceServer(config)
    with pytest.raises(StartupTimeoutError, match="inference.startup_timeout_s"):
        server.start()
    assert server.process is None
    assert "sleep 600" not in subprocess.run(["ps", "-eo", "args"], check=True, capture_output=True, text=True).stdout


def test_a_stopped_server_is_a_dead_one_to_a_check(tmp_path: Path):
    """Hole: while the loop started a dead vLLM again (it stops the old server first), the rollouts' thread checked
    the stopped server and got 'never started', an error the rollouts do not restart on: the run stopped although
    the restart worked. A stopped server is a dead one now: the rollouts wait for the restart and run again."""
    server = InferenceServer(InferenceConfig(model=str(fake_model(tmp_path / "m")), log_dir=str(tmp_path)))
    with pytest.raises(InferenceError, match="never started") as never:
        server.check_alive()
    assert not isinstance(never.value, ServerDiedError)
    server.process, server._launched_at = subprocess.Popen(["sleep", "600"], start_new_session=True), time.time()
    server.check_alive()
    server.stop()
    with pytest.raises(ServerDiedError, match="was stopped"):
        server.check_alive()


def test_exited_waits_a_moment_for_a_killed_server(tmp_path: Path):
    server = InferenceServer(InferenceConfig(model=str(fake_model(tmp_path / "m")), log_dir=str(tmp_path)))
    assert not server.exited(within_s=1.0)  # never started
    server.process = subprocess.Popen(["sleep", "600"])
    try:
        assert not server.exited(within_s=0.2)
        server.process.kill()
        assert server.exited(within_s=5.0)
    finally:
        server.process.kill()
        server.process.wait()


@pytest.mark.vllm
def test_completion_returns_token_ids_and_logprobs(vllm_server: InferenceServer):
    body = {"model": vllm_server.model_name, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0, "logprobs": 0, "return_token_ids": True}  # fmt: skip
    choice = requests.post(f"{vllm_server.openai_url}/completions", json=body, timeout=120).json()["choices"][0]
    assert len(choice["prompt_token_ids"]) == 5
    assert len(choice["token_ids"]) == 8
    logprobs = choice["logprobs"]["token_logprobs"]
    assert len(logprobs) == 8 and all(lp <= 0 for lp in logprobs)
    assert "Paris" in choice["text"]


@pytest.mark.vllm
def test_chat_returns_token_ids_and_logprobs(vllm_server: InferenceServer):
    body = {"model": vllm_server.model_name, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6,
            "temperature": 0, "logprobs": True, "return_token_ids": True}  # fmt: skip
    answer = requests.post(f"{vllm_server.openai_url}/chat/completions", json=body, timeout=120).json()
    choice = answer["choices"][0]
    assert answer["prompt_token_ids"][:1] == [1]  # <|im_start|>
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) > 0


ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
}


@pytest.mark.vllm
def test_tool_call_round_trips(vllm_server: InferenceServer):
    """The template tells the model to answer <tool_call>{...}</tool_call>; the hermes parser turns that into
    ``tool_calls``; the call and its result render back into the next prompt. The 135M model rarely calls tools
    on its own, so its output is constrained to the call (``auto`` tool choice, parser path)."""
    url = f"{vllm_server.openai_url}/chat/completions"
    messages = [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]
    forced = r'<tool_call>\n\{"name": "add", "arguments": \{"a": 2, "b": 3\}\}\n</tool_call>'
    body = {"model": vllm_server.model_name, "messages": messages, "tools": [ADD_TOOL], "tool_choice": "auto",
            "temperature": 0, "max_tokens": 60, "structured_outputs": {"regex": forced}}  # fmt: skip
    choice = requests.post(url, json=body, timeout=120).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}

    messages += [choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
    body = {"model": vllm_server.model_name, "messages": messages, "tools": [ADD_TOOL], "max_tokens": 8,
            "temperature": 0, "return_token_ids": True}  # fmt: skip
    answer = requests.post(url, json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    tokenize = {"model": vllm_server.model_name, "tokens": answer.json()["prompt_token_ids"]}
    prompt = requests.post(f"{vllm_server.base_url}/detokenize", json=tokenize, timeout=60).json()["prompt"]
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in prompt
    assert "<tool_response>\n5\n</tool_response>" in prompt
    assert '"name": "add"' in prompt.split("<|im_end|>")[0]  # the tool is listed in the system turn


def _left_in(temp: Path) -> list[str]:
    """What is in the temporary directory ``temp`` beside torch's compile cache (``launch.link_compile_cache``)."""
    return sorted(p.name for p in temp.iterdir() if p.name != compile_cache_dir().name)


def test_shared_memory_a_killed_vllm_left_is_freed_and_nothing_else(tmp_path: Path):
    """Segments as vLLM's message queues make them (``psm_*``): one no process maps (its vLLM was killed), one this
    process still maps, one older than the server's launch, and a file of another name. Only the first goes."""
    import mmap

    since = time.time() - 1.0  # a file's time comes from the kernel's coarse clock, which may lag time.time()
    for name in ("psm_orphan", "psm_live", "psm_old", "lit-weights-x"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
    os.utime(tmp_path / "psm_old", (since - 60, since - 60))
    with (tmp_path / "psm_live").open("r+b") as f, mmap.mmap(f.fileno(), 4096):
        freed = free_orphan_segments(since, tmp_path)
        assert freed == [("psm_orphan", 4096)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lit-weights-x", "psm_live", "psm_old"]
    assert free_orphan_segments(since, tmp_path) == [("psm_live", 4096)]  # unmapped now
