"""What the learner does with its tensors in a training step, run as-is on the CPU or on a second device
(second_device.py): each scenario builds a policy on the CPU, lets ``move`` put its models on the other device (None:
they stay), runs, and returns plain numbers to compare between the two runs. The micro-batches are always made on
the CPU, as the batching makes them."""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from lit_trainer.algorithm.loss import LossConfig
from lit_trainer.engine.fleet import for_serving
from lit_trainer.engine.logprob_check import trainer_logprobs
from lit_trainer.engine.weight_sync import ShmCheckpoint
from lit_trainer.intake.episodes import Transition
from lit_trainer.learner.batching import BatchingConfig
from lit_trainer.learner.policy import Policy, PolicyConfig
from lit_trainer.learner.schedule import UpdateConfig, run_update

Move = Callable[[torch.nn.Module], None] | None
VOCAB = 64  # the tiny Llama's (tests/trainer/conftest.py)


def pairs(seed: int = 3) -> list[tuple[Transition, float]]:
    """Two GRPO groups of three rows and one row whose prompt and response are over the 48-token budget below."""
    rng = random.Random(seed)
    out = []
    for group, (prompt_len, response_len, size) in enumerate([(6, 5, 3), (9, 4, 3), (40, 12, 1)]):
        prompt = [rng.randrange(1, VOCAB) for _ in range(prompt_len)]
        for k in range(size):
            response = [rng.randrange(1, VOCAB) for _ in range(response_len + k)]
            t = Transition(prompt_ids=prompt, response_ids=response,
                           logprobs=[-rng.uniform(2.0, 5.0) for _ in response], reward=None, agent="a",
                           rollout_id=f"g{group}r{k}", task_id=f"t{group}", index=0, span_id="s",
                           temperature=0.7 if k == 1 else 1.0)
            out.append((t, [1.0, -0.5, 0.25][k]))
    return out


def _step(policy: Policy, loss: LossConfig, update: UpdateConfig, rows: list[tuple[Transition, float]] | None = None
          ) -> dict:
    kept: dict[int, list[float]] = {}
    metrics = run_update(policy, rows or pairs(), update, loss, BatchingConfig(max_tokens_per_micro_batch=48), pad_id=0,
                         seed=1, trainer_logprobs=kept)
    weights = policy.state_dict()
    return {"device": str(policy.device), "metrics": metrics,
            "trainer_logprobs": {str(k): v for k, v in sorted(kept.items())},
            "weights": {name: float(t.detach().double().abs().sum().cpu()) for name, t in weights.items()}}


def full_fine_tune(folder: Path, move: Move) -> dict:
    """Every weight trained, with the KL term to a frozen reference, entropy, recomputed old logprobs with truncated
    importance sampling, two mini-batches, and an over-budget micro-batch (gradient checkpointing)."""
    torch.manual_seed(0)
    policy = Policy(PolicyConfig(model=str(folder), precision="fp32", learning_rate=1e-3, compute_entropy=True),
                    reference=str(folder))
    if move:
        move(policy.model)
        move(policy.reference)
    return _step(policy, LossConfig(kl_beta=0.1, is_correction="truncate"),
                 UpdateConfig(mini_batches=2, recompute_old_logprobs=True))


def bonus_and_guidance(folder: Path, move: Move) -> dict:
    """The entropy bonus (its gradient through the chunked LM head) and a guided row (``rollouts.guidance``: no
    behaviour logprobs, so the learner takes its own before the update) in one full fine-tune step."""
    torch.manual_seed(0)
    policy = Policy(PolicyConfig(model=str(folder), precision="fp32", learning_rate=1e-3))
    if move:
        move(policy.model)
    rows = pairs()
    guided, advantage = rows[3]
    rows[3] = (replace(guided, logprobs=None, guided=True), advantage)
    return _step(policy, LossConfig(entropy_coef=0.05), UpdateConfig(), rows)


def lora(folder: Path, move: Move) -> dict:
    """LoRA adapters with gradient checkpointing in every micro-batch, the KL reference being the base under the
    adapter; the merged weights are what ``state_dict`` gives."""
    torch.manual_seed(0)
    policy = Policy(PolicyConfig(model=str(folder), precision="fp32", learning_rate=1e-2, lora_rank=4,
                                 gradient_checkpointing=True), reference=str(folder))
    if move:
        move(policy.model)
    return _step(policy, LossConfig(kl_beta=0.1), UpdateConfig())


def sync(folder: Path, move: Move) -> dict:
    """What the weight sync does with the policy: its state in vLLM's serving dtype into the shared-memory file
    (written whole, then updated in place), and the trainer's side of the logprob check."""
    torch.manual_seed(0)
    policy = Policy(PolicyConfig(model=str(folder), precision="fp32"))
    if move:
        move(policy.model)
    with policy.in_float32() as model:
        check = trainer_logprobs(model, [5, 9, 3, 7], [11, 2, 8]).tolist()
    sums = {}
    with tempfile.TemporaryDirectory() as tmp:
        shm = ShmCheckpoint(Path(tmp))
        for dtype in ("float32", "float32", "bfloat16"):  # rewritten, updated in place, rewritten in another dtype
            shm.write(for_serving(policy.state_dict(), dtype))
            from safetensors.torch import load_file

            sums[dtype] = sum(float(t.double().abs().sum()) for t in load_file(str(shm.path)).values())
        shm.close()
    return {"device": str(policy.device), "check_logprobs": check, "file_sums": sums}


SCENARIOS = {"full_fine_tune": full_fine_tune, "bonus_and_guidance": bonus_and_guidance, "lora": lora, "sync": sync}
