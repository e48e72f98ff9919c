"""``policy.precision`` on a tiny real Llama, on the CPU (whose bf16 autocast is the GPU's, with slower kernels):
fp32 by default here, bf16 autocast over the decoder with float32 master weights, optimizer state, LM head and
log-softmax; a LoRA policy's frozen base in bfloat16, scored in float32 for the weight-sync check; an over-budget
micro-batch recomputed; and the settings that cannot run, refused before anything loads with the fix."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from lit_trainer.algorithm.loss import LossConfig, step_loss
from lit_trainer.engine.logprob_check import trainer_logprobs
from lit_trainer.intake.episodes import Transition
from lit_trainer.learner import logprobs, precision
from lit_trainer.learner.batching import BatchingConfig, make_micro_batches
from lit_trainer.learner.policy import Policy, PolicyConfig

VOCAB = 64  # the tiny_model fixture's (tests/trainer/conftest.py)
TESTS = Path(__file__).parents[2]


def batches(budget: int = 2048, seed: int = 2):
    rng = random.Random(seed)
    prompt = [rng.randrange(1, VOCAB) for _ in range(12)]
    ts = [Transition(prompt, [rng.randrange(1, VOCAB) for _ in range(6 + k)], [-3.0] * (6 + k), None, "a",
                     f"r{k}", "t", 0, "s") for k in range(4)]
    return make_micro_batches(ts, [1.0, -1.0, 0.5, -0.5], BatchingConfig(max_tokens_per_micro_batch=budget), 0)


def test_auto_is_fp32_on_a_cpu_and_an_unknown_precision_is_refused(tiny_model: Path):
    assert precision.resolve("auto", torch.device("cpu")) == "fp32"
    assert Policy(PolicyConfig(model=str(tiny_model))).precision == "fp32"
    with pytest.raises(ValueError, match=r"precision must be one of \('auto', 'fp32', 'bf16'\), got 'fp16'"):
        PolicyConfig(precision="fp16")


def test_bf16_computes_the_decoder_in_bf16_and_keeps_float32_masters_and_head(tiny_model: Path):
    torch.manual_seed(0)
    fp32 = Policy(PolicyConfig(model=str(tiny_model), precision="fp32"))
    bf16 = Policy(PolicyConfig(model=str(tiny_model), precision="bf16", learning_rate=1e-3))
    mbs = batches()
    with torch.no_grad():
        exact, mixed = fp32.token_logprobs(mbs[0])[0], bf16.token_logprobs(mbs[0])[0]
        # the same as the decoder under bf16 autocast, then the float32 head and log-softmax by hand
        base = bf16.unwrapped()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = base.model(input_ids=mbs[0].input_ids).last_hidden_state  # (B, T, H)
        assert hidden.dtype == torch.float32  # the residual stream and the final norm stay float32 under autocast
        with precision.autocast(torch.device("cpu"), "bf16"):
            bf16_trunk = base.model.layers[0].self_attn.q_proj(hidden)
        assert bf16_trunk.dtype == torch.bfloat16  # the decoder's matmuls run in bf16
        by_hand = torch.log_softmax(hidden.float() @ base.lm_head.weight.T, dim=-1)  # (B, T, V) float32
        picked = by_hand[:, :-1].gather(-1, mbs[0].input_ids[:, 1:, None])[..., 0]
        mask = mbs[0].response_mask.bool()
        assert_close(mixed[:, 1:][mask[:, 1:]], picked[mask[:, 1:]], rtol=0, atol=2e-5)
    gap = (mixed - exact).abs()[mask]
    assert 0 < gap.max() < 0.1, gap  # bf16 costs precision, within what the loss's ratios tolerate
    metrics = bf16.update(mbs, step_loss(LossConfig(), mbs))
    assert metrics["policy/grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # master weights
    state = [t for s in bf16.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert state and all(t.dtype == torch.float32 for t in state)  # AdamW moments
    assert all(t.dtype == torch.float32 for t in bf16.state_dict().values())


def test_lora_under_bf16_keeps_the_frozen_base_in_bfloat16_and_is_checked_in_float32(tiny_model: Path):
    torch.manual_seed(0)
    policy = Policy(PolicyConfig(model=str(tiny_model), precision="bf16", lora_rank=4, learning_rate=1e-2),
                    reference=str(tiny_model))
    params = dict(policy.unwrapped().named_parameters())
    assert params["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"].dtype == torch.bfloat16
    assert params["base_model.model.lm_head.weight"].dtype == torch.bfloat16
    assert {p.dtype for p in policy.trainable} == {torch.float32}  # the adapters train in float32
    mbs = batches()
    policy.update(mbs, step_loss(LossConfig(kl_beta=0.1), mbs))
    policy.update(mbs, step_loss(LossConfig(kl_beta=0.1), mbs))  # the adapter is nonzero now: the KL term too
    merged = policy.state_dict()
    # The weight-sync check scores what vLLM was given: the merged weights, computed in float32 ...
    from transformers import AutoModelForCausalLM

    served = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    served.load_state_dict({k: v.float() for k, v in merged.items()})
    prompt, response = [5, 9, 3, 7, 1], [11, 2, 8, 4]
    with policy.in_float32() as model:
        checked = trainer_logprobs(model, prompt, response)
    assert_close(checked, trainer_logprobs(served, prompt, response), rtol=0, atol=1e-5)
    # ... and leaves the base in bfloat16, with no float32 copy kept
    assert params["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"].dtype == torch.bfloat16
    with pytest.raises(RuntimeError):  # without the float32 view: bfloat16 weights meet float32 inputs
        policy.unwrapped().base_model.model.lm_head(torch.zeros(1, 32))


def test_the_reference_of_the_kl_term_lives_in_bfloat16_under_bf16(tiny_model: Path):
    policy = Policy(PolicyConfig(model=str(tiny_model), precision="bf16"), reference=str(tiny_model))
    assert {p.dtype for p in policy.reference.parameters()} == {torch.bfloat16}
    mb = batches()[0]
    ref = policy.reference_logprobs(mb)
    assert ref.dtype == torch.float32 and ref[mb.response_mask.bool()].lt(0).all()


def test_an_over_budget_micro_batch_is_recomputed_and_gives_the_same_step(tiny_model: Path):
    """A micro-batch over the token budget runs with gradient checkpointing (each decoder layer's forward runs
    again in the backward pass); the gradient is the same."""
    grads, calls = [], []
    for budget in (2048, 8):  # the same rows: within the budget, then over it
        torch.manual_seed(0)
        policy = Policy(PolicyConfig(model=str(tiny_model), precision="fp32", max_grad_norm=0.0))
        mbs = batches(budget)
        assert [mb.over_budget for mb in mbs] == [budget == 8]
        calls.append(0)
        handle = policy.unwrapped().model.layers[0].register_forward_pre_hook(
            lambda *_: calls.__setitem__(-1, calls[-1] + 1))
        step, trainable = policy.optimizer.step, policy.trainable
        policy.optimizer.step = lambda params=trainable: grads.append(torch.cat([p.grad.flatten() for p in params]))
        policy.update(mbs, step_loss(LossConfig(), mbs))
        policy.optimizer.step = step
        handle.remove()
    assert calls == [1, 2]
    assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_bf16_where_it_cannot_run_stops_with_the_fix(monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(precision.PrecisionError, match='no bfloat16 autocast on meta: set policy.precision = "fp32"'):
        precision.check("bf16", torch.device("meta"))  # a device kind with no autocast at all
    precision.check("fp32", torch.device("meta"))  # fp32 needs nothing
    precision.check("bf16", torch.device("cpu"))  # torch's CPU autocast runs bf16 (maybe slowly: slow_on)
    # A GPU older than Ampere (a V100, a T4) cannot run here: it is stood in for by what torch would report.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    with pytest.raises(precision.PrecisionError, match="Tesla V100.* compute capability 8.0 or newer.*fp32"):
        precision.check("bf16", torch.device("cuda", 0))
    assert precision.resolve("auto", torch.device("cuda", 0)) == "fp32"


def test_bf16_on_a_cpu_without_native_bfloat16_is_said_to_be_slow():
    warning = precision.slow_on("bf16", torch.device("cpu"))
    x86 = torch.cpu._is_avx2_supported()
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert (warning is not None) == (x86 and not native)
    if warning:
        assert "AVX512-BF16 or AMX" in warning and 'policy.precision = "fp32"' in warning
    assert precision.slow_on("fp32", torch.device("cpu")) is None


def quantized(tiny_model: Path, tmp_path: Path, tokenizer_from: Path) -> Path:
    """The tiny model, marked quantized, with ``tokenizer_from``'s tokenizer: lit train checks that the folder has
    one (vLLM needs it) before the policy reads the config, and stops at the quantization there."""
    folder = tmp_path / "quantized"
    shutil.copytree(tiny_model, folder)
    shutil.copy(tokenizer_from / "tokenizer.json", folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def train_errors(model: Path, tmp_path: Path) -> list[str]:
    """The ``lit: error:`` lines of ``lit train`` on the parity agent with ``model``, which must fail at start (exit
    status 1, no traceback)."""
    config = tmp_path / "config.toml"
    config.write_text(f'model = "{model}"\n[agent]\nfunction = "rollout_agents:reply_length_parity"\n[data]\n'
                      'tasks = "rollout_agents:parity_tasks"\ntrain_size = 8\nval_size = 2\n[train]\n'
                      f'output_dir = "{tmp_path / "run"}"\n[inference]\nmax_model_len = 64\n')  # the tiny model's
    done = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "train", str(config)], capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return [line for line in done.stderr.splitlines() if line.startswith("lit: error:")]


def test_a_quantized_model_stops_lit_train_at_start_in_one_line(tiny_model: Path, tmp_path: Path,
                                                                 prepared_model: Path):
    lines = train_errors(quantized(tiny_model, tmp_path, prepared_model), tmp_path)
    assert len(lines) == 1 and "is quantized (bitsandbytes)" in lines[0] and "unquantized checkpoint" in lines[0]
    assert not (tmp_path / "run" / "lit.sqlite").exists()  # stopped before the store or vLLM started


def test_head_logits_are_float32_whatever_the_head_is_stored_in():
    head = torch.nn.Linear(8, 5, bias=False).to(torch.bfloat16)
    states = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16), precision.float32_head(states.device):  # as in the chunks
        out = logprobs._float32_head(head)(states)
    assert out.dtype == torch.float32
    assert_close(out, states @ head.weight.float().T)
