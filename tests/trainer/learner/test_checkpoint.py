"""Checkpoints on the tiny real Llama (conftest.py): a LoRA run's checkpoint holds the merged model (a plain Hugging
Face model) and the adapter, and resumes into a policy built from the base model with the same adapter and
optimizer state; a full fine-tune's is unchanged; the two kinds are not mixed up."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from lit_trainer.learner import checkpoint as ckpt
from lit_trainer.learner.policy import Policy, PolicyConfig
from lit_trainer.results.runs import resolve_checkpoint

VOCAB = 64  # the tiny_model fixture's (conftest.py)


def input_ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))  # (B, T)


def train_step(policy: Policy) -> None:
    """One optimizer step on a stand-in loss: moves every trainable weight and fills the optimizer state."""
    policy.model.train()
    policy.optimizer.zero_grad(set_to_none=True)
    logits = policy.model(input_ids=input_ids()).logits  # (B, T, V)
    policy.accelerator.backward(torch.log_softmax(logits, -1)[..., 3].mean())
    policy.optimizer.step()


def trained(config: PolicyConfig, steps: int = 2) -> Policy:
    torch.manual_seed(0)
    policy = Policy(config)
    for _ in range(steps):  # LoRA's B starts at 0, so A gets no gradient on the first step
        train_step(policy)
    return policy


def trainable(policy: Policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.unwrapped().named_parameters() if p.requires_grad}


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=input_ids()).logits  # (B, T, V)


@pytest.fixture
def lora_config(tiny_model: Path) -> PolicyConfig:
    return PolicyConfig(model=str(tiny_model), lora_rank=4, learning_rate=1e-2)


def test_lora_checkpoint_holds_the_merged_model_and_resumes_the_adapter(lora_config: PolicyConfig, tmp_path: Path,
                                                                        tiny_model: Path):
    from transformers import AutoModelForCausalLM

    policy = trained(lora_config)
    saved = ckpt.save(tmp_path, policy, tiny_model, ckpt.TrainState(step=2, minutes=1.5))
    found = resolve_checkpoint(tmp_path)
    assert found == saved and found.adapter_dir == found.path / "adapter"
    assert (found.adapter_dir / "adapter_config.json").exists()
    assert not (found.model_dir / "adapter_config.json").exists(), "model/ must be a plain model, not an adapter"

    merged = AutoModelForCausalLM.from_pretrained(found.model_dir, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert set(merged.state_dict()) == set(base.state_dict())
    expected = logits(policy.unwrapped())
    assert (expected - logits(base)).abs().max() > 1e-3, "training should have moved the model"
    assert_close(logits(merged), expected, atol=1e-5, rtol=1e-5)

    torch.manual_seed(123)  # a different init: restore must overwrite it
    fresh = Policy(lora_config)
    state = ckpt.restore(found, fresh)
    assert state == ckpt.TrainState(step=2, minutes=1.5)
    adapters, restored = trainable(policy), trainable(fresh)
    assert sorted(adapters) == sorted(restored)
    assert all(torch.equal(adapters[n], restored[n]) for n in adapters)
    # The same optimizer state: one more step from each gives the same weights.
    train_step(policy)
    train_step(fresh)
    after, after_fresh = trainable(policy), trainable(fresh)
    assert all(torch.equal(after[n], after_fresh[n]) for n in after)


def test_full_checkpoint_has_no_adapter_and_restores(tiny_model: Path, tmp_path: Path):
    config = PolicyConfig(model=str(tiny_model), learning_rate=1e-2)
    policy = trained(config, steps=1)
    base = tmp_path / "base"  # the tiny model with a sentencepiece tokenizer's file (it has none of its own)
    base.mkdir()
    (base / "tokenizer.model").write_bytes(b"sentencepiece model bytes")
    (base / "tokenizer_config.json").write_text("{}")
    found = ckpt.save(tmp_path / "run", policy, base, ckpt.TrainState(step=1))
    assert found.adapter_dir is None
    # the tokenizer goes with the weights, so that lit eval --checkpoint and vLLM can serve the folder
    assert (found.model_dir / "tokenizer.model").read_bytes() == b"sentencepiece model bytes"
    assert (found.model_dir / "tokenizer_config.json").exists()
    resumed = Policy(replace(config, model=str(found.model_dir)))
    ckpt.restore(found, resumed)
    train_step(policy)
    train_step(resumed)
    after, after_resumed = trainable(policy), trainable(resumed)
    assert all(torch.equal(after[n], after_resumed[n]) for n in after)


def test_lora_and_full_checkpoints_are_not_mixed_up(lora_config: PolicyConfig, tiny_model: Path, tmp_path: Path):
    lora_ckpt = ckpt.save(tmp_path / "lora", trained(lora_config, steps=1), tiny_model, ckpt.TrainState(step=1))
    full_config = replace(lora_config, lora_rank=0)
    full_ckpt = ckpt.save(tmp_path / "full", trained(full_config, steps=1), tiny_model, ckpt.TrainState(step=1))
    with pytest.raises(ValueError, match="LoRA run's checkpoint .* policy.lora_rank = 0"):
        ckpt.restore(lora_ckpt, Policy(full_config))
    with pytest.raises(ValueError, match="full fine-tune's checkpoint .* policy.lora_rank = 4"):
        ckpt.restore(full_ckpt, Policy(lora_config))
    with pytest.raises(ValueError, match="adapter merged in: build it from the run's base model"):
        ckpt.restore(lora_ckpt, Policy(replace(lora_config, model=str(lora_ckpt.model_dir))))
    with pytest.raises(ValueError, match="r: saved 4, model 8"):
        ckpt.restore(lora_ckpt, Policy(replace(lora_config, lora_rank=8)))


def test_room_needed_counts_the_checkpoints_kept_and_the_one_being_written():
    assert ckpt.size_estimate(100, 100) == 1200 and ckpt.size_estimate(100, 3) == 424  # float32 model + AdamW
    assert ckpt.saves_left(0, 40, 5) == 8  # 5, 10, ..., 40
    assert ckpt.saves_left(0, 42, 5) == 9  # and the last step
    assert ckpt.saves_left(12, 20, 5) == 2 and ckpt.saves_left(0, 3, 0) == 1 and ckpt.saves_left(40, 40, 5) == 0
    assert ckpt.room_needed(10, keep=2, existing=0, saves=8) == 30  # two kept + the one being written
    assert ckpt.room_needed(10, keep=2, existing=2, saves=1) == 10
    assert ckpt.room_needed(10, keep=2, existing=0, saves=1) == 10
    assert ckpt.room_needed(10, keep=0, existing=1, saves=3) == 30  # all kept
    assert ckpt.room_needed(10, keep=1, existing=3, saves=2) == 10  # fewer kept than now: the first save still
    assert ckpt.room_needed(10, keep=2, existing=1, saves=0) == 0


def test_check_room_refuses_a_run_whose_first_checkpoint_cannot_fit_and_warns_when_all_may_not(tmp_path: Path):
    import shutil

    from lit_trainer.results.runs import RunFolder

    run = RunFolder(tmp_path)
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ckpt.NoRoomForCheckpoint, match=r"one checkpoint of this policy takes about .* GB .* "
                                                       r"choose a train.output_dir on a larger disk"):
        ckpt.check_room(run, free + 10**12, keep=2, saves=1)
    assert ckpt.check_room(run, 10**6, keep=2, saves=8) is None
    warning = ckpt.check_room(run, free // 2, keep=2, saves=8)  # 3 at the peak: 1.5 x the free space
    assert warning is not None and "keeps the newest 2 (train.keep_checkpoints)" in warning
    assert "8 more checkpoints" in warning and "lower train.keep_checkpoints" in warning
    assert ckpt.check_room(run, free + 10**12, keep=2, saves=0) is None  # writes none


SAVE_OVER_A_FILE_SIZE_LIMIT = """
import json, resource, signal, sys
from pathlib import Path
from lit_trainer.learner import checkpoint as ckpt
from lit_trainer.learner.policy import Policy, PolicyConfig
out, model, limit = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
policy = Policy(PolicyConfig(model=str(model)))
ckpt.save(out, policy, model, ckpt.TrainState(step=1))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG instead of a kill
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
try:
    ckpt.save(out, policy, model, ckpt.TrainState(step=2))
