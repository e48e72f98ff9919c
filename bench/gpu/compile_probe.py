"""``policy.compile`` on a GPU: does ``torch.compile`` of the decoder layers shorten lit's bf16 update?

    PYTHONPATH=src python3 bench/gpu/compile_probe.py      # on the GPU machine, after run_on_device.sh's wheels

The agent batch of ``gpu_update.py`` (random-init Qwen2-1.5B, 8 groups x 8 rollouts, 1024-token shared prompts,
256-token responses) through ``Policy.update`` in bf16: eager, then with every decoder layer and the final norm
compiled in place (``nn.Module.compile(dynamic=True)``, so the state dict, the weight sync and the checkpoints see
the same module names), then eager and compiled once more (``learner/compiling.py``'s ``compile_decoder`` and
``uncompile_decoder``: what ``policy.compile`` does). ``torch.compile`` of the whole model would not do: the
learner runs the decoder trunk and the LM head itself (``learner/logprobs.py``), past the model's own forward.
The figures in bench/README.md were taken before the option existed, by the same in-place compilation.
Prints each update's seconds, its loss and the peak memory, and dynamo's graph breaks. bench/README.md has the
figures.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_update as bench

from lit_trainer.algorithm.loss import LossConfig, step_loss
from lit_trainer.learner import compiling
from lit_trainer.learner.policy import Policy, PolicyConfig


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="lit_compile_probe_"))
    bench.save_random_model(bench.QWEN2_1_5B, folder, torch.device("cuda"))
    data = bench.make_transitions(bench.BATCHES["agent"], bench.QWEN2_1_5B.vocab, seed=0)
    policy = Policy(PolicyConfig(model=str(folder), precision="bf16", learning_rate=1e-6))
    model = policy.unwrapped()

    def compiled(on: bool) -> None:
        (compiling.compile_decoder if on else compiling.uncompile_decoder)(model)

    def time_updates(label: str, budget: int, warm: int = 1, reps: int = 3) -> None:
        batches = bench.micro_batches(data, budget, share_prompts=True)
        loss_fn = step_loss(LossConfig(), batches)
        seconds = []
        for _ in range(warm + reps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            metrics = policy.update(batches, loss_fn)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        print(f"{label:8s} {budget}-token micro-batches: warm-up {[round(s, 2) for s in seconds[:warm]]}, timed "
              f"{[round(s, 3) for s in seconds[warm:]]}, loss {metrics['loss/policy']:.5f}, peak "
              f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)

    for budget in (4096, 8192):
        time_updates("eager", budget)
    compiled(True)
    for budget in (4096, 8192):
        time_updates("compiled", budget, warm=2)
    from torch._dynamo.utils import counters
    print(f"graph breaks: {dict(counters['graph_break'])}; unique graphs: {counters['stats'].get('unique_graphs')}")
    compiled(False)
    time_updates("eager", 4096)
    compiled(True)
    time_updates("compiled", 4096)


if __name__ == "__main__":
    main()
