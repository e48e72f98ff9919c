"""The update across processes (learner/distributed.py): how micro-batches are dealt out, and the acceptance test
of #16: two processes on gloo (``torchrun --nproc_per_node 2``) take the same optimizer steps as one
process on the same batch, through the whole schedule (2 PPO epochs x 2 mini-batches, recomputed old logprobs with
truncated importance sampling, a KL term to a frozen reference)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from lit_trainer.learner.distributed import assign, broadcast, gather, sum_gradients, unsupported_launch

SCRIPT = Path(__file__).with_name("update_across_processes.py")


def test_assign_deals_the_largest_first_to_the_least_loaded():
    # 9 -> 0; 7 -> 1; 5 -> 1 (7 < 9); 3 -> 0 (9 < 12); 1 -> 0 (12 = 12: lowest rank)
    assert assign([5, 9, 1, 7, 3], 2) == [[1, 2, 4], [0, 3]]
    assert assign([4, 4, 4], 1) == [[0, 1, 2]]
    assert assign([2], 3) == [[0], [], []]  # fewer micro-batches than processes: some have none
    assert assign([], 2) == [[], []]


def test_in_one_process_the_collectives_are_the_identity():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    sum_gradients([p])
    assert_close(p.grad, torch.full((3,), 2.0))
    assert gather({"a": 1}) == [{"a": 1}] and broadcast([1, 2]) == [1, 2]


def _run(command: list[str], out: Path, tiny_model: Path, script: bool = True) -> dict:
    """``command`` on update_across_processes.py (``script=False``: ``command`` names it, with its own options)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([*command, *([str(SCRIPT)] if script else []), "--model", str(tiny_model), "--out",
                           str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return torch.load(out, weights_only=False)


def test_two_processes_on_gloo_take_the_same_update_as_one(tiny_model: Path, tmp_path: Path):
    one = _run([sys.executable], tmp_path / "one.pt", tiny_model)
    two = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(SCRIPT), "--save",
                str(tmp_path / "run")], tmp_path / "two.pt", tiny_model, script=False)
    # the main process alone wrote the checkpoint, every tensor whole (the others hold the same)
    written = tmp_path / "run" / "checkpoints" / "step-000001"
    assert len(list((written / "optimizer").glob("*.distcp"))) == 1 and (written / "DONE").exists()
    assert (one["processes"], two["processes"]) == (1, 2)
    assert len(one["grads"]) == len(two["grads"]) == 5  # 2 epochs x 2 mini-batches, then the SFT step
    for g1, g2 in zip(one["grads"], two["grads"], strict=True):
        assert g1.abs().max() > 0
        assert_close(g2, g1, rtol=1e-5, atol=1e-7)  # only the order of the sums differs
    assert set(one["logprobs"]) == set(two["logprobs"]) == set(range(12))
    for i, values in one["logprobs"].items():
        assert_close(torch.tensor(two["logprobs"][i]), torch.tensor(values), rtol=1e-5, atol=1e-6)
    assert one["metrics"].keys() == two["metrics"].keys()
    assert one["metrics"]["sft/tokens"] > 0 and one["metrics"]["sft_step/sft/tokens"] > 0  # [sft]'s term and step
    assert (one["metrics"].pop("update/processes"), two["metrics"].pop("update/processes")) == (1, 2)
    for key, value in one["metrics"].items():
        assert abs(two["metrics"][key] - value) <= 1e-5 * max(1.0, abs(value)), (key, value, two["metrics"][key])
    _same_adam_steps(one["weights"], two["weights"])


def test_sharded_engines_and_mixed_precision_from_accelerate_are_refused_with_the_fix():
    # FSDP and DeepSpeed are set up by accelerate on GPUs only: their refusal is checked here on the names
    assert "Set policy.shard = true and launch with `torchrun" in unsupported_launch("FSDP", "no")
    assert "--use_fsdp / --use_deepspeed" in unsupported_launch("DEEPSPEED", "bf16")
    assert unsupported_launch("MULTI_GPU", "no") is None and unsupported_launch("MULTI_CPU", "no") is None
    assert unsupported_launch("NO", "no") is None


