"""What the policy holds in memory in each trainer process, known before any weight is loaded, and the check that it
fits the device it will be loaded on.

    weights     P x 4 bytes (float32 master weights), or a LoRA policy's frozen base: P x 4, or P x 2 under bf16,
                plus its adapters' A parameters x 4
    gradients   4 bytes per trained parameter
    AdamW       8 bytes per trained parameter (two float32 moments)
    reference   the frozen KL reference (``loss.kl_beta > 0``, full fine-tune): P x 4, P x 2 under bf16
    sharded     the decoder layers' part of all four divided by the processes (learner/sharding.py); the
                embeddings and the head stay whole in every process. The main process also holds the whole
                weights it gathers to push into vLLM (``gathered``: loop.py keeps the last push): P x 4 at most,
                P x 2 when vLLM serves in bfloat16 (``inference.dtype``); in host memory with the ``shm``
                transport (the default), on its GPU with ``nccl``/``ipc``

Activations come on top: they depend on ``batching.max_tokens_per_micro_batch`` and gradient checkpointing (with a
1.5B model in bf16, a 4096-token micro-batch's take about 16 GiB; docs/scaling.md). The parameter counts come from
the model's config, on the meta device: nothing is read but ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GB = 1e9


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one trainer process holds for the policy, before activations."""

    parameters: int
    """P: the model's parameters."""
    trained: int
    """The parameters the optimizer steps: P, or a LoRA policy's adapters."""
    weights: int
    gradients: int
    optimizer: int
    reference: int
    processes: int
    sharded: bool
    precision: str
    lora: bool

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.reference

    @property
    def gathered(self) -> int:
        """Sharded: the whole weights the main process gathers for vLLM, on top of ``total`` (float32: at most)."""
        return self.parameters * 4 if self.sharded and not self.lora else 0

    def describe(self) -> str:
        """One line: the total and its parts, in GB."""
        parts = f"weights {self.weights / GB:.2f}, gradients {self.gradients / GB:.2f}, AdamW {self.optimizer / GB:.2f}"
        if self.reference:
            parts += f", KL reference {self.reference / GB:.2f}"
        where = f", sharded over {self.processes} processes" if self.sharded else ""
        main = f"; the main process also holds up to {self.gathered / GB:.2f} GB of whole weights for vLLM " \
            "(in host memory with weight_sync.transport = \"shm\")" \
            if self.gathered else ""
        return (f"the policy ({self.parameters / 1e6:.1f}M parameters, {self.trained / 1e6:.1f}M trained{where}) "
                f"needs about {self.total / GB:.2f} GB per trainer process before activations ({parts}){main}")


def count(config: object, lora_rank: int = 0, lora_targets: tuple[str, ...] = ()) -> tuple[int, int, int]:
    """(parameters, parameters in the decoder layers, LoRA adapter parameters) of the causal LM ``config`` describes,
    built on the meta device (no memory, no weights read). Tied embeddings count once."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in model.parameters())
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = sum(p.numel() for m in model.modules() if type(m).__name__ in names for p in m.parameters())
    adapters = 0
    if lora_rank:
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in lora_targets:
                adapters += lora_rank * (module.in_features + module.out_features)
    return parameters, layers, adapters


def plan(parameters: int, layers: int, adapters: int, *, precision: str, lora: bool, reference: bool,
         processes: int = 1, sharded: bool = False) -> MemoryPlan:
    """The bytes of the module docstring for a model of ``parameters`` (``layers`` of them in the decoder layers)
    trained in ``precision`` (``fp32`` or ``bf16``), as LoRA (with ``adapters`` parameters) or in full."""
    share = (lambda n, in_layers: n - in_layers + in_layers / processes) if sharded and processes > 1 else \
        (lambda n, in_layers: n)
    frozen_bytes = 2 if precision == "bf16" else 4
    if lora:
        weights = share(parameters * frozen_bytes + adapters * 4, layers * frozen_bytes + adapters * 4)
        trained = adapters
        trained_bytes = share(adapters, adapters)
        reference_bytes = 0  # the base under the adapter
    else:
        weights = share(parameters * 4, layers * 4)
        trained = parameters
        trained_bytes = share(parameters, layers)
        reference_bytes = share(parameters * frozen_bytes, layers * frozen_bytes) if reference else 0
    return MemoryPlan(parameters, trained, int(weights), int(trained_bytes * 4), int(trained_bytes * 8),
                      int(reference_bytes), processes, sharded and processes > 1, precision, lora)


def available(device: torch.device) -> int | None:
    """Free bytes where the policy will live: the GPU's free memory, or the machine's available memory for a CPU;
    None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        import psutil

        return int(psutil.virtual_memory().available)
    return None


class PolicyTooLarge(ValueError):
    """The policy cannot fit the device it is to be loaded on; the message names what to change."""


def check_fits(memory: MemoryPlan, free: int | None, device: torch.device) -> None:
    """PolicyTooLarge when ``memory`` is more than ``free`` bytes on ``device`` (activations not even counted)."""
    if free is None or memory.total <= free:
        return
    fixes = []
    if not memory.lora and not memory.sharded:
        fixes.append("shard it across N processes (policy.shard = true, launched with torchrun --nproc_per_node N)")
    if not memory.lora:
        fixes.append("train LoRA adapters (policy.lora_rank = 16)")
    if memory.reference:
        fixes.append("drop the KL term (loss.kl_beta = 0) or use LoRA, whose reference costs nothing")
    if memory.precision == "fp32" and (memory.lora or memory.reference):
        fixes.append('policy.precision = "bf16", which keeps frozen weights in bfloat16')
    fixes.append("a device with more memory")
    raise PolicyTooLarge(f"{memory.describe()}, and {device} has {free / GB:.2f} GB free: it cannot fit. "
                         f"Options: {'; '.join(fixes)}")
