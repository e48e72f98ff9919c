"""What a policy holds in memory, planned from the model's config before any weight is read (learner/memory.py),
against what the loaded policy then holds; and a policy too large for its device stopped before loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_precision import batches, train_errors

from lit_trainer.algorithm.loss import LossConfig, step_loss
from lit_trainer.learner import memory
from lit_trainer.learner.policy import Policy, PolicyConfig
from lit_trainer.learner.sharding import local_bytes


def held(policy: Policy) -> dict[str, int]:
    """Bytes the policy holds after one optimizer step, by the plan's parts."""
    mbs = batches()
    policy.update(mbs, step_loss(LossConfig(kl_beta=0.1 if policy.has_reference else 0.0), mbs))
    params = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    state = local_bytes(policy.model, policy.optimizer) - params
    reference = sum(p.numel() * p.element_size() for p in policy.reference.parameters()) if policy.reference else 0
    # the gradients set_to_none after the step: their size is what the trained parameters take in float32
    return {"weights": params, "optimizer": state, "reference": reference,
            "gradients": sum(p.numel() * 4 for p in policy.trainable)}


@pytest.mark.parametrize("settings", [{"precision": "fp32"}, {"precision": "bf16"},
                                      {"precision": "bf16", "lora_rank": 4}, {"precision": "fp32", "lora_rank": 4}])
def test_the_plan_is_what_the_policy_then_holds(settings: dict, tiny_model: Path):
    policy = Policy(PolicyConfig(model=str(tiny_model), **settings), reference=str(tiny_model))
    plan = policy.memory
    assert held(policy) == {"weights": plan.weights, "optimizer": plan.optimizer, "reference": plan.reference,
                            "gradients": plan.gradients}
    assert plan.lora == bool(settings.get("lora_rank")) and (plan.reference > 0) != plan.lora


def test_the_plan_of_a_7b_model_matches_the_capacity_model():
    """Mistral-7B's shape (untied head), from its config alone: 16 bytes per parameter for a full fine-tune, the
    frozen base at 2 bytes under bf16 for LoRA; sharded over 8 processes only the embeddings and head stay whole."""
    from transformers import MistralConfig

    config = MistralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8)
    parameters, layers, adapters = memory.count(config, 16, ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert parameters == 7_241_732_096 and layers == parameters - 2 * 32000 * 4096 - 4096  # embeddings, head, norm
    full = memory.plan(parameters, layers, adapters, precision="bf16", lora=False, reference=False)
    assert full.total == 16 * parameters
    lora = memory.plan(parameters, layers, adapters, precision="bf16", lora=True, reference=False)
    assert lora.weights == 2 * parameters + 4 * adapters and lora.trained == adapters == 32 * 16 * (4 * 4096 + 2 * 5120)
    sharded = memory.plan(parameters, layers, adapters, precision="bf16", lora=False, reference=False, processes=8,
                          sharded=True)
    assert sharded.total == pytest.approx(16 * ((parameters - layers) + layers / 8), rel=1e-9)
    assert sharded.total / full.total < 0.16


def test_a_policy_too_large_for_the_device_names_what_to_change():
    plan = memory.plan(7_000_000_000, 6_500_000_000, 0, precision="fp32", lora=False, reference=True)
    with pytest.raises(memory.PolicyTooLarge, match=r"needs about 140.00 GB .* cpu has 16.00 GB free: it cannot "
                                                    r"fit. Options: shard it across N processes \(policy.shard = "
                                                    r"true.*train LoRA adapters .*kl_beta = 0.*bfloat16"):
        memory.check_fits(plan, 16 * 10**9, torch.device("cpu"))
    sharded = memory.plan(7_000_000_000, 6_500_000_000, 0, precision="fp32", lora=False, reference=True,
                          processes=2, sharded=True)
    with pytest.raises(memory.PolicyTooLarge, match=r"sharded over 2 processes\) needs about 75.00 GB .*main "
                                                    r"process also holds up to 28.00 GB .* Options: train LoRA"):
        memory.check_fits(sharded, 16 * 10**9, torch.device("cpu"))  # sharded already: not offered again
    memory.check_fits(plan, 200 * 10**9, torch.device("cpu"))  # fits: nothing said
    memory.check_fits(plan, None, torch.device("meta"))  # unknown: nothing said


def test_lit_train_stops_before_reading_a_weight_when_the_policy_cannot_fit(tmp_path: Path, prepared_model: Path):
    """A 70B model's config and no weights at all: the plan is all lit needs to refuse it on this machine. (The
    tokenizer, which lit train checks first, is the default model's.)"""
    folder = tmp_path / "llama-70b"
    folder.mkdir()
    shutil.copy(prepared_model / "tokenizer.json", folder)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8}))
    errors = train_errors(folder, tmp_path)
    assert len(errors) == 1 and "needs about 1" in errors[0] and "it cannot fit" in errors[0], errors
    assert "policy.lora_rank" in errors[0]
