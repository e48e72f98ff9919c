"""Checkpoints: the model in Hugging Face format (loadable by transformers and vLLM as is) plus what ``--resume``
needs to continue exactly: the optimizer state, the step, the RNG states and the data position.

    <output_dir>/checkpoints/step-000012/
        model/               config.json, model.safetensors, tokenizer files
        adapter/             LoRA only: adapter_config.json, adapter_model.safetensors (peft's format)
        trainer_state.pt     optimizer, step, rng, data position, weight version
        DONE                 written last: a folder without it is an interrupted save and is ignored

With LoRA (``policy.lora_rank > 0``) ``model/`` is the full model with the adapter merged in, so ``lit eval
--checkpoint``, vLLM and transformers load it as a plain model, like a full fine-tune's; ``--resume`` instead
rebuilds the policy from the base model and loads ``adapter/`` on top (the optimizer state is the adapter's).

A checkpoint is written into a temporary folder and renamed into place, so a kill mid-save leaves the previous
checkpoint as the latest.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lit_trainer.learner import lora
from lit_trainer.learner.policy import Policy

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "generation_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    @property
    def adapter_dir(self) -> Path | None:
        """The LoRA adapter of a LoRA run's checkpoint; None for a full fine-tune's."""
        adapter = self.path / "adapter"
        return adapter if adapter.is_dir() else None

    def state(self) -> dict[str, Any]:
        # onto the CPU: under several GPU processes each would otherwise load it onto the device that saved it
        return torch.load(self.path / "trainer_state.pt", weights_only=False, map_location="cpu")


def folder(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def latest(output_dir: str | Path) -> Checkpoint | None:
    """The newest complete checkpoint in ``output_dir``, if any."""
    done = [p for p in folder(output_dir).glob("step-*") if (p / "DONE").exists()]
    if not done:
        return None
    path = max(done, key=lambda p: int(p.name.split("-")[1]))
    return Checkpoint(path, int(path.name.split("-")[1]))


def resolve(path: str | Path) -> Checkpoint:
    """A checkpoint folder, or a run's output folder (its latest checkpoint); a clear error otherwise."""
    path = Path(path)
    if (path / "DONE").exists():
        return Checkpoint(path, int(path.name.split("-")[1]) if path.name.startswith("step-") else 0)
    found = latest(path)
    if found is None:
        raise FileNotFoundError(f"no checkpoint at {path}: give a checkpoints/step-N folder or a run's output_dir "
                                "that holds one")
    return found


def save(output_dir: str | Path, step: int, policy: Policy, base_model_dir: Path, extra: dict[str, Any],
         keep: int = 2) -> Checkpoint:
    """Write the checkpoint of ``step`` atomically and delete all but the newest ``keep``."""
    root = folder(output_dir)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "model").mkdir(parents=True)
    if policy.config.lora_rank:
        lora.save_merged(policy.unwrapped(), tmp / "model")
        lora.save_adapter(policy.unwrapped(), tmp / "adapter")
    else:
        policy.unwrapped().save_pretrained(tmp / "model", safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (base_model_dir / name).exists():
            shutil.copy2(base_model_dir / name, tmp / "model" / name)
    state = {
        "step": step,
        "optimizer": policy.optimizer.state_dict(),
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        **extra,
    }
    torch.save(state, tmp / "trainer_state.pt")
    (tmp / "DONE").write_text(f"step {step}\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    complete = sorted((p for p in root.glob("step-*") if (p / "DONE").exists()), key=lambda p: p.name)
    for old in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return Checkpoint(final, step)


def restore(checkpoint: Checkpoint, policy: Policy) -> dict[str, Any]:
    """Load the training state into ``policy`` and the RNG states; the saved state.

    The caller builds the policy first, with the run's ``PolicyConfig``:
    - full fine-tune: ``PolicyConfig.model = checkpoint.model_dir`` (the weights are loaded there);
    - LoRA (``lora_rank > 0``): ``PolicyConfig.model`` = the run's original base model, NOT ``checkpoint.model_dir``
      (which has the adapter merged in already); this loads the adapter from ``checkpoint.adapter_dir`` into it.
    Then the optimizer state (the adapter's, with LoRA). A LoRA checkpoint into a full policy, or the reverse,
    raises ValueError."""
    _check_kind(checkpoint, policy)
    if checkpoint.adapter_dir is not None:
        lora.load_adapter(policy.unwrapped(), checkpoint.adapter_dir)
    state = checkpoint.state()
    policy.optimizer.load_state_dict(state["optimizer"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    return state


def _check_kind(checkpoint: Checkpoint, policy: Policy) -> None:
    rank = policy.config.lora_rank
    if rank and checkpoint.adapter_dir is None:
        raise ValueError(f"{checkpoint.path} is a full fine-tune's checkpoint (no adapter/) but policy.lora_rank = "
                         f"{rank}: resume it with policy.lora_rank = 0")
    if not rank and checkpoint.adapter_dir is not None:
        raise ValueError(f"{checkpoint.path} is a LoRA run's checkpoint (it holds adapter/) but policy.lora_rank = 0: "
                         "resume it with the run's policy.lora_rank, from the base model")
    if rank:
        base = policy.unwrapped().peft_config["default"].base_model_name_or_path
        if base and Path(base).resolve() == checkpoint.model_dir.resolve():
            raise ValueError(f"the LoRA policy was built from {checkpoint.model_dir}, which has the adapter merged "
                             "in: build it from the run's base model, restore() loads the adapter on top")
