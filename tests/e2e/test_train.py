"""``lit train`` end to end with nothing stood in: real vLLM, real worker processes, real ZeroMQ, real SQLite, the
real policy update and weight sync. The agent (rollout_agents.reply_length_parity) makes real LLM calls and gets a
reward that varies within each group, so every step trains.

One run is killed (SIGKILL) right after its first checkpoint and resumed: the resumed run continues at step 2 with
the same data, writes the final checkpoint, and the weights it pushed into vLLM are the trained ones (the trainer
checks vLLM's logprobs against its own after each sync)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TESTS = Path(__file__).parents[1]

CONFIG = """
model = "{model}"
[agent]
function = "rollout_agents:reply_length_parity"
local_workers = 1
concurrency = 8
max_tokens = 16
[data]
tasks = "rollout_agents:parity_tasks"
train_size = 20
val_size = 4
[train]
steps = 2
tasks_per_step = 2
group_size = 4
val_every = 2
checkpoint_every = 1
check_sync_every = 1
output_dir = "{out}"
[inference]
cpu_kv_cache_gb = 1
[policy]
learning_rate = 1e-5
"""


def test_train_killed_after_a_checkpoint_resumes_and_finishes(prepared_model: Path, tmp_path: Path):
    out = tmp_path / "run"
    config = tmp_path / "config.toml"
    config.write_text(CONFIG.format(model=prepared_model, out=out))
    env = {**os.environ, "PYTHONPATH": str(TESTS), "CI": "true"}
    lit = [sys.executable, "-m", "lit_trainer.cli", "train", str(config)]

    first = subprocess.Popen(lit, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    done = out / "checkpoints" / "step-000001" / "DONE"
    deadline = time.monotonic() + 600
    while not done.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    log1 = first.communicate()[0]
    assert done.exists(), f"no checkpoint after step 1:\n{log1[-3000:]}"
    assert "step 1/2" in log1 and "step 2/2" not in log1, log1[-3000:]

    second = subprocess.run(lit + ["--resume"], env=env, capture_output=True, text=True, timeout=900)
    log2 = second.stdout + second.stderr
    assert second.returncode == 0, log2[-3000:]
    assert "(step 1)" in log2 and "resumed from" in log2
    assert "step 1/2" not in log2 and "step 2/2" in log2

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train][-2:] == [1, 2]
    for r in train:  # every step trained, and vLLM served exactly the weights the trainer had after each sync
        assert r["update/transitions"] > 0 and r["rollouts/failed"] == 0
        assert r["sync/logprob_gap_max"] < 0.02, r
    assert [r["step"] for r in records if r["kind"] == "validation"][-1] == 2
    final = out / "checkpoints" / "step-000002"
    assert (final / "DONE").exists() and (final / "model" / "config.json").exists()
    assert (out / "curve.png").stat().st_size > 0
    state = torch.load(final / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2 and state["optimizer"]["state"], "optimizer state missing"
    trained, base = load_file(final / "model" / "model.safetensors"), load_file(prepared_model / "model.safetensors")
    changed = [k for k in base if k in trained and not torch.equal(base[k], trained[k])]
    assert len(changed) > 0.9 * len(base), f"only {len(changed)} of {len(base)} tensors changed"
