"""Fixtures for the trainer tests that need the real vLLM server: ONE server for the whole session (start-up takes
about a minute on 2 cores), and the trainer-side copy of the same model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def live_group_members(pgid: int) -> list[int]:
    """Pids of the processes (zombies excluded) still in process group ``pgid``."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, group = fields[0], int(fields[2])
        if group == pgid and state != "Z":
            alive.append(int(stat.parent.name))
    return alive


@pytest.fixture(name="live_group_members")
def live_group_members_fixture():
    """``live_group_members(pgid)``: the pids still alive in a process group."""
    return live_group_members


@pytest.fixture(scope="session")
def vllm_server(prepared_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """A running lit-managed vLLM server on the default model; gone (whole process group) after the session."""
    from lit_trainer.config import InferenceConfig
    from lit_trainer.inference import InferenceServer

    config = InferenceConfig(model=str(prepared_model), log_dir=str(tmp_path_factory.mktemp("vllm-logs")))
    with InferenceServer(config) as server:
        pgid = server.process.pid
        yield server
    assert live_group_members(pgid) == [], f"vLLM processes survived the fixture: {live_group_members(pgid)}"
    assert os.path.exists(server.log_path)


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

    from lit_trainer.logprob_check import DEFAULT_PROMPTS

    tokenizer = AutoTokenizer.from_pretrained(prepared_model)
    return [tokenizer(p)["input_ids"] for p in DEFAULT_PROMPTS]
