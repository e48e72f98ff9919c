"""LoRA's merged weights (what vLLM and checkpoints get) and the adapter's save/load, on tiny real Llamas made here
(one with tied embeddings, as SmolLM2 has), and once on the prepared SmolLM2."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from lit_trainer.learner import lora

VOCAB = 64
TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def base_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=request.param)
    folder = tmp_path_factory.mktemp("llama-tied" if request.param else "llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def load(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def peft_model(folder: Path, rank: int = 4, targets: list[str] = TARGETS, seed: int = 1) -> torch.nn.Module:
    """A LoRA model whose B matrices are random: a fresh adapter is B = 0, whose merge is the base model."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load(folder), LoraConfig(r=rank, lora_alpha=32, target_modules=targets,
                                                    task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval()


def input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))  # (B, T)


def adapter_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_merged_state_dict_is_merge_and_unload_without_touching_the_model(base_dir: Path):
    model = peft_model(base_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = lora.merged_state_dict(model)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(merged) == set(load(base_dir).state_dict()) == set(expected)
    different = [k for k in expected if not torch.equal(merged[k], expected[k])]
    assert different == []
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])
    assert all(not t.requires_grad for t in merged.values())
    changed = [k for k, v in model.state_dict().items() if not torch.equal(before[k], v)]
    assert changed == [], "merged_state_dict changed the model"
    assert not any(layer.merged for layer in model.modules() if hasattr(layer, "merged_adapters"))
    if load(base_dir).config.tie_word_embeddings:  # still one tensor, as in the base model
        assert merged["lm_head.weight"].data_ptr() == merged["model.embed_tokens.weight"].data_ptr()


def test_merged_weights_give_the_peft_models_logits(base_dir: Path):
    model = peft_model(base_dir)
    plain = load(base_dir)
    with torch.no_grad():
        untrained = plain(input_ids()).logits
        plain.load_state_dict(lora.merged_state_dict(model))
        logits = plain(input_ids()).logits  # (B, T, V)
        expected = model(input_ids()).logits
    assert (expected - untrained).abs().max() > 1e-2, "the adapter should change the logits"
    assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_disabled_adapter_merges_to_the_base_model(base_dir: Path):
    model = peft_model(base_dir)
    base = load(base_dir).state_dict()
    with model.disable_adapter():
        merged = lora.merged_state_dict(model)
    assert all(torch.equal(merged[k], base[k]) for k in base)


def test_save_merged_loads_as_a_plain_model(base_dir: Path, tmp_path: Path):
    model = peft_model(base_dir)
    lora.save_merged(model, tmp_path)
    assert not (tmp_path / lora.ADAPTER_CONFIG).exists()
    reloaded = load(tmp_path)
    assert set(reloaded.state_dict()) == set(load(base_dir).state_dict())
    with torch.no_grad():
        assert_close(reloaded(input_ids()).logits, model(input_ids()).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_lora_on_a_tied_head_is_refused(base_dir: Path):
    model = peft_model(base_dir, targets=[*TARGETS, "lm_head"])
    if not load(base_dir).config.tie_word_embeddings:  # an untied head merges like any linear layer
        assert not torch.equal(lora.merged_state_dict(model)["lm_head.weight"], load(base_dir).lm_head.weight)
        return
    with pytest.raises(ValueError, match="tied weights"):
        lora.merged_state_dict(model)


def test_adapter_saves_and_loads_in_place(base_dir: Path, tmp_path: Path):
    trained = peft_model(base_dir, seed=1)
    lora.save_adapter(trained, tmp_path)
    fresh = peft_model(base_dir, seed=7)
    params = {n: p for n, p in fresh.named_parameters() if "lora_" in n}
    assert any(not torch.equal(p, adapter_weights(trained)[n]) for n, p in params.items())
    lora.load_adapter(fresh, tmp_path)
    loaded = dict(fresh.named_parameters())
    assert all(loaded[n] is p for n, p in params.items()), "load_adapter replaced parameters an optimizer holds"
    saved = adapter_weights(trained)
    assert sorted(saved) == sorted(params)
    assert all(torch.equal(saved[n], loaded[n].detach()) for n in saved)


@pytest.mark.parametrize(("rank", "targets", "field"), [(8, TARGETS, "r"), (4, ["q_proj"], "target_modules")])
def test_load_adapter_refuses_another_rank_or_targets(base_dir: Path, tmp_path: Path, rank: int,
                                                      targets: list[str], field: str):
    lora.save_adapter(peft_model(base_dir), tmp_path)
    other = peft_model(base_dir, rank=rank, targets=targets)
    with pytest.raises(ValueError, match=f"does not fit the policy's.*{field}: saved"):
        lora.load_adapter(other, tmp_path)
    with pytest.raises(FileNotFoundError, match="holds no LoRA adapter"):
        lora.load_adapter(other, tmp_path / "nowhere")


@pytest.mark.slow
def test_smollm2_lora_policy_merges_to_the_base_models_keys(prepared_model: Path, trainer_model: torch.nn.Module):
    from lit_trainer.learner.policy import Policy, PolicyConfig

    policy = Policy(PolicyConfig(model=str(prepared_model), lora_rank=4))
    model = policy.unwrapped()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    merged = lora.merged_state_dict(model)
    assert set(merged) == set(trainer_model.state_dict())
    assert merged["lm_head.weight"].data_ptr() == merged["model.embed_tokens.weight"].data_ptr()
    ids = torch.tensor([[1, 4093, 314, 216, 28, 476, 28, 47]])
    plain = copy.deepcopy(trainer_model)
    plain.load_state_dict(merged)
    with torch.no_grad():
        assert_close(plain(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
