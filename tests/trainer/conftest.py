"""Fixtures for the trainer tests: the trainer-side copy of the default model and the consistency check's prompts
(the shared vLLM server fixture lives in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def trainer_model(prepared_model: Path):
    """The default model loaded with transformers in float32, as the trainer holds it."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(prepared_model, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def check_prompts(prepared_model: Path) -> list[list[int]]:
    """The consistency check's fixed prompts, tokenised."""
    from transformers import AutoTokenizer

    from lit_trainer.engine.logprob_check import DEFAULT_PROMPTS

    tokenizer = AutoTokenizer.from_pretrained(prepared_model)
    return [tokenizer(p)["input_ids"] for p in DEFAULT_PROMPTS]
