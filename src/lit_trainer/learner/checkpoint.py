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
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lit_trainer.learner import lora
from lit_trainer.learner.policy import Policy
from lit_trainer.runs import Checkpoint, RunFolder

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "generation_config.json", "chat_template.jinja")


def save(output_dir: str | Path, step: int, policy: Policy, base_model_dir: Path, extra: dict[str, Any],
         keep: int = 2) -> Checkpoint:
    """Write the checkpoint of ``step`` atomically and delete all but the newest ``keep``."""
    run = RunFolder(output_dir)
    checkpoint = run.checkpoint(step)
    staging = Checkpoint(checkpoint.path.with_name(f".tmp-{checkpoint.path.name}"), step)
    shutil.rmtree(staging.path, ignore_errors=True)
    staging.model_dir.mkdir(parents=True)
    if policy.config.lora_rank:
        lora.save_merged(policy.unwrapped(), staging.model_dir)
        lora.save_adapter(policy.unwrapped(), staging.adapter_path)
    else:
        policy.unwrapped().save_pretrained(staging.model_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (base_model_dir / name).exists():
            shutil.copy2(base_model_dir / name, staging.model_dir / name)
    state = {
        "step": step,
        "optimizer": policy.optimizer.state_dict(),
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        **extra,
    }
    torch.save(state, staging.state_file)
    staging.done_file.write_text(f"step {step}\n")  # last: the folder is complete
    shutil.rmtree(checkpoint.path, ignore_errors=True)
    staging.path.rename(checkpoint.path)
    complete = run.checkpoints()
    for old in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(old.path, ignore_errors=True)
    return checkpoint


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
    # onto the CPU: under several GPU processes each would otherwise load it onto the device that saved it
    state = torch.load(checkpoint.state_file, weights_only=False, map_location="cpu")
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
