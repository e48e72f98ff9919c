"""A second device on a machine without a GPU, to catch tensors left on the wrong device (CI has no GPU).

``simgpu:0`` is a device that torch treats as an accelerator (the PrivateUse1 backend, registered from Python)
whose tensors hold a CPU tensor each and compute with the CPU's kernels, so the numbers are exactly the CPU's. What it
adds is CUDA's rule: an operation that mixes a ``simgpu`` tensor with a CPU tensor (other than a 0-dim scalar) raises
``DeviceMismatch``, as ``RuntimeError: Expected all tensors to be on the same device, but found at least two
devices, cuda:0 and cpu!`` would on a GPU. Moving a tensor (``.to``, ``.cpu()``, ``copy_``) is allowed, as on a
GPU; so are autograd, gradient checkpointing and the fused AdamW step. It has no autocast (bf16 runs on the CPU's).

Registering the backend changes torch for the whole process (``torch.accelerator`` then names it), so it is only
imported by the scenarios run in their own interpreter: ``python second_device.py <scenario> <model folder>``,
which prints the scenario's result as one JSON line (test_device_placement.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.backend_registration import _DummyBackendModule, _setup_privateuseone_for_python_backend

NAME = "simgpu"


class _Backend(_DummyBackendModule):
    def get_amp_supported_dtype(self) -> list[torch.dtype]:  # asked by torch.utils.checkpoint, never used
        return [torch.bfloat16]


_setup_privateuseone_for_python_backend(NAME, backend_module=_Backend())
DEVICE = torch.device(NAME, 0)
MOVES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}
"""The operations that may take tensors of both devices: they move data between them."""


class DeviceMismatch(RuntimeError):
    """An operation got tensors on two devices."""


class OnDevice(torch.Tensor):
    """A tensor on ``simgpu:0``, holding its values in a CPU tensor."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> OnDevice:
        wrapper = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                      storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                      device=DEVICE, requires_grad=inner.requires_grad)
        wrapper.inner = inner
        return wrapper

    def __repr__(self) -> str:
        return f"OnDevice({self.inner!r})"

    def tolist(self) -> list:  # a copy to the host, as on a GPU
        return self.inner.tolist()

    def untyped_storage(self) -> torch.UntypedStorage:  # tensors that share memory share it here too
        return self.inner.untyped_storage()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with SecondDevice():  # a tensor used outside the mode (autograd's worker thread) computes the same way
            return SecondDevice().__torch_dispatch__(func, types, args, kwargs)


class SecondDevice(TorchDispatchMode):
    """While active, ``simgpu:0`` works: tensors are created on it, moved to and from it, computed on it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        there = any(isinstance(x, OnDevice) for x in flat)
        here = [x for x in flat if not isinstance(x, OnDevice) and x.dim() > 0]
        if there and here and func not in MOVES:
            raise DeviceMismatch(f"Expected all tensors to be on the same device, but found at least two devices, "
                                 f"{DEVICE} and cpu! ({func}, a CPU tensor of shape {tuple(here[0].shape)})")
        target = kwargs.get("device")
        target = torch.device(target) if target is not None else None
        if target is not None and target.type == NAME:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        destination = args[0] if args else None
        args, kwargs = tree_map(lambda x: x.inner if isinstance(x, OnDevice) else x, (args, kwargs))
        out = func(*args, **kwargs)
        if func is torch.ops.aten.copy_.default:
            return destination  # copied into in place, on whichever device it is
        on_device = target.type == NAME if target is not None else there
        if not on_device:
            return out
        return tree_map(lambda x: OnDevice(x) if isinstance(x, torch.Tensor) else x, out)


_library = torch.library.Library("aten", "IMPL")


def _empty(*args, **kwargs) -> OnDevice:
    """``torch.tensor(..., device=simgpu)`` allocates below the dispatch mode: its kernel for the device."""
    return OnDevice(torch.empty_strided(*args, **{**kwargs, "device": torch.device("cpu")}))


def _copy_from(source: torch.Tensor, destination: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """... and fills it with a copy from the CPU below the mode too."""
    inner = destination.inner if isinstance(destination, OnDevice) else destination
    inner.copy_(source.inner if isinstance(source, OnDevice) else source)
    return destination


_library.impl("empty_strided", _empty, "PrivateUse1")
_library.impl("_copy_from", _copy_from, "PrivateUse1")


def to_device(module: torch.nn.Module) -> None:
    """Move ``module``'s parameters onto ``simgpu:0`` in place: the same Parameter objects (an optimizer built on
    them keeps them), now on the device."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to(DEVICE)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


if __name__ == "__main__":
    import placement_scenarios

    scenario, folder, where = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    if where == NAME:
        with SecondDevice():
            result = placement_scenarios.SCENARIOS[scenario](folder, to_device)
    else:
        result = placement_scenarios.SCENARIOS[scenario](folder, None)
    print(json.dumps(result))