except ckpt.NoRoomForCheckpoint as exc:
    print(json.dumps({"error": str(exc)}))
"""


@pytest.mark.parametrize("limit", [20_000, 150_000], ids=["model-file", "optimizer-file"])
def test_a_save_that_runs_out_of_room_removes_its_folder_and_says_what_to_do(tiny_model: Path, tmp_path: Path,
                                                                            limit: int):
    """A real write failure: the save runs in a process whose files may not grow past ``limit`` bytes
    (RLIMIT_FSIZE; to the writer that is a full disk: the OS refuses the write), after a first checkpoint written
    without the limit. The tiny model's weights (93 kB, safetensors) fail at 20 kB; at 150 kB they fit and the
    optimizer state (281 kB, torch.distributed.checkpoint, whose error is a BaseException) fails."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SAVE_OVER_A_FILE_SIZE_LIMIT, str(tmp_path), str(tiny_model),
                           str(limit)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    error = json.loads(done.stdout.strip().splitlines()[-1])["error"]
    assert "the checkpoint of step 2 did not fit on the disk" in error and "File too large" in error
    assert "The latest complete checkpoint (step 1) and the store of every rollout are intact" in error
    assert "`lit train CONFIG --resume`" in error
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001"]  # no .tmp- left
    assert resolve_checkpoint(tmp_path).step == 1


