"""Weights as ZeroMQ frames, for a vLLM server on another host (``remote``, ``serve``): one MessagePack header
naming each tensor's dtype and shape, then one frame of raw bytes per tensor, in the header's order. The receiver
trusts nothing in it: every dtype is one of ``DTYPES``, every frame holds exactly its tensor's bytes.

    frames = pack({"version": "3"}, {"model.norm.weight": norm})      # header + one frame per tensor
    header, tensors = unpack(frames)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import torch

DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                                       torch.int64, torch.int32, torch.uint8, torch.bool)}
"""The dtypes a frame may carry, by name."""


class WireError(ValueError):
    """Frames that do not make the tensors their header names; the message says what is wrong."""


def pack(header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> list[Any]:
    """The header (with ``tensors``: name, dtype, shape of each) and each tensor's bytes, on the host, contiguous
    (a tensor two names share is sent under each)."""
    frames: list[Any] = []
    table = []
    for name, tensor in tensors.items():
        flat = tensor.detach().to("cpu").contiguous()
        dtype = str(flat.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise WireError(f"{name}: dtype {dtype} cannot be sent (one of {', '.join(DTYPES)})")
        table.append([name, dtype, list(flat.shape)])
        frames.append(memoryview(flat.reshape(-1).view(torch.uint8).numpy()) if flat.numel() else b"")
    return [msgpack.packb({**header, "tensors": table}), *frames]


def unpack(frames: Sequence[bytes]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The header and the tensors of ``pack``'s frames (views of the frames' bytes: read them, never write)."""
    try:
        header = msgpack.unpackb(frames[0])
        table = header.pop("tensors")
    except (ValueError, KeyError, TypeError, IndexError, msgpack.ExtraData) as exc:
        raise WireError(f"not a weights message: {exc}") from None
    if not isinstance(header, dict) or not isinstance(table, list) or len(table) != len(frames) - 1:
        raise WireError(f"the header names {len(table) if isinstance(table, list) else '?'} tensors for "
                        f"{len(frames) - 1} frames")
    tensors = {}
    for entry, frame in zip(table, frames[1:], strict=True):
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and entry[1] in DTYPES
                and isinstance(entry[2], list) and all(isinstance(n, int) and n >= 0 for n in entry[2])):
            raise WireError(f"a bad tensor entry: {str(entry)[:200]}")
        name, dtype, shape = entry[0], DTYPES[entry[1]], entry[2]
        size = math.prod(shape) * dtype.itemsize
        if len(frame) != size:
            raise WireError(f"{name}: {len(frame)} bytes for a {entry[1]} tensor of shape {shape} ({size} bytes)")
        with warnings.catch_warnings():  # read, never written: copied into the server's weights file
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            raw = torch.frombuffer(frame, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        tensors[name] = raw.view(dtype).view(shape)
    return header, tensors
