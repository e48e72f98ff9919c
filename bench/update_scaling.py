"""Update scaling from 1 to N trainer processes (learner/distributed.py): the seconds of one training step's update
(``schedule.run_update``: micro-batching, logprobs, loss, backward, the gradients summed across processes, clipping,
AdamW) on the same batch, run by 1 process and by N processes under ``torchrun --nproc_per_node N`` (gloo on CPU).

The batch is a calc-like step on the prepared SmolLM2-135M: 4 groups of 8 rollouts, each group sharing a 192-token
prompt, 48-token responses, with 1024-token micro-batches and gradient checkpointing (the calc config's memory
settings until 2026-11-27; it has 2048-token ones now), so that two processes fit in memory beside everything else.
Each configuration runs in fresh processes: one warm-up update, then the median of ``--reps``; the configurations
alternate for ``--rounds``.
Threads: on a machine of C cores, 1 process gets C threads (what ``lit train`` does) and each of N processes C / N
threads, so every row uses the whole machine; the 1-process, C/N-thread row is the per-process baseline of the same
run. The figure is the speed-up of N processes over
1 process on the same cores; that both take the same update is tests/trainer/learner/test_distributed.py's.

    .venv/bin/python bench/update_scaling.py [--processes 2] [--reps 2] [--rounds 3]

On a CPU machine N processes share its cores, so the speed-up measures the cost of the gradient all-reduce and of
splitting the work more than added hardware; on N GPUs each process has its own device.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

GROUPS, GROUP_SIZE, PROMPT, RESPONSE, BUDGET = 4, 8, 192, 48, 1024


def worker(reps: int, out: Path) -> None:
    import torch

    from lit_trainer.algorithm.loss import LossConfig
    from lit_trainer.intake.episodes import Transition
    from lit_trainer.learner.batching import BatchingConfig
    from lit_trainer.learner.policy import Policy, PolicyConfig
    from lit_trainer.learner.schedule import UpdateConfig, run_update

    torch.manual_seed(0)
    rng = random.Random(0)
    pairs = []
    for g in range(GROUPS):
        prompt = [rng.randrange(1, 49000) for _ in range(PROMPT)]
        for i in range(GROUP_SIZE):
            response = [rng.randrange(1, 49000) for _ in range(RESPONSE)]
            pairs.append((Transition(prompt, response, [-rng.random() * 3 for _ in response], None, "a",
                                     f"r{g}-{i}", f"t{g}", 0, "s"), rng.choice([-1.0, 1.0])))
    policy = Policy(PolicyConfig(gradient_checkpointing=True))
    args = (UpdateConfig(), LossConfig(), BatchingConfig(max_tokens_per_micro_batch=BUDGET), 0)
    times = []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        metrics = run_update(policy, pairs, *args, seed=rep)
        times.append(time.perf_counter() - t0)
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    ranks = [None] * policy.accelerator.num_processes
    if torch.distributed.is_initialized():
        torch.distributed.all_gather_object(ranks, rss_gb)
    else:
        ranks = [rss_gb]
    if policy.accelerator.is_main_process:
        out.write_text(json.dumps({"seconds": statistics.median(times[1:]), "all": times[1:],
                                   "tokens": metrics["policy/response_tokens"], "peak_rss_gb": ranks,
                                   "processes": policy.accelerator.num_processes}))


def measure(processes: int, threads: int, reps: int, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "CI": "true"}
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes)] if processes > 1 else []
    done = subprocess.run([sys.executable, *launcher, __file__, "--worker", "--reps", str(reps), "--out", str(out)],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the {processes}-process run failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.reps, args.out)
    cores = len(os.sched_getaffinity(0))
    per_process = max(cores // args.processes, 1)
    out = Path(f"/tmp/lit-bench-update-scaling-{os.getpid()}.json")
    rows = [("1 process", 1, cores), (f"1 process, {per_process} thread(s) (baseline per process)", 1, per_process),
            (f"{args.processes} processes x {per_process} thread(s)", args.processes, per_process)]
    seconds: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    for round_ in range(args.rounds):  # the rows alternate, so that a change in the machine's load hits them alike
        for name, processes, threads in rows:
            r = measure(processes, threads, args.reps, out)
            seconds[name].append(r["seconds"])
            print(f"round {round_ + 1}  {name:48s} {r['seconds']:7.2f} s/update  "
                  f"{r['tokens'] / r['seconds']:7.1f} response tok/s  "
                  f"peak RSS {'/'.join(f'{g:.2f}' for g in r['peak_rss_gb'])} GB", flush=True)
    out.unlink(missing_ok=True)
    one, many = statistics.median(seconds[rows[0][0]]), statistics.median(seconds[rows[2][0]])
    print(f"speed-up of {args.processes} processes over 1 on the same {cores} cores (medians over {args.rounds} "
          f"rounds): {one / many:.2f}x ({one:.1f} s vs {many:.1f} s per update)")


if __name__ == "__main__":
    main()
