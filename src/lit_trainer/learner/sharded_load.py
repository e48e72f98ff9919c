"""A causal LM whose decoder layers are sharded across the trainer processes (``sharding.shard``), built without
ever holding the whole model: its parameters are made on the meta device (no memory), the layers sharded there,
then only what this process keeps is allocated, and the weights are read from the safetensors files one tensor at
a time (plain reads, no memory map), each cut to this process's shard as it is loaded. A node's host memory at
load then holds each process's share, not N whole models (``bench/shard_memory.py``).

    model = load_sharded(folder, torch.float32, device)   # every process calls it, in the same order
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from lit_trainer.learner import sharding

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


def load_sharded(folder: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The model in ``folder`` with its weights in ``dtype``, its decoder layers sharded over the default process
    group, on ``device``. A collective: every process calls it."""
    from accelerate import init_empty_weights
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):  # the buffers (rotary frequencies) are computed, and small
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    sharding.shard(model)
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)  # this process's shards and the whole parts, uninitialised
    model.tie_weights()  # a tied head is the embeddings again, whatever the steps above made of it
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    names = set(model.state_dict())
    options = StateDictOptions(full_state_dict=True, strict=False)
    loaded = set()
    for name, tensor in read_tensors(folder):
        if name in names:  # a tied head is not in the file, and the file may hold what the model has not
            set_model_state_dict(model, {name: tensor.to(dtype)}, options=options)
            loaded.add(name)
    tied = {name for name in names - loaded if name.endswith("lm_head.weight")} if config.tie_word_embeddings else set()
    missing = names - loaded - tied
    if missing:
        raise ValueError(f"{folder}'s safetensors files lack {len(missing)} of the model's weights, e.g. "
                         f"{sorted(missing)[:3]}: the model folder is incomplete")
    return model


def read_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the model's safetensors files (one file, or the shards its index names), one at a time,
    read into memory of its own."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    for file in files:
        with (folder / file).open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
            header.pop("__metadata__", None)
            for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
                start, end = entry["data_offsets"]
                fh.seek(8 + size + start)
                data = bytearray(end - start)
                fh.readinto(data)
                raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
                yield name, raw.view(SAFETENSORS_DTYPES[entry["dtype"]]).view(entry["shape"])