def test_a_policy_under_accelerate_mixed_precision_says_how_to_launch(tiny_model: Path):
    """What ``accelerate launch --mixed_precision bf16`` sets, on a real Policy: refused before the model loads."""
    code = ("from lit_trainer.learner.policy import Policy, PolicyConfig\n"
            f"Policy(PolicyConfig(model={str(tiny_model)!r}))")
    env = {**os.environ, "ACCELERATE_MIXED_PRECISION": "bf16", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "ValueError: accelerate is set up for mixed precision 'bf16'" in done.stderr, done.stderr[-3000:]
    assert "--mixed_precision no" in done.stderr and 'Set policy.precision = "bf16"' in done.stderr


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """A model whose decoder layers dominate its bytes (as a real one's do), updated by 1 process and by 2 sharded
    ones, each writing the checkpoint of that step (``one``, ``two``); then the second step from each checkpoint
    on the other count: 1 process from the sharded checkpoint (``one_from_two``), 2 sharded from the 1-process one
    (``two_from_one``); and on the same: 2 sharded from theirs (``two_from_two``), 1 from 1 (``one_from_one``, the
    reference)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("sharded")
    torch.manual_seed(0)
    model = tmp / "layered"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
                     ).save_pretrained(model)
    sharded = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(SCRIPT), "--shard"]
    runs = {"one": _run([sys.executable, str(SCRIPT), "--save", str(tmp / "run-one")], tmp / "one.pt", model,
                        script=False),
            "two": _run([*sharded, "--save", str(tmp / "run-two")], tmp / "two.pt", model, script=False)}
    one_process = [sys.executable, str(SCRIPT)]
    for name, command, run in (("one_from_two", one_process, "run-two"), ("two_from_one", sharded, "run-one"),
                               ("two_from_two", sharded, "run-two"), ("one_from_one", one_process, "run-one")):
        runs[name] = _run([*command, "--resume", str(tmp / run)], tmp / f"{name}.pt", model, script=False)
    runs["folders"] = {"one": tmp / "run-one", "two": tmp / "run-two"}
    return runs


def _same_adam_steps(w1: dict[str, torch.Tensor], w2: dict[str, torch.Tensor], steps: int = 5) -> None:
    """Weights after ``steps`` AdamW steps of lr 1e-3 from the same start, computed in another order: Adam divides
    by the gradient's magnitude, so an element whose gradient is ~0 may step in either direction; those are
    bounded by the steps' size and are rare, every other element agrees closely."""
    assert w1.keys() == w2.keys()
    for name in w1:
        assert (w2[name] - w1[name]).abs().max() <= steps * 1e-3 * 1.01, name
        assert ((w2[name] - w1[name]).abs() > 1e-6).float().mean() < 1e-3, name


def test_two_sharded_processes_take_the_same_update_as_one_holding_half_each(sharded_runs: dict[str, dict]):
    """The decoder layers sharded across 2 processes on gloo (learner/sharding.py, FSDP2): the same gradients,
    metrics and weights as 1 process through the whole schedule, with the reference sharded too, on the packed
    shared-prompt path; each process holds about half the parameter and AdamW bytes (what stays whole, the
    embeddings and head, is small here)."""
    one, two = sharded_runs["one"], sharded_runs["two"]
    assert (one["processes"], two["processes"]) == (1, 2) and len(one["grads"]) == len(two["grads"]) == 5
    assert one["packed"] and two["packed"]  # sharding keeps learner/logprobs.py's packed path
    for g1, g2 in zip(one["grads"], two["grads"], strict=True):
        assert g1.abs().max() > 0
        assert_close(g2, g1, rtol=1e-5, atol=1e-7)
    for i, values in one["logprobs"].items():
        assert_close(torch.tensor(two["logprobs"][i]), torch.tensor(values), rtol=1e-5, atol=1e-6)
    _same_adam_steps(one["weights"], two["weights"])
    # the weights gathered for vLLM in its serving dtype, cast tensor by tensor
    assert all(torch.equal(two["served"][k], w.to(torch.bfloat16)) for k, w in two["weights"].items())
    ratio = two["bytes"] / one["bytes"]
    assert 0.5 <= ratio < 0.56, (one["bytes"], two["bytes"])  # half the layers' bytes, the embeddings whole
    # what learner/memory.py planned before loading anything: exact whole, within the shards' rounding sharded
    assert one["planned"] == one["bytes"] and abs(two["planned"] - two["bytes"]) <= 0.01 * two["bytes"], (one, two)


def test_a_sharded_checkpoint_resumes_on_one_process_and_the_reverse(sharded_runs: dict[str, dict]):
    """The checkpoint of 2 sharded processes holds the whole model (gathered) and each process's shard of the
    AdamW state by parameter name (learner/checkpoint.py): 1 process continues it as it continues its own, and 2
    sharded processes continue a 1-process checkpoint, and their own, the same way (weights after the second step of
    5 more AdamW steps: within what Adam's order of sums explains)."""
    from safetensors.torch import load_file

    folders = sharded_runs["folders"]
    written = load_file(folders["two"] / "checkpoints" / "step-000001" / "model" / "model.safetensors")
    for name, value in sharded_runs["two"]["weights"].items():
        assert torch.equal(written[name], value), name  # the gathered weights, as pushed to vLLM
    assert len(list((folders["two"] / "checkpoints" / "step-000001" / "optimizer").glob("*.distcp"))) == 2
    reference = sharded_runs["one_from_one"]["weights"]
    assert any(not torch.equal(reference[k], sharded_runs["one"]["weights"][k]) for k in reference)  # it stepped
    _same_adam_steps(reference, sharded_runs["one_from_two"]["weights"], steps=10)
    _same_adam_steps(reference, sharded_runs["two_from_one"]["weights"], steps=10)
    _same_adam_steps(reference, sharded_runs["two_from_two"]["weights"], steps=10)


def test_a_sharded_process_pads_its_share_with_zero_loss_repeats():
    from lit_trainer.learner.sharding import padded_share

    assert padded_share([3, 5], 3) == [(3, True), (5, True), (3, False)]
    assert padded_share([], 2) == [(0, False), (0, False)]  # no micro-batch of its own: it still enters every one
    assert padded_share([1], 1) == [(1, True)]


def test_the_gradient_norm_and_clip_in_one_process_are_torchs():
    from lit_trainer.learner.sharding import clip

    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    params[0].grad, params[1].grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0])
    assert clip(params, 1.0) == 5.0
    assert_close(params[0].grad, torch.tensor([0.6, 0.0, 0.0]), rtol=1e-5, atol=1e-6)
    assert_close(torch.linalg.vector_norm(torch.cat([p.grad for p in params])), torch.tensor(1.0), rtol=1e-5,
                 atol=1e-6)


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_fsdp2_in_a_one_process_group_matches_the_whole_model(tiny_model: Path, compile_: bool):
    from one_rank_shard import check

    check(tiny_model, "cpu", "gloo", compile_)  # test_cuda.py runs the same on a GPU over NCCL
