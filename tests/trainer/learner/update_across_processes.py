"""One training step's update on a fixed batch with the SFT term on a few demonstrations, then an SFT step on them
(``[sft]``), run as one process (``python THIS``) or several (``torchrun --nproc_per_node 2 THIS``), each holding
the whole model or (``--shard``) its shard of the decoder layers: the main process saves every optimizer step's
gradient, the metrics, the trainer's logprobs, the final weights and the bytes of parameters and optimizer state it
held to ``--out`` (torch.save), for test_distributed.py to compare.

``--save DIR``: then write the checkpoint of step 1 into the run folder DIR (learner/checkpoint.py; every process
when sharded). ``--resume DIR``: start from DIR's checkpoint instead (its weights and optimizer state, written by
any number of processes), as ``lit train --resume`` does."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from lit_trainer.algorithm.loss import LossConfig
from lit_trainer.intake.episodes import Transition
from lit_trainer.learner import checkpoint, distributed, logprobs, sharding
from lit_trainer.learner.batching import BatchingConfig
from lit_trainer.learner.policy import Policy, PolicyConfig
from lit_trainer.learner.schedule import UpdateConfig, run_sft, run_update
from lit_trainer.results.runs import RunFolder


def batch(vocab: int, n: int = 12) -> list[tuple[Transition, float]]:
    """``n`` transitions in groups of 4 sharing a prompt (as a GRPO group does), of varied lengths and advantages."""
    rng = random.Random(7)
    pairs = []
    for i in range(n):
        if i % 4 == 0:
            prompt = [rng.randrange(1, vocab) for _ in range(rng.randrange(4, 12))]
        response = [rng.randrange(1, vocab) for _ in range(rng.randrange(2, 10))]
        t = Transition(prompt_ids=prompt, response_ids=response, logprobs=[-rng.uniform(2.0, 5.0) for _ in response],
                       reward=None, agent="a", rollout_id=f"r{i}", task_id=f"t{i // 4}", index=0, span_id="s",
                       finish_reason="stop")
        pairs.append((t, rng.choice([-1.5, -0.5, 0.5, 1.0])))
    return pairs


def demonstrations(vocab: int, n: int = 3) -> list[Transition]:
    """``n`` demonstrations (a reference's tokens: no behaviour logprobs) of varied lengths."""
    rng = random.Random(11)
    return [Transition(prompt_ids=[rng.randrange(1, vocab) for _ in range(rng.randrange(4, 10))],
                       response_ids=[rng.randrange(1, vocab) for _ in range(rng.randrange(3, 8))], logprobs=None,
                       reward=None, agent="a", rollout_id=f"d{i}", task_id=f"d{i}", index=0, span_id="s",
                       finish_reason="stop") for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shard", action="store_true")
    parser.add_argument("--save")
    parser.add_argument("--resume")
    args = parser.parse_args()
    torch.manual_seed(0)
    start = RunFolder(args.resume).latest_checkpoint() if args.resume else None
    policy = Policy(PolicyConfig(model=str(start.model_dir) if start else args.model, learning_rate=1e-3,
                                 shard=args.shard), reference=args.model)
    if start:
        checkpoint.restore(start, policy)
    grads: list[torch.Tensor] = []
    step = policy.optimizer.step

    def capture(*a, **kw):  # every process: gathering the sharded gradients is a collective
        whole = [p.grad.full_tensor() if sharding.is_sharded(p.grad) else p.grad for p in policy.trainable]
        grads.append(torch.cat([g.flatten() for g in whole]).clone())
        return step(*a, **kw)

    policy.optimizer.step = capture
    trained_logprobs: dict[int, list[float]] = {}
    vocab, batching = policy.unwrapped().config.vocab_size, BatchingConfig(max_tokens_per_micro_batch=48)
    metrics = run_update(policy, batch(vocab), UpdateConfig(ppo_epochs=2, mini_batches=2, recompute_old_logprobs=True),
                         LossConfig(kl_beta=0.05, is_correction="truncate"), batching, pad_id=0, seed=3,
                         trainer_logprobs=trained_logprobs, demos=demonstrations(vocab), sft_weight=0.5)
    metrics |= {f"sft_step/{k}": v for k, v in run_sft(policy, demonstrations(vocab), batching, pad_id=0).items()}
    weights = {k: v.clone() for k, v in policy.state_dict().items()}  # sharded: a collective
    served = policy.state_dict(torch.bfloat16)  # sharded: cast as gathered (vLLM's serving dtype)
    if args.save and (policy.sharded or policy.accelerator.is_main_process):  # as lit train calls it (loop.py)
        checkpoint.save(args.save, policy, Path(args.model), checkpoint.TrainState(step=1))
    if policy.accelerator.is_main_process:
        torch.save({"grads": grads, "metrics": metrics, "logprobs": trained_logprobs,
                    "processes": policy.accelerator.num_processes, "weights": weights, "served": served,
                    "packed": (logprobs._trunk_and_head(policy.unwrapped()) or (None, None, False))[2],
                    "bytes": sharding.local_bytes(policy.model, policy.optimizer),
                    "planned": policy.memory.weights + policy.memory.optimizer}, args.out)
    distributed.leave()  # every rank waits for the main one's file, then leaves the group, as lit train does


if __name__ == "__main__":
    main()
