"""A second device on a machine without a GPU, to catch tensors left on the wrong device (CI has no GPU).

``simgpu:0`` is a device that torch treats as an accelerator (the PrivateUse1 backend, registered from Python)
whose tensors hold a CPU tensor each and compute with the CPU's kernels, so the numbers are exactly the CPU's. What it
adds is CUDA's rule: an operation that mixes a ``simgpu`` tensor with a CPU tensor (other than a 0-dim scalar) raises
``DeviceMismatch``, as ``RuntimeError: Expected all tensors to be on the same device, but found at least two
devices, cuda:0 and cpu!`` would on a GPU. Moving a tensor (``.to``, ``.cpu()``, ``copy_``) is allowed, as on a
GPU; so are autograd, gradient checkpointing and the fused AdamW step. It has no autocast (bf16 runs on the CPU's).

Registering the backend changes torch for the whole process (``torch.accelerator`` then names it), so it is only
imported in an interpreter of its own: ``python second_device.py <model folder> <scenario>...`` runs each scenario
on the CPU and on ``simgpu`` and prints their results as one JSON line (test_device_placement.py).
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


def main(folder: Path, scenarios: list[str]) -> dict:
    """Each scenario on the CPU, then on ``simgpu``, in this one interpreter: the CPU runs come first and their
    device is the CPU whatever is registered (accelerate picks the CPU here either way)."""
    import placement_scenarios

    out = {}
    for name in scenarios:
        cpu = placement_scenarios.SCENARIOS[name](folder, None)
        with SecondDevice():
            out[name] = {"cpu": cpu, NAME: placement_scenarios.SCENARIOS[name](folder, to_device)}
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), sys.argv[2:])))