def test_a_resume_onto_another_model_stops_before_vllm_starts_naming_what_differs(tiny_model: Path, tmp_path: Path,
                                                                                  prepared_model: Path):
    """A config whose ``model`` changed between a run and its ``--resume`` used to fail once vLLM was up, at the
    first weight push (full fine-tune) or the adapter's load (LoRA)."""
    policy = trained(PolicyConfig(model=str(tiny_model)), steps=1)
    found = ckpt.save(tmp_path / "run", policy, tiny_model, ckpt.TrainState(step=1))
    assert ckpt.other_model(found, tiny_model) is None
    terse = tmp_path / "terse"  # the same model, its config written by hand without the keys it leaves at default
    terse.mkdir()
    config = json.loads((tiny_model / "config.json").read_text())
    (terse / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "num_key_value_heads"}))
    assert ckpt.other_model(found, terse) is None
    other = tmp_path / "other"  # the tiny model grown: wider and one layer deeper, with a tokenizer
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 48, "num_hidden_layers": 3}))
    shutil.copy(prepared_model / "tokenizer.json", other)
    words = (f"{found.path} was trained from another model than model = '{other}' (hidden_size 32 there, 48 here; "
             "num_hidden_layers 2 there, 3 here): resume with the model the run started from, or choose another "
             "train.output_dir for this one")
    assert ckpt.other_model(found, other) == words
    toml = tmp_path / "config.toml"
    toml.write_text(f'model = "{other}"\n[agent]\nfunction = "rollout_agents:reply_length_parity"\n[data]\n'
                    f'tasks = "rollout_agents:parity_tasks"\n[train]\noutput_dir = "{tmp_path / "run"}"\n')
    done = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "train", str(toml), "--resume",
                           "inference.max_model_len=64"],  # the tiny model's length
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == f"lit: error: {words}", done.stderr
    assert "starting vLLM" not in done.stderr and "lit: the policy" not in done.stderr
