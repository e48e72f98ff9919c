"""Memory per trainer process, unsharded and sharded (learner/sharding.py), measured on the prepared SmolLM2-135M.

One optimizer step of a small batch, in 1 process holding the whole model, then in N processes (``torchrun``,
gloo) each holding its shard of the decoder layers. Each process reports the bytes of parameters and AdamW state
it holds after the step (``sharding.local_bytes``; the gradients are freed by the step), what ``learner/memory.py``
planned before loading, and its peak RSS. The figure: bytes per parameter per process, and the ratio of a sharded
process to the unsharded one. What stays whole in every process (the embeddings, tied to the head, and the final
norm: 21 % of SmolLM2-135M) sets how far it can fall.

The load: N processes unsharded, then N sharded, each reports how far its resident memory rose above what it held
after the imports while the policy was built (its peak RSS then, less its RSS before): the whole model read by
each, against each process's share read by each (``learner/sharded_load.py``). Their sums are the figure: what a
node's host memory must hold at start, less the libraries.

    .venv/bin/python bench/shard_memory.py                 # 1 process, then 2 sharded
    .venv/bin/python bench/shard_memory.py --processes 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(shard: bool, out: Path) -> None:
    """One process's part: a policy, one update, its bytes into ``out`` (rank 0 writes, every rank reports)."""
    import accelerate  # noqa: F401  (imported before the baseline: the load is what is measured)
    import torch
    import transformers  # noqa: F401

    from lit_trainer.algorithm.loss import LossConfig
    from lit_trainer.intake.episodes import Transition
    from lit_trainer.learner import sharding
    from lit_trainer.learner.batching import BatchingConfig
    from lit_trainer.learner.policy import Policy, PolicyConfig
    from lit_trainer.learner.schedule import UpdateConfig, run_update

    torch.manual_seed(0)
    before = rss_bytes()
    policy = Policy(PolicyConfig(precision="fp32", learning_rate=1e-6, shard=shard))
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    rng = random.Random(0)
    pairs = []
    for group in range(4):
        prompt = [rng.randrange(100, 40000) for _ in range(64)]
        for k in range(4):
            response = [rng.randrange(100, 40000) for _ in range(16)]
            pairs.append((Transition(prompt, response, [-3.0] * 16, None, "a", f"r{group}{k}", f"t{group}", 0, "s"),
                          1.0 if k % 2 else -1.0))
    run_update(policy, pairs, UpdateConfig(), LossConfig(), BatchingConfig(max_tokens_per_micro_batch=256), 2, 0)
    held = sharding.local_bytes(policy.model, policy.optimizer)
    report = {"rank": policy.accelerator.process_index, "processes": policy.accelerator.num_processes,
              "held_bytes": held, "planned_bytes": policy.memory.weights + policy.memory.optimizer,
              "parameters": policy.memory.parameters, "load_peak_bytes": load_peak,
              "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}
    reports = [None] * report["processes"]
    if report["processes"] > 1:
        torch.distributed.all_gather_object(reports, report)
    else:
        reports = [report]
    if report["rank"] == 0:
        out.write_text(json.dumps(reports))


def rss_bytes() -> int:
    """This process's resident memory now."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def run(processes: int, shard: bool, out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes)] if processes > 1 else []
    command = [sys.executable, *launcher, __file__, "--worker", "--out", str(out)] + (["--shard"] if shard else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shard", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        measure(args.shard, args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        whole = run(1, False, Path(tmp) / "one.json")[0]
        unsharded = run(args.processes, False, Path(tmp) / "unsharded.json")
        sharded = run(args.processes, True, Path(tmp) / "sharded.json")
    params = whole["parameters"]
    print(f"{params / 1e6:.1f}M parameters; bytes of parameters + AdamW state held after one step, per process")
    print(f"{'run':<22} {'rank':>4} {'held GB':>8} {'bytes/param':>11} {'planned GB':>10} {'vs 1 process':>12} "
          f"{'peak RSS GB':>11}")
    for label, rows in (("1 process", [whole]), (f"{args.processes} processes sharded", sharded)):
        for r in rows:
            print(f"{label:<22} {r['rank']:>4} {r['held_bytes'] / 1e9:>8.3f} {r['held_bytes'] / params:>11.2f} "
                  f"{r['planned_bytes'] / 1e9:>10.3f} {r['held_bytes'] / whole['held_bytes']:>12.3f} "
                  f"{r['peak_rss_gb']:>11.2f}")
    plain, cut = (sum(r["load_peak_bytes"] for r in rows) for rows in (unsharded, sharded))
    print(f"\nloading the policy, peak host memory above what the imports took, all {args.processes} processes "
          f"together: {plain / 1e9:.3f} GB unsharded, {cut / 1e9:.3f} GB sharded: {cut / plain:.3f}x "
          f"(per process: {[round(r['load_peak_bytes'] / 1e9, 3) for r in unsharded]} vs "
          f"{[round(r['load_peak_bytes'] / 1e9, 3) for r in sharded]})")


if __name__ == "__main__":
    main()
