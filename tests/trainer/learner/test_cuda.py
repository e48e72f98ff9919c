"""The learner on a real CUDA GPU: skipped without one (CI has none); ``bench/gpu/run_on_device.sh`` runs these on
the lent GPU machine beside the benchmark. Without a GPU, test_device_placement.py checks the same placement on a
simulated second device, and test_precision.py bf16 on the CPU's autocast."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from placement_scenarios import SCENARIOS
from test_device_placement import assert_same, run
from test_precision import batches

from lit_trainer.algorithm.loss import LossConfig, step_loss
from lit_trainer.learner.policy import Policy, PolicyConfig

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu/run_on_device.sh)")]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_training_step_on_cuda_gives_the_cpus_numbers(scenario: str, tiny_model: Path):
    on_gpu = SCENARIOS[scenario](tiny_model, None)  # accelerate puts the policy on the GPU
    on_cpu = run(tiny_model, scenario)[scenario]["cpu"]  # in an interpreter that sees no GPU
    assert on_gpu.pop("device") == "cuda:0" and on_cpu.pop("device") == "cpu"
    assert_same(on_cpu, on_gpu, rel=2e-3)  # other kernels, the same math in float32


def test_auto_precision_is_bf16_on_the_gpu_within_bf16s_gap(tiny_model: Path):
    torch.manual_seed(0)
    auto = Policy(PolicyConfig(model=str(tiny_model), learning_rate=1e-3))
    exact = Policy(PolicyConfig(model=str(tiny_model), precision="fp32"))
    assert auto.precision == "bf16" and auto.device.type == "cuda"
    mbs = batches()
    with torch.no_grad():
        gap = (auto.token_logprobs(mbs[0])[0] - exact.token_logprobs(mbs[0])[0]).abs()
    assert 0 < gap.max() < 0.1
    metrics = auto.update(mbs, step_loss(LossConfig(), mbs))
    assert metrics["policy/grad_norm"] > 0 and all(p.dtype == torch.float32 for p in auto.model.parameters())
    assert torch.backends.cuda.matmul.fp32_precision != "tf32" or not hasattr(torch.backends.cuda.matmul,
                                                                               "fp32_precision")


def test_the_schedules_rate_reaches_the_fused_cuda_optimizer(tiny_model: Path):
    """``policy.lr_schedule`` sets each step's rate with ``Policy.set_learning_rate``; the fused CUDA AdamW must
    take it: at rate 0 (weight decay is scaled by the rate too) a step leaves every weight as it was."""
    torch.manual_seed(0)
    policy = Policy(PolicyConfig(model=str(tiny_model), learning_rate=1e-3))
    assert policy.device.type == "cuda"
    mbs = batches()
    before = [p.detach().clone() for p in policy.trainable]
    policy.set_learning_rate(0.0)
    policy.update(mbs, step_loss(LossConfig(), mbs))
    assert all(torch.equal(a, p) for a, p in zip(before, policy.trainable, strict=True))
    policy.set_learning_rate(1e-3)
    policy.update(mbs, step_loss(LossConfig(), mbs))
    assert any(not torch.equal(a, p) for a, p in zip(before, policy.trainable, strict=True))


@pytest.mark.parametrize("options", [{}, {"lora_rank": 4, "gradient_checkpointing": True}],
                         ids=["full fine-tune", "LoRA, checkpointed"])
def test_a_compiled_decoder_on_the_gpu_gives_the_eager_bf16_update(tiny_model: Path, options: dict):
    """``policy.compile`` where it pays (bench/README.md): the same bf16 update, the layers compiled; under LoRA
    (the frozen base in bfloat16) with every micro-batch recomputed too."""
    from lit_trainer.learner import compiling

    results = []
    for compile_ in (False, True):
        torch.manual_seed(0)
        policy = Policy(PolicyConfig(model=str(tiny_model), learning_rate=1e-3, precision="bf16", compile=compile_,
                                     **options))
        mbs = batches()
        results.append(policy.update(mbs, step_loss(LossConfig(), mbs)))
        assert all((m._compiled_call_impl is not None) == compile_
                   for m in compiling.decoder_modules(policy.unwrapped()))
    eager, compiled = results
    for key in ("loss/policy", "policy/grad_norm"):
        assert compiled[key] == pytest.approx(eager[key], rel=2e-2, abs=1e-4), key  # bf16 kernels may differ


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_fsdp2_on_the_gpu_over_nccl_matches_the_whole_model(tiny_model: Path, compile_: bool):
    from one_rank_shard import check

    check(tiny_model, "cuda:0", "nccl", compile_)  # one rank: NCCL refuses two processes on one GPU
