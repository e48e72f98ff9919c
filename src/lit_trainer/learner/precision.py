"""The precision the learner computes in (``policy.precision``), and the checks that it can.

    fp32   every weight, activation and gradient in float32 (the default on a CPU)
    bf16   the decoder's matmuls and attention under ``torch.autocast(bfloat16)`` (the default on a GPU); the
           weights, their gradients and AdamW's state stay float32 (master weights), and the LM head, the
           log-softmax and the loss run in float32 (``logprobs._head_logprobs``), because the importance ratios
           against vLLM's logprobs are what the loss is made of. On a GPU the head's matmuls may use TF32 (float32
           output, 10-bit inputs: its logits are about 20 times closer to float32's than a bf16 head's).

A LoRA policy under bf16 keeps its frozen base weights in bfloat16 (half the memory; the adapters stay float32),
and so does the frozen reference model of the KL term: neither is ever stepped. What bf16 costs in logprob precision
shows every step as ``policy/vllm_logprob_gap`` (the trainer's logprobs against the ones vLLM sampled with).

``check`` runs before anything starts (``Policy.__init__``): bf16 on a device that cannot compute it (a GPU older than
Ampere, a device without bf16 autocast), or a model whose weights are not floating point (a quantized checkpoint),
stops with one line naming the fix. bf16 on an x86 CPU without AVX512-BF16 or AMX runs, emulated and much slower than
fp32: ``slow_on`` says so in a warning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

PRECISIONS = ("auto", "fp32", "bf16")
"""``policy.precision``'s values; ``auto``: bf16 on a GPU that computes it, fp32 elsewhere."""


class PrecisionError(ValueError):
    """The asked precision cannot run here, or the model cannot be trained in it; the message names the fix."""


def resolve(asked: str, device: torch.device) -> str:
    """``fp32`` or ``bf16`` for ``policy.precision = asked`` on ``device``: ``auto`` is bf16 on CUDA when the GPU
    computes bf16 natively (Ampere and newer), fp32 elsewhere (a CPU's bf16 is slower than its fp32 unless it has
    AVX512-BF16 or AMX, and CPU training is where lit's tests and examples run)."""
    if asked not in PRECISIONS:
        raise PrecisionError(f"policy.precision must be one of {PRECISIONS}, got {asked!r}")
    if asked != "auto":
        return asked
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False) else "fp32"


def check(precision: str, device: torch.device) -> None:
    """PrecisionError when ``precision`` cannot run on ``device``: bf16 needs autocast on that kind of device and
    a bf16 matmul that runs there (on CUDA: a GPU with native bf16, compute capability 8.0 or newer)."""
    if precision != "bf16":
        return
    fix = "set policy.precision = \"fp32\""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        name = torch.cuda.get_device_name(device)
        raise PrecisionError(f"policy.precision = \"bf16\" but the GPU {name} has no native bfloat16 (it needs "
                             f"compute capability 8.0 or newer, e.g. A100, H100, L4): {fix}")
    if not torch.amp.is_autocast_available(device.type):
        raise PrecisionError(f"policy.precision = \"bf16\" but torch has no bfloat16 autocast on {device.type}: "
                             f"{fix}")
    try:
        with autocast(device, "bf16"):
            probe = torch.ones(4, 4, device=device) @ torch.ones(4, 4, device=device)
        ok = probe.dtype == torch.bfloat16 and bool(torch.isfinite(probe).all())
    except (RuntimeError, NotImplementedError) as exc:
        raise PrecisionError(f"policy.precision = \"bf16\" but a bfloat16 matmul fails on {device} "
                             f"({str(exc).splitlines()[0]}): {fix}") from None
    if not ok:
        raise PrecisionError(f"policy.precision = \"bf16\" but autocast on {device} does not compute in bfloat16: "
                             f"{fix}")


def slow_on(precision: str, device: torch.device) -> str | None:
    """A warning when ``precision`` runs but slowly on ``device``: bf16 on an x86 CPU without AVX512-BF16 or AMX,
    where torch emulates bfloat16 matmuls (many times slower than float32: bench/README.md)."""
    if precision != "bf16" or device.type != "cpu" or not torch.cpu._is_avx2_supported():
        return None  # not an x86 CPU (Arm CPUs have their own bf16 paths): nothing known to warn about
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return None
    return ("policy.precision = \"bf16\" on a CPU without AVX512-BF16 or AMX: torch emulates its bfloat16 "
            "matmuls, many times slower than float32 (set policy.precision = \"fp32\" to train faster here)")


def check_model_dtype(config: object, where: str) -> None:
    """PrecisionError when the model at ``where`` (its transformers ``config``) is quantized: its weights are
    integers that lit cannot keep as float32 master weights nor push to vLLM as a plain model."""
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else \
            getattr(quantization, "quant_method", "?")
        raise PrecisionError(f"the model at {where} is quantized ({method}): lit trains floating-point weights. "
                             "Give policy.model (and the top-level model) the unquantized checkpoint; for less "
                             "memory use policy.lora_rank > 0 with policy.precision = \"bf16\" (the frozen base then "
                             "lives in bfloat16)")


def weights_dtype(precision: str, frozen: bool) -> torch.dtype:
    """The dtype a model's weights are loaded in: float32 master weights for what is trained; bfloat16 for frozen
    weights (a LoRA base, the KL reference) under bf16."""
    return torch.bfloat16 if precision == "bf16" and frozen else torch.float32


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """``torch.autocast(bfloat16)`` on ``device`` under bf16; nothing under fp32."""
    if precision != "bf16":
        yield
        return
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        yield


@contextlib.contextmanager
def float32_head(device: torch.device) -> Iterator[None]:
    """Autocast off: the LM head and the log-softmax in float32 inside a bf16 forward."""
    if not torch.amp.is_autocast_available(device.type):
        yield
        return
    with torch.autocast(device_type=device.type, enabled=False):
        yield


@contextlib.contextmanager
def tf32_matmuls(device: torch.device, precision: str) -> Iterator[None]:
    """Under bf16 on CUDA, float32 matmuls (the LM head's, forward and backward) may use TF32 while this lasts; the
    previous setting comes back after. Nothing elsewhere: fp32 stays IEEE float32."""
    if precision != "bf16" or device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    setting = "fp32_precision" if hasattr(matmul, "fp32_precision") else "allow_tf32"  # torch >= 2.9 : older
    before = getattr(matmul, setting)
    setattr(matmul, setting, "tf32" if setting == "fp32_precision" else True)
    try:
        yield
    finally:
        setattr(matmul, setting, before)
