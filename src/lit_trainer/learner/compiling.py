"""``policy.compile``: the decoder's layers and final norm compiled in place with ``torch.compile``.

Why these modules and not the model: the learner runs the decoder trunk and the LM head itself, past the model's
own forward (learner/logprobs.py), so a compiled ``model.forward`` would never run; the layers are where the time
goes. In place (``nn.Module.compile``): the module tree, the parameter names and the state dict stay the model's,
so the weight sync, the checkpoints, LoRA's merge and its adapter switch see the same model. ``dynamic=True``: every
micro-batch has another length, and one shape-generic graph serves them all (and, inlined, every layer). What it
gains and costs is measured in bench/README.md (``bench/gpu/compile_probe.py`` on a GPU, ``bench/update_throughput.py
--figure compile`` on the CPU); the first updates pay for the compilation.

On the CPU, torch's inductor builds its kernels with a C++ compiler: ``missing_compiler`` says so before anything
loads when there is none.
"""

from __future__ import annotations

import os
import shutil

import torch

from lit_trainer.learner import lora, sharding

CXX = ("g++", "c++", "clang++")
"""The C++ compilers inductor looks for on the CPU (or ``$CXX``)."""


def missing_compiler(device: torch.device) -> str | None:
    """Why ``policy.compile`` cannot run on ``device``, in words naming the fix; None when it can."""
    if device.type != "cpu" or any(shutil.which(c) for c in (os.environ.get("CXX", ""), *CXX) if c):
        return None
    return ("policy.compile = true compiles the decoder with torch.compile, whose CPU kernels are built by a C++ "
            f"compiler, and none of {', '.join(CXX)} (or $CXX) is on PATH: install one (e.g. `apt install g++`), "
            "or set policy.compile = false")


def decoder_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's layers (``sharding.decoder_layers``: the ones FSDP2 shards) and its final norm, of a Hugging
    Face causal LM or a peft model around one."""
    base = lora.base_model(model)
    try:
        layers = sharding.decoder_layers(base)
    except ValueError:  # its words are for sharding
        raise ValueError(f"policy.compile: {type(base).__name__} has no decoder with a list of layers to compile "
                         "(its `_no_split_modules` names no layer class); set policy.compile = false") from None
    norm = getattr(base.get_decoder(), "norm", None) if hasattr(base, "get_decoder") else None
    return [*layers, *([norm] if isinstance(norm, torch.nn.Module) else [])]


def compile_decoder(model: torch.nn.Module) -> int:
    """Compile ``decoder_modules(model)`` in place (each compiles on its first call); how many."""
    modules = decoder_modules(model)
    for module in modules:
        module.compile(dynamic=True)
    return len(modules)


def uncompile_decoder(model: torch.nn.Module) -> None:
    """Undo ``compile_decoder``: the modules run eagerly again (for comparisons)."""
    for module in decoder_modules(model):
        module._compiled_call_impl = None
