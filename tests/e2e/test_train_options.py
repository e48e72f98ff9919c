"""Every update option end to end in ``lit train``, with nothing stood in (real vLLM, worker, ZeroMQ, SQLite): the
config is accepted, 3 steps train and sync (vLLM's logprobs checked against the trainer's after every sync), a
checkpoint is written, ``--resume`` continues to step 4, and ``lit eval --checkpoint`` serves the result.

- LoRA with a KL term: the adapter trains, merged weights reach vLLM, the reference is the base under the adapter,
  the checkpoint is a plain model for ``lit eval`` and resumes as base + adapter; the TensorBoard tracker logs
  every step, the resumed one too.
- Full fine-tune with every schedule option: KL to a frozen copy, 2 PPO epochs x 2 mini-batches, recomputed old
  logprobs with truncated importance sampling, overlong responses masked, the ``kept`` normaliser.

Both sample at temperature 0.7: the trainer's logprobs of the sampled tokens must match vLLM's (the first optimizer
step of a training step sees the weights that sampled)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TESTS = Path(__file__).parents[1]

CONFIG = """
model = "{model}"
[agent]
function = "rollout_agents:reply_length_parity"
concurrency = 8
max_tokens = 16
temperature = 0.7
[data]
tasks = "rollout_agents:parity_tasks"
train_size = 20
val_size = 4
[train]
steps = 3
tasks_per_step = 2
group_size = 4
val_every = 0
checkpoint_every = 1
check_sync_every = 1
output_dir = "{out}"
[policy]
learning_rate = 1e-5
"""

OPTIONS = {
    "lora_kl": ["policy.lora_rank=8", "policy.learning_rate=1e-4", "loss.kl_beta=0.05",
                "train.trackers=['tensorboard']"],
    "ppo_schedule": ["loss.kl_beta=0.05", "update.ppo_epochs=2", "update.mini_batches=2",
                     "update.recompute_old_logprobs=true", "loss.is_correction='truncate'", "update.overlong='mask'",
                     "loss.normalizer='kept'"],
}


def _lit(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(TESTS), "CI": "true"}
    return subprocess.run([sys.executable, "-m", "lit_trainer.cli", *args], env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_option_trains_syncs_checkpoints_resumes_and_evaluates(name: str, prepared_model: Path, tmp_path: Path):
    out = tmp_path / "run"
    config = tmp_path / "config.toml"
    config.write_text(CONFIG.format(model=prepared_model, out=out))
    options = OPTIONS[name]

    first = _lit("train", str(config), *options)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    resumed = _lit("train", str(config), *options, "train.steps=4", "--resume")
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log[-3000:]
    assert "resumed from" in log and "step 4/4" in log and "step 3/4" not in log

    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert r["sync/logprob_gap_max"] < 0.02, r  # vLLM serves the weights the trainer has
        assert r["rollouts/failed"] == 0
        if r.get("update/transitions"):
            assert "loss/kl" in r and r["policy/grad_norm"] > 0, r
    trained = [r for r in train if r.get("update/transitions")]
    assert trained, "no step had a group with differing rewards"
    if name == "lora_kl":
        # One optimizer step per training step on the weights that sampled: the tempered logprobs agree.
        gaps = [r["policy/vllm_logprob_gap"] for r in trained]
        assert max(gaps) < 0.01, gaps
    else:
        assert all(r["update/optimizer_steps"] >= 2 for r in trained) and all("mismatch/k3" in r for r in trained)
        assert any(r["loss/kl"] > 0 for r in trained[1:] or trained)

    result_file = tmp_path / "eval.json"
    # an override after the options, as people type it
    evaluated = _lit("eval", str(config), "--checkpoint", str(out), "--output", str(result_file),
                     f"train.output_dir={tmp_path / 'eval'}")
    assert evaluated.returncode == 0, (evaluated.stdout + evaluated.stderr)[-3000:]
    result = json.loads(result_file.read_text())
    assert result["model"].endswith("step-000004/model") and result["tasks"] == 4 and result["step"] == 4
    assert (tmp_path / "eval" / "eval.jsonl").exists()
    assert f"checkpoint {out / 'checkpoints' / 'step-000004'} (step 4): accuracy" in evaluated.stdout, evaluated.stdout
    if "train.trackers=['tensorboard']" in OPTIONS[name]:  # the tracker logged every step, the resumed one too
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        steps = set()
        for events_file in (out / "lit").glob("events.out.tfevents.*"):  # accelerate's run "lit" in output_dir
            events = EventAccumulator(str(events_file))
            events.Reload()
            steps |= {e.step for e in events.Scalars("train/reward/mean")}
        assert steps == {1, 2, 3, 4}, steps

