"""The update across processes: ``accelerate launch --num_processes N`` (or ``torchrun``) runs N trainer processes,
each holding the whole model (data parallel); here is how they share one optimizer step.

Every process builds the same micro-batches from the same transitions (the main process broadcasts them:
``broadcast``), takes its share of them by token budget (``assign``), and accumulates the gradients of its share's
loss terms. The loss terms are normalised by the whole step (``LossFn``), so the step's gradient is the *sum* of
the processes' gradients: one all-reduce of the gradients (``sum_gradients``) per optimizer step, then every
process clips and steps the same gradient, and the weights stay identical everywhere. That is what torch's
``DistributedDataParallel`` does with gradient accumulation (``no_sync`` until the last micro-batch), done on the
unwrapped model because lit's logprob path calls the model's submodules (learner/logprobs.py), which a DDP wrapper
would bypass, forcing the full-vocabulary path. Only the main process runs the services (vLLM, the collector, the
workers), syncs the weights into vLLM and writes checkpoints (loop.py). With ``policy.shard`` each process holds a
part of the decoder layers instead (learner/sharding.py), and every process joins the gathering of the weights and
the checkpoint.

Launch: ``torchrun --nproc_per_node N -m lit_trainer.cli train ...`` (CPU or GPU), or ``accelerate launch
--multi_gpu --num_processes N -m lit_trainer.cli train ...`` (GPUs; on CPU, accelerate's launcher starts one process
without MPI). Collectives go through ``torch.distributed`` on whatever backend accelerate started (gloo on CPU, NCCL
on GPUs).
With one process every function here is the identity.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

COLLECTIVE_TIMEOUT = timedelta(hours=6)
"""How long a process waits in a collective: the processes other than the main one wait in ``broadcast`` while it
runs a step's rollouts and validation, which on a slow agent take long. A process that dies makes the launcher
(accelerate, torchrun) stop the others at once, whatever this says."""

BUCKET_ELEMENTS = 1 << 25
"""Gradients are all-reduced in flat buckets of at most this many elements (128 MiB of fp32): one collective per
bucket instead of one per tensor, without a second copy of a large model's gradients."""


def is_launch_main() -> bool:
    """Whether this is the main process of its launch (``RANK`` 0 under torchrun or ``accelerate launch``; a plain
    ``lit train`` is), known before accelerate starts: the one that holds the run folder and speaks to the user."""
    return os.environ.get("RANK", "0") == "0"


def launch_size() -> tuple[int, int]:
    """(processes in the launch, processes on this node), as ``torchrun`` set them (``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``), known before accelerate starts; (1, 1) for a plain ``lit train``."""
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def on_cpu_processes() -> bool:
    """Whether this is one of several processes (``torchrun`` set ``WORLD_SIZE``) on a machine without CUDA: then
    accelerate must be told to run on the CPU, or it would not join the processes' gloo group."""
    return launch_size()[0] > 1 and not torch.cuda.is_available()


def unsupported_launch(distributed_type: str, mixed_precision: str) -> str | None:
    """Why lit cannot train as accelerate was set up (``accelerate launch`` flags or its config file), or None.
    accelerate's sharded engines (FSDP, DeepSpeed, Megatron-LM) would wrap the model so that its forward is
    theirs, while lit's logprobs call the decoder and the head as submodules (learner/logprobs.py): lit shards the
    decoder layers itself (``policy.shard``, learner/sharding.py, FSDP2). accelerate's mixed precision would wrap
    the model's forward too (``policy.precision`` is lit's)."""
    if distributed_type in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        return (f"accelerate is set up for {distributed_type}: lit shards the model itself, with torch's FSDP2 on "
                "the decoder layers (docs/scaling.md). Set policy.shard = true and launch with `torchrun "
                "--nproc_per_node N -m lit_trainer.cli train ...` or `accelerate launch --multi_gpu "
                "--num_processes N ...` without --use_fsdp / --use_deepspeed / --use_megatron_lm")
    if mixed_precision not in ("no", ""):
        return (f"accelerate is set up for mixed precision {mixed_precision!r}: lit sets its own precision "
                "(float32 LM head and loss, so that its logprobs stay close to vLLM's). Set policy.precision = "
                f"\"{'bf16' if 'bf16' in mixed_precision else 'fp32'}\" and launch with --mixed_precision no (or drop "
                "it from accelerate's config file)")
    return None


def world(accelerator: Any) -> tuple[int, int]:
    """(this process's rank, number of processes)."""
    return accelerator.process_index, accelerator.num_processes


def assign(costs: Sequence[int], processes: int) -> list[list[int]]:
    """Indices of ``costs`` (e.g. the tokens each micro-batch computes) dealt to ``processes`` shares with loads as
    even as a greedy pass makes them: largest first, each to the least loaded share (ties: the lowest rank). Each
    share lists its indices in increasing order. The same costs give the same shares in every process."""
    assert processes >= 1, f"processes must be at least 1, got {processes}"
    shares: list[list[int]] = [[] for _ in range(processes)]
    loads = [0] * processes
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(processes), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += costs[i]
    return [sorted(share) for share in shares]


def sum_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    """All-reduce (sum) the gradients of ``params`` across processes, in place; a parameter without a gradient in
    this process counts as zeros (its share may not have touched it), and has one afterwards. No-op in one process."""
    if not _distributed():
        return
    bucket: list[torch.nn.Parameter] = []
    size = 0
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        bucket.append(p)
        size += p.numel()
        if size >= BUCKET_ELEMENTS:
            _reduce_bucket(bucket)
            bucket, size = [], 0
    if bucket:
        _reduce_bucket(bucket)


def _reduce_bucket(params: list[torch.nn.Parameter]) -> None:
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # (sum of numel,)
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def gather(obj: Any) -> list[Any]:
    """Every process's ``obj`` (picklable), in rank order, in every process; ``[obj]`` in one process."""
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def broadcast(obj: Any = None) -> Any:
    """The main process's ``obj``, in every process (the others pass nothing); ``obj`` itself in one process."""
    if not _distributed():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def leave() -> None:
    """Every process waits for the others, then leaves the process group: ``lit train``'s last act in each process
    (loop.py). A process that exits with the group still up can abort in gloo's threads ("terminate called without
    an active exception") or warn under NCCL that ``destroy_process_group()`` was never called. Nothing to do in
    one process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1
