"""``policy.compile`` on a tiny real Llama, on the CPU (inductor builds C++ kernels): the compiled decoder gives the
eager update's numbers, keeps the model's names (what the weight sync and the checkpoints read), works under LoRA
and gradient checkpointing, and the settings that cannot run are refused before anything loads, with the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_precision import batches
from torch.testing import assert_close

from lit_trainer.algorithm.loss import LossConfig, step_loss
from lit_trainer.learner import compiling
from lit_trainer.learner.policy import Policy, PolicyConfig

METRICS = ("loss/policy", "policy/grad_norm", "loss/ratio_mean")


def one_step(config: PolicyConfig, budget: int = 2048) -> tuple[Policy, dict[str, float]]:
    torch.manual_seed(0)
    policy = Policy(config)
    mbs = batches(budget)
    return policy, policy.update(mbs, step_loss(LossConfig(), mbs))


@pytest.mark.parametrize("options", [{}, {"lora_rank": 4, "gradient_checkpointing": True}],
                         ids=["full fine-tune", "LoRA, checkpointed"])
def test_a_compiled_decoder_gives_the_eager_update(tiny_model: Path, options: dict):
    options = {"model": str(tiny_model), "learning_rate": 1e-3, "precision": "fp32", **options}  # bf16 on a GPU
    eager, expected = one_step(PolicyConfig(**options))
    compiled, got = one_step(PolicyConfig(compile=True, **options))
    modules = compiling.decoder_modules(compiled.unwrapped())
    assert len(modules) == 3 and all(m._compiled_call_impl is not None for m in modules)  # 2 layers + the norm
    assert not any(m._compiled_call_impl is not None for m in compiling.decoder_modules(eager.unwrapped()))
    for key in METRICS:
        assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    after, before = compiled.state_dict(), eager.state_dict()
    assert list(after) == list(before)  # the names vLLM and the checkpoints get
    for name in before:
        assert_close(after[name], before[name], rtol=1e-4, atol=1e-5)  # a step moves a weight by ~1e-3
    mbs = batches(seed=7)  # other tokens, without gradients: the compiled no-grad graph
    with torch.no_grad():
        assert_close(compiled.token_logprobs(mbs[0])[0], eager.token_logprobs(mbs[0])[0], rtol=1e-4, atol=1e-5)


def test_compile_is_refused_where_it_cannot_run(tiny_model: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(compiling.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    assert compiling.missing_compiler(torch.device("cuda")) is None  # a GPU's kernels need none
    if not torch.cuda.is_available():  # the learner is on the CPU: refused before the weights load
        refused = r"C\+\+ compiler, and none of g\+\+, c\+\+, clang\+\+ .*`apt install g\+\+`"
        with pytest.raises(ValueError, match=refused):
            Policy(PolicyConfig(model=str(tiny_model), compile=True))
    assert "set policy.compile = false" in compiling.missing_compiler(torch.device("cpu"))
    with pytest.raises(ValueError, match="Linear has no decoder with a list of layers"):
        compiling.decoder_modules(torch.nn.Linear(2, 2))
