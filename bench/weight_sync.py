"""Weight sync seconds (by phase) and generation throughput through lit's managed vLLM server vs vLLM run directly.

1. lit's server (``InferenceServer`` with the default ``InferenceConfig``: dev mode, tool template and parser, log
   file, process-group supervision) starts; its start-up time is the baseline a sync replaces (restarting vLLM).
2. ``--syncs`` weight syncs of the trainer's model (``WeightSync.push_weights``), with ``--gap`` seconds of idle
   between them as between training steps; the median of each phase is reported. Target: <= 1.0 s in total.
3. Generation tokens/s at 1, 16 and 32 concurrent requests (``--tokens`` tokens each, ``ignore_eos``), through
   lit's server; then lit's server stops and
4. the baseline: the same vLLM, started by this script with a plain command line (same model, dtype, context and
   CPU threads, nothing else: no dev mode, no template, no tool parser), measured the same way. lit does not proxy
   requests, so the difference is what lit's server settings and supervision cost. Target: overhead <= 5 %.

Only one server runs at a time. Run: ``.venv/bin/python bench/weight_sync.py`` (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import requests
import torch
from transformers import AutoModelForCausalLM

from lit_sdk.processes import start_child, stop_child
from lit_trainer.engine.config import InferenceConfig, WeightSyncConfig
from lit_trainer.engine.launch import build_env, pick_port, vllm_python
from lit_trainer.engine.server import InferenceServer
from lit_trainer.engine.weight_sync import WeightSync
from lit_trainer.models.folders import resolve_model

PROMPT = "Write a long story about a robot who learns to paint."


def generation_tok_s(openai_url: str, model: str, concurrency: int, tokens: int, rounds: int) -> float:
    """Completion tokens per second with ``concurrency`` requests in flight, ``rounds`` requests per slot."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "temperature": 1.0}

    def one(_: int) -> int:
        response = requests.post(f"{openai_url}/completions", json=body, timeout=900)
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]

    one(0)  # warm-up
    with ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        total = sum(pool.map(one, range(concurrency * rounds)))
        return total / (time.perf_counter() - t0)


def throughput(openai_url: str, model: str, args: argparse.Namespace) -> dict[int, float]:
    rounds = {1: 3, 16: 1, 32: 1}
    return {c: generation_tok_s(openai_url, model, c, args.tokens, rounds[c]) for c in (1, 16, 32)}


def bench_lit(args: argparse.Namespace, model_dir: str) -> tuple[float, dict[str, list[float]], dict[int, float]]:
    config = InferenceConfig(model=model_dir, log_dir=tempfile.mkdtemp(prefix="lit-bench-"))
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with InferenceServer(config) as server:
        phases: dict[str, list[float]] = {}
        with WeightSync(server.base_url, WeightSyncConfig(), credentials=server.credentials) as sync:
            for _ in range(args.syncs):
                time.sleep(args.gap)
                report = sync.push_weights(trainer)
                for phase, seconds in report.seconds.items():
                    phases.setdefault(phase, []).append(seconds)
                phases.setdefault("total", []).append(report.total_s)
        print(
            f"lit server up in {server.startup_s:.0f} s; {args.syncs} syncs done; measuring generation",
            flush=True,
        )
        tok_s = throughput(server.openai_url, server.model_name, args)
    return server.startup_s, phases, tok_s


def bench_direct(args: argparse.Namespace, model_dir: str) -> dict[int, float]:
    """Plain ``vllm`` with the same engine settings, no lit: started, measured and stopped here."""
    config = InferenceConfig(model=model_dir, weight_sync=False)
    port = pick_port(config)
    cmd = [vllm_python(config), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(port)]
    cmd += ["--served-model-name", "direct", "--dtype", config.dtype, "--max-model-len", str(config.max_model_len)]
    env = build_env(config)
    log = open(os.path.join(tempfile.mkdtemp(prefix="vllm-direct-"), "vllm.log"), "wb")
    process = start_child(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + config.startup_timeout_s
        while not _healthy(f"http://127.0.0.1:{port}/health"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"direct vLLM did not start; see {log.name}")
            time.sleep(0.5)
        print("direct vLLM up; measuring generation", flush=True)
        return throughput(f"http://127.0.0.1:{port}/v1", "direct", args)
    finally:
        stop_child(process, 30, name="direct vLLM")
        log.close()


def _healthy(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--syncs", type=int, default=7)
    parser.add_argument("--gap", type=float, default=2.0, help="idle seconds before each sync")
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per request")
    args = parser.parse_args()
    model_dir = str(resolve_model(args.model))

    startup_s, phases, lit_tok_s = bench_lit(args, model_dir)
    direct_tok_s = bench_direct(args, model_dir)

    print(f"\nweight sync, {args.syncs} syncs of the full fp32 model (median s); baseline: restart vLLM")
    print(f"{'figure':<34}{'value':>10}{'baseline':>12}{'ratio':>9}")
    for phase, values in phases.items():
        median = statistics.median(values)
        line = f"{'sync ' + phase + ' (s)':<34}{median:>10.3f}"
        if phase == "total":
            line += f"{startup_s:>12.1f}{median / startup_s:>9.3f}   target <= 1.0 s"
        print(line)
    print("\ngeneration, completion tokens/s; baseline: the same vLLM started directly")
    print(f"{'figure':<34}{'value':>10}{'baseline':>12}{'ratio':>9}")
    for concurrency in (1, 16, 32):
        lit, direct = lit_tok_s[concurrency], direct_tok_s[concurrency]
        print(f"{f'tok/s, {concurrency} concurrent (lit)':<34}{lit:>10.1f}{direct:>12.1f}{lit / direct:>9.3f}")
    print("target: ratio >= 0.95 (overhead <= 5 %)")


if __name__ == "__main__":
    main()
