"""Where each of several vLLM servers runs (``engine/placement.py``), what each one's command line and environment
hold, and the ``InferenceConfig`` checks of ``servers`` and ``tensor_parallel_size``. Every placement is computed
by hand here: the CUDA blocks have never run on a GPU (none was available), and the CPU split runs for real in the
``lora_kl`` run of tests/e2e/test_train_options.py (two servers on this machine's cores)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lit_trainer.engine import launch
from lit_trainer.engine.config import InferenceConfig
from lit_trainer.engine.launch import build_command, build_env, server_ports
from lit_trainer.engine.placement import (
    PlacementError,
    cpu_list,
    gpu_block,
    placement_env,
    server_cores,
    split_cores,
    threads_bind,
    visible_gpus,
)


def no_gpu_count() -> int:
    raise AssertionError("CUDA_VISIBLE_DEVICES was set: torch need not count the GPUs")


def test_cpu_list_compresses_ranges():
    assert cpu_list({0, 1}) == "0-1"
    assert cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert cpu_list({3}) == "3"


def test_cores_are_split_into_contiguous_parts_the_first_ones_longer():
    assert split_cores({0, 1}, 2) == [[0], [1]]
    assert split_cores(range(8), 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_cores(range(7), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_cores({9, 2, 4, 3, 8}, 2) == [[2, 3, 4], [8, 9]]  # in core order, gaps kept
    assert split_cores({5}, 1) == [[5]]
    with pytest.raises(PlacementError):
        split_cores({0, 1}, 3)


def test_each_cpu_server_binds_its_share_of_the_cores():
    two = InferenceConfig(device="cpu", servers=2)
    assert [threads_bind(two, i, {0, 1}) for i in (0, 1)] == ["0", "1"]
    assert [threads_bind(two, i, range(8)) for i in (0, 1)] == ["0-3", "4-7"]
    three = InferenceConfig(device="cpu", servers=3)
    assert [threads_bind(three, i, {0, 1, 2, 3, 8, 9, 10}) for i in range(3)] == ["0-2", "3,8", "9-10"]
    assert threads_bind(InferenceConfig(device="cpu"), 0, {0, 1, 2, 3}) == "0-3"  # one server: every core
    assert threads_bind(InferenceConfig(device="cpu", cpu_threads_bind="4-5"), 0, {0, 1}) == "4-5"


def test_each_cpu_server_process_runs_on_its_share_unless_the_user_binds_the_threads():
    """The whole process (start_child's cpus), not only its OpenMP threads: two servers of one core each were 10x
    slower generating together than either alone while their other threads ran on each other's core."""
    two = InferenceConfig(device="cpu", servers=2)
    assert [server_cores(two, i, {0, 1}) for i in (0, 1)] == [[0], [1]]
    assert [server_cores(two, i, {3, 4, 5, 9}) for i in (0, 1)] == [[3, 4], [5, 9]]
    assert server_cores(InferenceConfig(device="cpu"), 0, {0, 1, 2}) == [0, 1, 2]  # one server: every core
    assert server_cores(InferenceConfig(device="cpu", cpu_threads_bind="1"), 0, {0, 1}) is None  # vLLM's way
    with pytest.raises(PlacementError, match="inference.servers = 3 needs at least one CPU core each"):
        server_cores(InferenceConfig(device="cpu", servers=3), 2, {0, 1})


def test_cpu_tensor_parallel_ranks_get_a_group_of_cores_each():
    config = InferenceConfig(device="cpu", servers=2, tensor_parallel_size=2)
    assert [threads_bind(config, i, range(8)) for i in (0, 1)] == ["0-1|2-3", "4-5|6-7"]
    assert threads_bind(InferenceConfig(device="cpu", tensor_parallel_size=2), 0, range(5)) == "0-2|3-4"


def test_more_servers_or_ranks_than_cores_is_refused_naming_the_setting():
    with pytest.raises(PlacementError, match=r"inference.servers = 3 needs at least one CPU core each.*may use 2 "
                                             r"\(0-1\)"):
        threads_bind(InferenceConfig(device="cpu", servers=3), 0, {0, 1})
    with pytest.raises(PlacementError, match=r"inference.tensor_parallel_size = 2 .* server 1 of inference.servers "
                                             r"= 2 has 1 \(1\)"):
        threads_bind(InferenceConfig(device="cpu", servers=2, tensor_parallel_size=2), 1, {0, 1})


def test_visible_gpus_are_cuda_visible_devices_or_every_gpu():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3, 5"}, no_gpu_count) == ["2", "3", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a1,GPU-b2"}, no_gpu_count) == ["GPU-a1", "GPU-b2"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, no_gpu_count) == []
    assert visible_gpus({}, lambda: 4) == ["0", "1", "2", "3"]


