"""The update with the model sharded across the trainer processes: torch's FSDP2 (``fully_shard``) on every decoder
layer, so that each process holds 1/N of the layers' weights, gradients and AdamW state.

    process r of N:  layer weights, gradients, AdamW moments: its 1/N shard of each (a DTensor)
                     embeddings, final norm, LM head: whole (replicated), their gradients summed (distributed.py)

Each layer's weights are all-gathered for its forward and again for its backward, and its gradients are
reduce-scattered (summed, not averaged: the loss terms are normalised by the whole step, ``LossFn``) right after
its backward. lit's logprob path calls the decoder and the LM head as submodules (learner/logprobs.py): with only
the layers sharded, their own FSDP hooks run whichever way they are called, so the shared-prompt packing and the
float32 head keep working. What stays whole is the part lit calls outside the layers; on a 7B model the embeddings
and head are about 14 % of the weights (docs/scaling.md).

Every collective must be entered by every process in the same order: each process runs the same number of forward
and backward passes (``padded_share``: a process with fewer micro-batches runs one of them again with a zero loss),
and ``full_state_dict`` is called by all of them. Gloo (CPU) has no pre-scaled reduction, so the reductions are
forced to plain sums.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lit_trainer.learner import lora


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder blocks of a Hugging Face causal LM (the classes its ``_no_split_modules`` names), peft
    wrappers looked through, sharded ones too (FSDP2 gives a sharded layer a subclass of its own class); ValueError
    when it names none."""
    base = lora.base_model(model)
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in base.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not layers:
        raise ValueError(f"{type(base).__name__} names no decoder layer class (_no_split_modules): lit cannot "
                         "shard it; train it without sharding")
    return layers


def shard(model: torch.nn.Module) -> int:
    """``fully_shard`` every decoder layer of ``model`` in place over the default process group, with summed
    gradient reductions; how many layers. FSDP2 moves each layer to the mesh's device (the GPU of this rank) as it
    shards it, so call it on the model still on the CPU: the whole model is never on the device at once."""
    from torch.distributed.fsdp import fully_shard

    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer)
        layer.set_gradient_divide_factor(1.0)
        layer.set_force_sum_reduction_for_comms(True)  # gloo has no pre-scaled sum
    return len(layers)


def is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def padded_share(share: Sequence[int], count: int) -> list[tuple[int, bool]]:
    """A process's micro-batch indices ``share`` padded to ``count`` entries, as (index, real): the padding repeats
    its first micro-batch (or micro-batch 0 when it has none), to be run with a zero loss so that every process
    enters the same collectives."""
    filler = share[0] if share else 0
    return [(i, True) for i in share] + [(filler, False)] * (count - len(share))


def grad_norm(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the gradients of ``params``, sharded and whole alike (each shard counted once, each
    replicated gradient once), the same in every process."""
    sharded = [p.grad.to_local() for p in params if p.grad is not None and is_sharded(p.grad)]
    whole = [p.grad for p in params if p.grad is not None and not is_sharded(p.grad)]
    device = (sharded or whole)[0].device if (sharded or whole) else torch.device("cpu")

    def squares(grads: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([g.float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros((), device=device)

    local = squares(sharded)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(local)  # the shards' squares, added up over the processes
    return (local + squares(whole)).sqrt()


def clip(params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
    """Scale the gradients so that their global norm is at most ``max_norm`` (0: leave them); the norm before."""
    norm = grad_norm(params)
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return float(norm)


def full_state_dict(model: torch.nn.Module, keep: bool = True, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """The whole model's weights, gathered one tensor at a time (a collective: every process calls it, in the same
    order); ``keep``: whether this process keeps them (the main process, which pushes and saves them) or lets each
    gathered tensor go at once ({} returned), so that the others never hold more than one whole tensor.
    ``dtype``, ``device``: each kept tensor is cast and moved there as soon as it is gathered (vLLM's serving
    dtype: a bfloat16 copy is half a float32 one; the CPU: the copy leaves the GPU one tensor at a time); tensors
    that share storage (tied embeddings) share their copy."""
    whole: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        gathered = t.full_tensor() if is_sharded(t) else t
        if not keep:
            continue
        if dtype is not None or device is not None:
            key = id(t) if is_sharded(t) else t.untyped_storage().data_ptr()
            if key not in copies:
                cast = dtype if dtype is not None and gathered.is_floating_point() else gathered.dtype
                copies[key] = gathered.detach().to(device=device or gathered.device, dtype=cast)
            gathered = copies[key]
        whole[name] = gathered
    return whole


def local_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes this process holds of the model's parameters (a shard's local part, a whole tensor whole) and of the
    optimizer's state."""
    def size(t: torch.Tensor) -> int:
        t = t.to_local() if is_sharded(t) else t
        return t.numel() * t.element_size()

    total = sum(size(p) for p in model.parameters())
    if optimizer is not None:
        total += sum(size(t) for state in optimizer.state.values() for t in state.values()
                     if isinstance(t, torch.Tensor) and t.dim() > 0)
    return total
