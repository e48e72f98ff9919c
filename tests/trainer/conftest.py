"""Fixtures for the trainer tests: the consistency check's prompts (the trainer-side copy of the default model and
the shared vLLM server fixture live in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def check_prompts(prepared_model: Path) -> list[list[int]]:
    """The consistency check's fixed prompts, tokenised."""
    from transformers import AutoTokenizer

    from lit_trainer.engine.logprob_check import DEFAULT_PROMPTS

    tokenizer = AutoTokenizer.from_pretrained(prepared_model)
    return [tokenizer(p)["input_ids"] for p in DEFAULT_PROMPTS]