def test_each_cuda_server_gets_its_own_block_of_gpus():
    one_each = InferenceConfig(device="cuda", servers=2)
    assert [gpu_block(one_each, i, ["0", "1", "2"]) for i in (0, 1)] == ["0", "1"]
    two_each = InferenceConfig(device="cuda", servers=2, tensor_parallel_size=2)
    assert [gpu_block(two_each, i, ["4", "5", "6", "7"]) for i in (0, 1)] == ["4,5", "6,7"]
    three = InferenceConfig(device="cuda", servers=3, tensor_parallel_size=2)
    assert [gpu_block(three, i, [str(g) for g in range(6)]) for i in range(3)] == ["0,1", "2,3", "4,5"]
    with pytest.raises(PlacementError, match=r"inference.servers = 2 x inference.tensor_parallel_size = 2 needs 4 "
                                             r"GPUs, and 3 are visible \(0,1,2"):
        gpu_block(two_each, 0, ["0", "1", "2"])


def test_placement_env_sets_cores_on_cpu_and_gpus_only_for_several_cuda_servers():
    env = {"CUDA_VISIBLE_DEVICES": "1,3"}
    assert placement_env(InferenceConfig(device="cpu", servers=2), 1, "cpu", env, {0, 1}, no_gpu_count) == {
        "VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert placement_env(InferenceConfig(device="cuda", servers=2), 1, "cuda", env, {0}, no_gpu_count) == {
        "CUDA_VISIBLE_DEVICES": "3"}
    # One CUDA server: vLLM picks its GPUs among the visible ones, as without lit.
    assert placement_env(InferenceConfig(device="cuda", tensor_parallel_size=2), 0, "cuda", {}, {0}, no_gpu_count) == {}


