"""Fixtures shared by all test folders: the prepared default model, its trainer-side copy, and ONE vLLM server for
the whole session (start-up takes about a minute on 2 cores)."""

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def prepared_model():
    """The default model's folder, prepared once in the user's cache (later runs find it ready)."""
    from lit_trainer.models import prepare_default_model

    return prepare_default_model().path


@pytest.fixture(scope="session")
def trainer_model(prepared_model: Path):
    """The default model loaded with transformers in float32, as the trainer holds it."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(prepared_model, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def vllm_server(prepared_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """A running lit-managed vLLM server on the default model; gone (whole process group) after the session."""
    from lit_trainer.engine.config import InferenceConfig
    from lit_trainer.engine.server import InferenceServer

    # 1 GiB of KV cache (23k tokens) is plenty here, and this server lives through tests that start a vLLM of their
    # own: on a 24 GB machine the default 2 GiB for each got one of them OOM-killed
    config = InferenceConfig(model=str(prepared_model), log_dir=str(tmp_path_factory.mktemp("vllm-logs")),
                             cpu_kv_cache_gb=1)
    with InferenceServer(config) as server:
        pgid = server.process.pid
        yield server
    from lit_sdk.processes import group_members

    assert group_members(pgid) == [], f"vLLM processes survived the fixture: {group_members(pgid)}"
    assert os.path.exists(server.log_path)


@pytest.fixture
def vllm_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's Python modules importable in this process, for the few tests of lit code that runs beside vLLM's own
    classes (its middleware, its GPU weight-transfer engines). lit keeps vLLM in an environment of its own
    (``vllm_python``: run.sh's ``.venv/vllm``), so its site-packages go at the END of ``sys.path``: this
    environment's packages win wherever both have one. Fails, never skips, when no vLLM can be found."""
    import importlib.util
    import subprocess
    import sys

    from lit_trainer.engine.config import InferenceConfig
    from lit_trainer.engine.launch import vllm_python

    if importlib.util.find_spec("vllm") is not None:
        return
    python = vllm_python(InferenceConfig())
    probe = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    site = out.stdout.strip()
    if out.returncode != 0 or not Path(site, "vllm").is_dir():
        pytest.fail(f"vLLM is not installed for {python} (run.sh installs it in .venv/vllm)")
    monkeypatch.setattr(sys, "path", [*sys.path, site])
