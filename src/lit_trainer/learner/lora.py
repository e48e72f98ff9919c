"""LoRA on the policy (peft): the full model with the adapter merged in, for vLLM and for checkpoints, and the
adapter alone, for ``--resume``.

vLLM gets the merged weights through the same full-weights reload as a full fine-tune (its own LoRA mode turns
compilation off on CPU), and a checkpoint's ``model/`` holds them too, so everything downstream of the trainer sees
a plain model. The merge is computed beside the model, never in it: peft's ``merge_adapter``/``unmerge_adapter``
round trip adds the delta to the base weights and subtracts it again in place, and the rounding of every round trip
drifts the frozen weights away from the base model.

    merged W = W + sum over active adapters of scaling * B @ A      (peft's ``get_delta_weight``)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
CHECKED_FIELDS = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "lora_bias", "fan_in_fan_out")
"""The adapter settings a saved adapter must share with the model it is loaded into."""


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper; ``model`` itself when it is none."""
    return model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model


@torch.no_grad()
def merged_state_dict(peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of the model the peft model computes, under the base model's own key names (the key set of the
    base model's ``state_dict()``: no ``base_model.model.`` prefix, no ``.base_layer``, no ``lora_`` tensors), as
    ``merge_and_unload`` would make them, without touching the model. Detached; weights without an adapter are the
    model's own tensors (not copies), and names that share a tensor (tied embeddings) still share it."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    base = peft_model.get_base_model()
    layers: dict[str, LoraLayer] = {}
    merged: dict[int, torch.Tensor] = {}  # id(base parameter) -> its merged value: tied names follow the tensor
    for name, module in base.named_modules():
        if isinstance(module, AuxiliaryTrainingWrapper):
            raise NotImplementedError(f"{name} is a {type(module).__name__} (modules_to_save / trainable tokens): "
                                      "merged_state_dict supports plain LoRA adapters only")
        if not isinstance(module, LoraLayer):
            continue
        layers[name] = module
        merged.update(_merged_layer(name, module))
    state = base.state_dict(keep_vars=True)
    names: dict[int, list[str]] = {}
    for key, value in state.items():
        names.setdefault(id(value), []).append(key)
    tied = [names[i] for i, value in merged.items() if len(names.get(i, ())) > 1]
    if tied:  # the merged head would also be the merged input embedding: not the model peft computes
        raise ValueError(f"a LoRA adapter sits on tied weights {tied[0]}: its merge would change all of them; "
                         "leave the tied layer (lm_head / embed_tokens) out of policy.lora_target_modules")
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        owner, rest = _split_at_layer(key, layers)
        if owner is not None:
            if not rest.startswith("base_layer."):
                continue  # lora_A, lora_B, ...: already in the merge
            key = f"{owner}.{rest.removeprefix('base_layer.')}"
        out[key] = merged.get(id(value), value.detach())
    return out


def _merged_layer(name: str, layer: torch.nn.Module) -> dict[int, torch.Tensor]:
    """{id(base weight or bias): merged value} for one LoRA layer's active adapters."""
    if layer.merged:
        raise ValueError(f"{name} has adapters merged in place ({layer.merged_adapters}): unmerge them first, "
                         "merged_state_dict computes the merge itself")
    base_layer = layer.get_base_layer()
    if base_layer is not layer.base_layer:
        raise NotImplementedError(f"{name}: nested adapter layers are not supported")
    adapters = [] if layer.disable_adapters else [a for a in layer.active_adapters if a in layer.lora_A]
    weight, bias = base_layer.weight.detach(), getattr(base_layer, "bias", None)
    bias = bias.detach() if bias is not None else None
    for adapter in adapters:
        if adapter in getattr(layer, "lora_variant", {}):
            raise NotImplementedError(f"{name}: adapter {adapter!r} is a LoRA variant (DoRA, ...): only plain LoRA "
                                      "is merged")
        weight = weight + layer.get_delta_weight(adapter)  # the same sum peft's merge does in place
        if layer.lora_bias.get(adapter):
            bias = bias + layer.lora_B[adapter].bias.detach() * layer.scaling[adapter]
    if not adapters:
        return {}
    out = {id(base_layer.weight): weight}
    if bias is not None:
        out[id(base_layer.bias)] = bias
    return out


def _split_at_layer(key: str, layers: dict[str, torch.nn.Module]) -> tuple[str | None, str]:
    """(the LoRA layer that owns state-dict key ``key``, the rest of the key) or (None, key)."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        owner = ".".join(parts[:i])
        if owner in layers:
            return owner, ".".join(parts[i:])
    return None, key


def save_merged(peft_model: torch.nn.Module, folder: str | Path) -> None:
    """The merged model in Hugging Face format (config.json, generation_config.json, model.safetensors): it loads
    with ``AutoModelForCausalLM.from_pretrained`` or vLLM as a plain model. Tied weights are written once, as
    transformers does for the base model."""
    base = peft_model.get_base_model()
    # transformers finds the tied names by the tensors' shared storage, which merged_state_dict keeps.
    base.save_pretrained(str(folder), state_dict=merged_state_dict(peft_model), safe_serialization=True)


def save_adapter(peft_model: torch.nn.Module, folder: str | Path) -> None:
    """The adapter alone (adapter_config.json, adapter_model.safetensors), peft's format."""
    peft_model.save_pretrained(str(folder), safe_serialization=True)


def load_adapter(peft_model: torch.nn.Module, folder: str | Path, adapter: str = "default") -> None:
    """Copy the adapter that ``save_adapter`` wrote in ``folder`` into ``peft_model``'s adapter ``adapter``, in
    place (the parameters stay the same objects, so an optimizer built on them keeps them). Raises ValueError when
    the saved adapter's rank, alpha or target modules differ from the model's."""
    from peft import LoraConfig, set_peft_model_state_dict
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).exists() or not (folder / ADAPTER_WEIGHTS).exists():
        raise FileNotFoundError(f"{folder} holds no LoRA adapter ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    saved, current = LoraConfig.from_pretrained(str(folder)), peft_model.peft_config[adapter]
    differ = [f"{field}: saved {_comparable(getattr(saved, field, None))!r}, "
              f"model {_comparable(getattr(current, field, None))!r}"
              for field in CHECKED_FIELDS
              if _comparable(getattr(saved, field, None)) != _comparable(getattr(current, field, None))]
    if differ:
        raise ValueError(f"the LoRA adapter in {folder} does not fit the policy's ({'; '.join(differ)}): build the "
                         "policy with the run's policy.lora_rank, policy.lora_alpha and policy.lora_target_modules")
    device = next(p.device for p in peft_model.parameters())
    result = set_peft_model_state_dict(peft_model, load_file(str(folder / ADAPTER_WEIGHTS), device=str(device)),
                                       adapter_name=adapter)
    missing = [k for k in result.missing_keys if "lora_" in k and f".{adapter}" in k]
    if result.unexpected_keys or missing:
        raise ValueError(f"the LoRA adapter in {folder} does not fit the model: unexpected "
                         f"{result.unexpected_keys[:3]}, missing {missing[:3]}")


def _comparable(value: object) -> object:
    return sorted(value) if isinstance(value, (set, list, tuple)) else value


def add_adapters(model: torch.nn.Module, config: Any, names: Sequence[str]) -> torch.nn.Module:
    """``model`` with one LoRA adapter of ``config`` per name (a ``[roles]`` table's), every one trainable; the
    first is active."""
    from peft import get_peft_model

    peft_model = get_peft_model(model, config, adapter_name=names[0])
    for name in names[1:]:
        peft_model.add_adapter(name, config)
    for key, param in peft_model.named_parameters():
        if "lora_" in key:
            param.requires_grad_(True)  # add_adapter leaves the new ones frozen: one optimizer trains them all
    return peft_model


def activate(peft_model: torch.nn.Module, name: str) -> None:
    """Make adapter ``name`` the one the next forward passes use. Unlike peft's ``set_adapter`` it leaves every
    adapter trainable, so that the gradients of one step's micro-batches of several adapters add up for one
    optimizer step."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in peft_model.modules():
        if isinstance(module, BaseTunerLayer) and name in getattr(module, "lora_A", {}):
            module._active_adapter = [name]


@contextlib.contextmanager
def adapters_off(peft_model: torch.nn.Module) -> Iterator[None]:
    """The base model computes while this lasts (peft's ``disable_adapter``), and every parameter that was trainable
    is again after: peft's own makes only the active adapter trainable when it ends, which would leave the other
    roles' adapters out of the step."""
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    try:
        with peft_model.disable_adapter():
            yield
    finally:
        for param in trainable:
            param.requires_grad_(True)


def adapter_state(peft_model: torch.nn.Module, name: str) -> dict[str, torch.Tensor]:
    """Adapter ``name``'s weights as peft saves them (``adapter_model.safetensors``'s keys), detached."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(peft_model, adapter_name=name).items()}


def adapter_config(peft_model: torch.nn.Module, name: str) -> dict[str, Any]:
    """Adapter ``name``'s ``adapter_config.json``, as a dict."""
    config = peft_model.peft_config[name].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