def test_build_env_places_server_index(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    config = InferenceConfig(device="cpu", servers=2)
    assert [build_env(config, base={}, index=i)["VLLM_CPU_OMP_THREADS_BIND"] for i in (0, 1)] == ["0-1", "2-3"]
    cuda = InferenceConfig(device="cuda", servers=2, tensor_parallel_size=2)
    base = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4"}
    assert [build_env(cuda, base=base, index=i)["CUDA_VISIBLE_DEVICES"] for i in (0, 1)] == ["0,1", "2,3"]
    monkeypatch.setattr(launch, "cuda_device_count", lambda: 1)
    with pytest.raises(PlacementError, match="needs 4 GPUs, and 1 are visible"):
        build_env(cuda, base={}, index=0)


def test_tensor_parallel_size_goes_to_vllm_once(tmp_path: Path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cmd = build_command(InferenceConfig(device="cuda", tensor_parallel_size=2), model, 8000, "python")
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2" and cmd.count("--tensor-parallel-size") == 1
    assert "--tensor-parallel-size" not in build_command(InferenceConfig(device="cpu"), model, 8000, "python")


def test_ports_of_several_servers(monkeypatch):
    assert server_ports(InferenceConfig(port=8100, servers=3)) == [8100, 8101, 8102]
    assert server_ports(InferenceConfig()) == [0]  # one server picks its own free port when it starts
    picks = iter([41000, 41000, 41001])  # the kernel may hand a released port out again
    monkeypatch.setattr(launch, "pick_port", lambda config: next(picks))
    assert server_ports(InferenceConfig(servers=2)) == [41000, 41001]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"servers": 0}, "inference.servers must be >= 1, got 0"),
        ({"tensor_parallel_size": 0}, "inference.tensor_parallel_size must be >= 1, got 0"),
        ({"extra_args": ["--tensor-parallel-size", "2"]}, "inference.extra_args may not set "
                                                          "--tensor-parallel-size"),
        ({"extra_args": ["-tp", "2"]}, "set inference.tensor_parallel_size"),
        ({"extra_args": ["--tensor-parallel-size=2"]}, "inference.extra_args"),
        ({"port": 65535, "servers": 2}, "inference.port 65535 \\+ inference.servers 2 runs past port 65535"),
        ({"device": "cpu", "servers": 2, "cpu_threads_bind": "0-1"}, "would bind all 2 servers "
                                                                     "\\(inference.servers\\) to the same cores"),
    ],
)
def test_inference_config_refuses_bad_parallel_settings(kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        InferenceConfig(**kwargs)


def test_good_parallel_settings_are_accepted():
    assert InferenceConfig(servers=4, tensor_parallel_size=2, extra_args=["--max-num-seqs", "8"]).servers == 4
    assert InferenceConfig(device="cuda", servers=2, cpu_threads_bind="0-1").servers == 2  # CPU binding unused


def test_a_dedicated_layout_puts_each_server_on_its_own_gpus_past_the_trainers():
    # 1 node x 8 GPUs: 4 trainer processes on GPUs 0-3, two vLLM servers of 2 GPUs each on 4-7
    config = InferenceConfig(device="cuda", layout="dedicated", servers=2, tensor_parallel_size=2, gpus=[4, 5, 6, 7])
    env = {"LOCAL_WORLD_SIZE": "4"}
    assert [placement_env(config, i, "cuda", env, {0}, lambda: 8) for i in (0, 1)] == [
        {"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    # indexes among the visible GPUs; one server is placed too (not left to vLLM's choice of the first)
    one = InferenceConfig(device="cuda", layout="dedicated", gpus=[1])
    assert placement_env(one, 0, "cuda", {"CUDA_VISIBLE_DEVICES": "3,5"}, {0}, no_gpu_count) == {
        "CUDA_VISIBLE_DEVICES": "5"}
    with pytest.raises(PlacementError, match=r"inference.gpus \[4, 5\] are also trainer GPUs \(6 trainer processes "
                                             r"on this node use GPUs 0-5\)"):
        placement_env(config, 0, "cuda", {"LOCAL_WORLD_SIZE": "6"}, {0}, lambda: 8)
    with pytest.raises(PlacementError, match=r"inference.gpus \[6, 7\] are not among the 6 visible GPUs"):
        placement_env(config, 0, "cuda", env, {0}, lambda: 6)


def test_a_colocated_server_sleeps_through_updates_and_gpu_layouts_are_refused_on_cpu(tmp_path: Path,
                                                                                       monkeypatch):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert "--enable-sleep-mode" in build_command(InferenceConfig(device="cuda", layout="colocated"), model, 1, "py")
    assert "--enable-sleep-mode" not in build_command(InferenceConfig(device="cuda"), model, 1, "py")
    monkeypatch.setattr(launch, "has_vllm_cpu", lambda python: True)  # device "auto" that turns out to be the CPU
    with pytest.raises(launch.InferenceError, match="layout = 'dedicated' places vLLM on GPUs, and vLLM here runs "
                                                    "on the CPU"):
        build_command(InferenceConfig(layout="dedicated", gpus=[1]), model, 1, "py")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"layout": "dedicated", "servers": 2, "gpus": [4, 5, 6]},
     r"needs inference.gpus: 2 different GPU indexes \(inference.servers = 2 x tensor_parallel_size = 1\), "
     r"got \[4, 5, 6\]"),
    ({"layout": "dedicated", "servers": 2, "gpus": [4, 4]}, "2 different GPU indexes"),
    ({"layout": "dedicated", "gpus": [-1]}, "1 different GPU indexes"),
    ({"gpus": [3]}, r"inference.gpus = \[3\] places vLLM with layout = 'dedicated' only"),
    ({"layout": "colocated", "device": "cpu"}, "places vLLM on GPUs; on CPU vLLM and the trainer share the cores"),
    ({"layout": "nearby"}, "inference.layout must be one of"),
])
def test_a_layout_whose_gpus_do_not_add_up_is_refused(kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        InferenceConfig(**kwargs)
