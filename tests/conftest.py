"""Fixtures shared by all test folders: the prepared default model, its trainer-side copy, and ONE vLLM server for
the whole session (start-up takes about a minute on 2 cores). And how the suite is shared between pytest-xdist
workers (``bash run.sh test`` runs two: ``pytest_collection_modifyitems``)."""

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


SHARES = {
    "tests/trainer/engine/test_weight_sync.py": "vllm-server",
    "tests/trainer/engine/test_server.py": "vllm-server",
    "tests/e2e/test_intake_on_vllm.py": "vllm-server",
    "tests/e2e/test_chaos.py": "vllm-server",
}
"""Modules run by one worker, one after the other: those of the session's ``vllm_server`` (started once, not once
per worker) and those that SIGKILL a vLLM, with the chaos run, which checks that no vLLM left shared memory behind
(a vLLM killed by a test beside it would)."""

LONGEST_FIRST = ("test_train_options.py::test_option_trains_syncs_checkpoints_resumes_and_evaluates[lora_kl]",
                 "vllm-server",
                 "test_train_options.py::test_option_trains_syncs_checkpoints_resumes_and_evaluates[ppo_schedule]",
                 "test_notebooks.py::test_notebook_runs_and_shows_a_plot_and_the_rollout_viewer[quickstart.ipynb]",
                 "test_notebooks.py::test_notebook_runs_and_shows_a_plot_and_the_rollout_viewer[custom_agent.ipynb]",
                 "tests/trainer/learner/test_distributed.py")
"""The shares that take minutes (the ``--durations`` of a full run), handed out first so that none starts last."""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup``, each test's share (``xdist_group``): its module's (a module's fixtures then run
    once), a test of its own for the long parametrized ones, or one of ``SHARES``; the longest shares first. The
    workers take the shares in this order (``--no-loadscope-reorder``), each the next one when it is free."""
    if config.getoption("dist", "no") != "loadgroup":
        return

    def share(item: pytest.Item) -> str:
        module = item.nodeid.split("::")[0]
        if module in SHARES:
            return SHARES[module]
        return next((name for name in LONGEST_FIRST if item.nodeid.endswith(name)), module)

    for item in items:
        item.add_marker(pytest.mark.xdist_group(share(item)))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(share(item), len(rank)))  # stable: the rest keep their order
