"""Peak resident memory of every process of a ``lit train`` run, and its update seconds per step.

Starts ``lit train CONFIG OVERRIDES...`` in a fresh output folder, samples the resident set (RSS) of the trainer
and of every process it starts (vLLM's API server and engine core, the agent worker) twice a second with psutil,
and prints each process's peak with the run's ``time/update`` per step from its metrics.jsonl.

    .venv/bin/python bench/run_memory.py examples/calc/config.toml train.steps=4 train.val_every=0

A process's RSS counts the pages it has touched, shared ones (the model file mapped by vLLM, shared libraries)
included, so the peaks of several processes do not add up to the machine's use.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil


def label(proc: psutil.Process) -> str:
    """A short name for one process of the run."""
    try:
        cmd = " ".join(proc.cmdline())
        name = proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"
    if "vllm.entrypoints" in cmd:
        return "vLLM API server"
    if "EngineCore" in name or "EngineCore" in cmd:
        return "vLLM engine core"
    if "VLLM" in name:
        return f"vLLM {name}"
    if "multiprocessing" in cmd or "lit_sdk" in cmd:
        return "agent worker"
    return f"{name}: {cmd[:60]}".replace("\n", " ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--lit", default=str(Path(sys.executable).with_name("lit")), help="the lit command")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="lit-memory-"))
    cmd = [args.lit, "train", args.config, *args.overrides, f"train.output_dir={out}"]
    print("running:", " ".join(cmd), flush=True)
    root = subprocess.Popen(cmd)
    trainer = psutil.Process(root.pid)
    peaks: dict[int, float] = {}
    names: dict[int, str] = {}
    while root.poll() is None:
        try:
            procs = [trainer, *trainer.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for proc in procs:
            try:
                rss = proc.memory_info().rss / 2**30
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            names[proc.pid] = "trainer" if proc.pid == root.pid else label(proc)  # a process may rename itself
            peaks[proc.pid] = max(peaks.get(proc.pid, 0.0), rss)
        time.sleep(0.5)
    if root.returncode:
        sys.exit(f"lit train failed with exit code {root.returncode}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    updates = [r["time/update"] for r in records if r.get("kind") == "train" and "time/update" in r]
    print("\n| process | peak RSS (GiB) |\n|---|---|")
    for pid, peak in sorted(peaks.items(), key=lambda kv: -kv[1]):
        if peak > 0.05:
            print(f"| {names[pid]} (pid {pid}) | {peak:.2f} |")
    if updates:
        print(f"\nupdate seconds per step: median {statistics.median(updates):.1f}, "
              f"min {min(updates):.1f}, max {max(updates):.1f} over {len(updates)} steps")
    print(f"output: {out}")


if __name__ == "__main__":
    main()
