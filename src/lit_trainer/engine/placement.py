"""Where each of the ``InferenceConfig.servers`` vLLM servers runs: its share of this process's CPU cores (CPU), or
its own block of GPUs (CUDA). Pure functions of the config and of what this process may use, so that every
placement is checked by hand in the tests.

- CPU, ``cpu_threads_bind = "all"``: the cores this process may run on are cut into ``servers`` contiguous parts,
  server i runs on part i (``server_cores``: the whole process, not only its OpenMP threads) and binds its OpenMP
  threads there (``VLLM_CPU_OMP_THREADS_BIND``), the part itself cut into ``tensor_parallel_size`` groups joined by
  ``|`` (vLLM's syntax: one group of cores per tensor-parallel rank).
- CUDA, several servers: server i sees the i-th block of ``tensor_parallel_size`` GPUs among those visible to this
  process (``CUDA_VISIBLE_DEVICES``); with ``layout = "dedicated"``, the i-th block of ``gpus``, past the trainer
  processes' GPUs. One server is left to vLLM's own choice (the first GPUs), as before. The
  CUDA path has NOT run on a GPU (none was available when it was written): it follows vLLM's documented
  ``CUDA_VISIBLE_DEVICES`` and ``--tensor-parallel-size``, and only the values it computes are tested.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from lit_trainer.engine.config import InferenceConfig


class PlacementError(ValueError):
    """The machine has too few cores or GPUs for the servers asked for; the message names the settings."""


def cpu_list(cpus: Collection[int]) -> str:
    """Compress core ids into vLLM's range syntax: {0, 1, 2, 5} -> '0-2,5'."""
    ids, ranges = sorted(cpus), []
    start = prev = ids[0]
    for cpu in [*ids[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        ranges.append(f"{start}-{prev}" if prev > start else f"{start}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(ranges)


def split_cores(cores: Collection[int], parts: int) -> list[list[int]]:
    """``cores`` in order, cut into ``parts`` contiguous runs as equal as can be (the first ones one core longer
    when they do not divide evenly). Raise ``PlacementError`` when there are fewer cores than parts."""
    ids = sorted(cores)
    if parts > len(ids):
        raise PlacementError(f"{parts} parts of {len(ids)} cores")
    size, extra = divmod(len(ids), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(ids[start:end])
        start = end
    return out


def server_cores(config: InferenceConfig, index: int, cores: Collection[int]) -> list[int] | None:
    """The cores the whole process of CPU server ``index`` may run on (``start_child``'s ``cpus``): its share of
    ``cores`` (the cores this process may use) with ``cpu_threads_bind = "all"``; None with a core list of the
    user's, which binds vLLM's OpenMP threads only, as vLLM does. Binding the threads alone is not enough for
    several servers: each one's other threads (its API server, its engine loop) ran on the other's cores, and two
    servers of one core each, generating together, took 23 s for what either did alone in 1.6 s (2.2 s with each
    process on its core; 2026-11-29, 2 cores)."""
    if config.cpu_threads_bind != "all":
        return None  # one server only (InferenceConfig checks it)
    try:
        return split_cores(cores, config.servers)[index]
    except PlacementError:
        raise PlacementError(f"inference.servers = {config.servers} needs at least one CPU core each, and this "
                             f"process may use {len(cores)} ({cpu_list(cores)}): lower inference.servers") from None


def threads_bind(config: InferenceConfig, index: int, cores: Collection[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` of server ``index``: ``cpu_threads_bind`` when it names cores, else its share
    of ``cores`` (``server_cores``), one ``|``-separated group per tensor-parallel rank."""
    share = server_cores(config, index, cores)
    if share is None:
        return config.cpu_threads_bind
    try:
        return "|".join(cpu_list(group) for group in split_cores(share, config.tensor_parallel_size))
    except PlacementError:
        raise PlacementError(f"inference.tensor_parallel_size = {config.tensor_parallel_size} needs a CPU core per "
                             f"rank, and server {index} of inference.servers = {config.servers} has "
                             f"{len(share)} ({cpu_list(share)}): lower one of them") from None


def visible_gpus(env: Mapping[str, str], device_count: Callable[[], int]) -> list[str]:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` (indexes or UUIDs) when set, else 0 to
    ``device_count() - 1``."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    return [str(i) for i in range(device_count())]


def gpu_block(config: InferenceConfig, index: int, visible: Sequence[str], trainer_gpus: int = 1) -> str:
    """``CUDA_VISIBLE_DEVICES`` of server ``index``: the ``index``-th block of ``tensor_parallel_size`` GPUs
    among ``visible``; with ``layout = "dedicated"``, of ``gpus``, none of which may be among the first
    ``trainer_gpus`` (the trainer processes' of this node: local rank k uses GPU k)."""
    tp, needed = config.tensor_parallel_size, config.servers * config.tensor_parallel_size
    if config.layout == "dedicated":
        shared = sorted(g for g in config.gpus if g < trainer_gpus)
        if shared:
            raise PlacementError(f"inference.gpus {shared} are also trainer GPUs ({trainer_gpus} trainer processes on "
                                 f"this node use GPUs 0-{trainer_gpus - 1}): give vLLM GPUs past them, or start "
                                 "fewer trainer processes")
        missing = sorted(g for g in config.gpus if g >= len(visible))
        if missing:
            raise PlacementError(f"inference.gpus {missing} are not among the {len(visible)} visible GPUs "
                                 f"({','.join(visible) or 'none'}, CUDA_VISIBLE_DEVICES)")
        return ",".join(visible[g] for g in config.gpus[index * tp:(index + 1) * tp])
    if len(visible) < needed:
        raise PlacementError(f"inference.servers = {config.servers} x inference.tensor_parallel_size = {tp} needs "
                             f"{needed} GPUs, and {len(visible)} are visible ({','.join(visible) or 'none'}, "
                             "CUDA_VISIBLE_DEVICES): lower one of them")
    return ",".join(visible[index * tp:(index + 1) * tp])


def placement_env(config: InferenceConfig, index: int, device: str, env: Mapping[str, str],
                  cores: Collection[int], device_count: Callable[[], int]) -> dict[str, str]:
    """The environment variables that place server ``index`` on ``device`` (``cpu`` or ``cuda``): its cores, or,
    with several servers, its GPUs. ``env``: this process's environment; ``cores``: the cores it may use."""
    if device == "cpu":
        return {"VLLM_CPU_OMP_THREADS_BIND": threads_bind(config, index, cores)}
    if config.servers > 1 or config.layout == "dedicated":
        trainer_gpus = int(env.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's and accelerate's processes on this node
        return {"CUDA_VISIBLE_DEVICES": gpu_block(config, index, visible_gpus(env, device_count), trainer_gpus)}
    return {}
