"""Policy-update throughput: response tokens/s of ``Policy.update`` vs a raw forward+backward of the same batch.

The batch is 8 transitions of 256 tokens (128 prompt + 128 response) on the prepared SmolLM2-135M. The baseline,
measured in the same run on the same model object, is the least a training step must do: one forward pass, the
token logprobs of the batch, their sum, one backward pass. The figure is lit's whole update on the same batch:
micro-batching, token-space logprobs, the LightningRL loss (clipped ratio, optional entropy), gradient
accumulation, clipping and the AdamW step. Both are timed as the median of ``--reps`` runs after a warm-up.
Full fine-tune and LoRA (rank 16) are measured separately.

    .venv/bin/python bench/update_throughput.py [--reps 3]

Target: lit's update >= 85 % of the raw forward+backward tokens/s.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from lit_trainer.algorithm.loss import LossConfig, step_loss
from lit_trainer.intake.episodes import Transition
from lit_trainer.learner.batching import BatchingConfig, MicroBatch, make_micro_batches
from lit_trainer.learner.policy import Policy, PolicyConfig

ROWS, PROMPT, RESPONSE = 8, 128, 128


def make_batch(seed: int = 0) -> list[Transition]:
    rng = random.Random(seed)
    return [
        Transition([rng.randrange(1, 49000) for _ in range(PROMPT)], [rng.randrange(1, 49000) for _ in range(RESPONSE)],
                   [-rng.random() * 3 for _ in range(RESPONSE)], None, "a", f"r{i}", "t", 0, "s")
        for i in range(ROWS)
    ]


def raw_step(policy: Policy, batches: list[MicroBatch]) -> None:
    """Forward, token logprobs, sum, backward: nothing lit adds."""
    model = policy.model
    model.train()
    for mb in batches:
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits  # (B, T, V)
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, mb.input_ids[:, 1:, None])
        (logp[..., 0] * mb.response_mask[:, 1:]).sum().backward()
    model.zero_grad(set_to_none=True)


def median_seconds(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    transitions = make_batch()
    tokens = ROWS * RESPONSE
    rows = []
    for label, config in (
        ("full fine-tune (default)", PolicyConfig()),
        ("full fine-tune, entropy on", PolicyConfig(compute_entropy=True)),
        ("LoRA r=16, entropy off", PolicyConfig(compute_entropy=False, lora_rank=16)),
    ):
        policy = Policy(config)
        batches = make_micro_batches(transitions, [1.0, -1.0] * (ROWS // 2),
                                     BatchingConfig(max_tokens_per_micro_batch=ROWS * (PROMPT + RESPONSE)), pad_id=2)
        raw = median_seconds(lambda p=policy, b=batches: raw_step(p, b), args.reps)
        ours = median_seconds(lambda p=policy, b=batches: p.update(b, step_loss(LossConfig(), b)), args.reps)
        rows.append((label, tokens / ours, tokens / raw))
        print(f"{label}: update {ours:.2f} s, raw forward+backward {raw:.2f} s", flush=True)
    print(f"\n{ROWS}x{PROMPT + RESPONSE}-token transitions ({tokens} response tokens), median of {args.reps}")
    print(f"| {'update':28} | {'lit tok/s':>9} | {'raw fwd+bwd tok/s':>17} | {'ratio':>6} |")
    print(f"|{'-' * 30}|{'-' * 11}|{'-' * 19}|{'-' * 8}|")
    for label, ours, raw in rows:
        print(f"| {label:28} | {ours:9.1f} | {raw:17.1f} | {ours / raw:6.2f} |")
    print("target: ratio >= 0.85")


if __name__ == "__main__":
    main()
