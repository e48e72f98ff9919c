"""A run that cannot train stops at its first step with the reason on the console, with nothing stood in (real
vLLM, worker, ZeroMQ, SQLite): an agent that raises in every rollout used to run every step of the run, each
printing ``rollouts 0/N (failed N)``, with the reason only in the store; an ``agent.agents`` that names no agent
of the rollouts ran every step training nothing, each printing ``reward -``, with no reason anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TESTS = Path(__file__).parents[1]

CONFIG = """
model = "{model}"
[agent]
function = "rollout_agents:{function}"
agents = {agents}
concurrency = 4
max_tokens = 8
[data]
tasks = "rollout_agents:parity_tasks"
train_size = 8
val_size = 2
[train]
steps = 3
val_every = 0
output_dir = "{out}"
[rollouts]
tasks_per_step = 1
group_size = 2
[inference]
cpu_kv_cache_gb = 1
# vLLM without torch.compile starts about 24 s sooner (bench/vllm_start.py); the compiled default runs in the
# session server (conftest.py), test_server.py's engine-core test and test_train_options.py's lit eval
extra_args = ["--enforce-eager"]
"""


def stops_at_step_1(config: Path) -> str:
    """Run ``lit train config``; the one ``lit: error:`` line it stopped with before its first step's line."""
    env = {**os.environ, "PYTHONPATH": str(TESTS), "CI": "true"}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "train", str(config)], env=env,
                          capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - began
    errors = [line for line in done.stderr.splitlines() if line.startswith("lit: error:")]
    assert done.returncode == 1 and "Traceback" not in done.stderr and len(errors) == 1, done.stderr[-3000:]
    assert "step 1/3" not in done.stdout and "step 2/3" not in done.stdout, done.stdout[-2000:]
    assert "lit_trainer.Playground" in errors[0], errors
    print(f"stopped after {seconds:.0f} s (vLLM's start included): {errors[0]}")
    return errors[0]


def test_a_run_whose_rollouts_all_fail_stops_at_its_first_step_with_the_agents_error(prepared_model: Path,
                                                                                      tmp_path: Path):
    config = tmp_path / "config.toml"
    config.write_text(CONFIG.format(model=prepared_model, out=tmp_path / "run", function="raises", agents="[]"))
    error = stops_at_step_1(config)
    assert error.startswith("lit: error: step 1: all 2 rollouts failed; the first: "), error
    assert "agent bug on purpose" in error, error


def test_a_run_that_trains_an_agent_its_rollouts_do_not_have_stops_with_the_names_they_have(prepared_model: Path,
                                                                                            tmp_path: Path):
    config = tmp_path / "config.toml"
    config.write_text(CONFIG.format(model=prepared_model, out=tmp_path / "run", function="reply_length_parity",
                                    agents='["pairity"]'))  # a typo of the agent's name, "parity"
    error = stops_at_step_1(config)
    assert error.startswith("lit: error: step 1: none of the 2 rollouts gave an episode to train on: 2 gave no "
                            "episode: no LLM call of the selected agents carries token ids (the first: rollout "), error
    assert "its LLM calls are by other agents: 'parity' x1; the agents selected for training (agent.agents): " \
           "'pairity'" in error, error
