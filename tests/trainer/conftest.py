"""Fixtures for the trainer tests: the consistency check's prompts, and a tiny real Llama (random weights, real
transformers model) for update tests that must run in seconds (the trainer-side copy of the default model and the
shared vLLM server fixture live in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY_VOCAB = 64


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def check_prompts(prepared_model: Path) -> list[list[int]]:
    """The consistency check's fixed prompts, tokenised."""
    from transformers import AutoTokenizer

    from lit_trainer.engine.logprob_check import DEFAULT_PROMPTS

    tokenizer = AutoTokenizer.from_pretrained(prepared_model)
    return [tokenizer(p)["input_ids"] for p in DEFAULT_PROMPTS]
