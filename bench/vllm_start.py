"""vLLM's start-up time and generation throughput on CPU: one process (lit's default, ``launch.ONE_PROCESS``: the
engine in the API server's process, the model in the engine's) against vLLM's own three processes (API server,
engine core, model worker, each importing vLLM and torch before the next starts).

For each layout, alternately and ``--rounds`` times: lit's ``InferenceServer`` starts (timed until it answers),
one weight sync of the prepared model goes in and the sync check compares vLLM's logprobs with the trainer's, then
``--requests`` completions of ``--tokens`` tokens (``ignore_eos``) run ``--concurrency`` at a time, three times;
the best tokens/s counts. The figure: start seconds and tokens/s per layout, each round's, on the same machine in
the same run. Target: one process starts faster and generates no slower, and the sync lands the same.

``--layouts "one process" "one process, eager"`` compares lit's default with ``--enforce-eager`` (no torch.compile,
no warm-up): the start it saves against the generation speed it costs. ``--layouts "one process" "one process,
blocks of 128"``: lit's KV-cache blocks of 32 tokens against vLLM's CPU default, on generation (the prompts here
share little, so the prefix cache hardly plays: what smaller blocks may cost, not what they save).

Run: ``.venv/bin/python bench/vllm_start.py`` (about 7 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import requests

LAYOUTS = {
    "one process": ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, ()),
    "vLLM's processes": ({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, ("--distributed-executor-backend", "mp")),
    "one process, eager": ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, ("--enforce-eager",)),
    "one process, blocks of 128": ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, ("--block-size", "128")),
}
"""name: (environment, extra vLLM arguments). ``--enforce-eager`` skips torch.compile and its warm-up;
``--block-size 128`` is vLLM's own CPU default, where lit starts it with 32 (``inference.cpu_block_size``)."""


def measure(layout: str, tokens: int, requests_n: int, concurrency: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_trainer.engine.config import InferenceConfig, WeightSyncConfig
    from lit_trainer.engine.logprob_check import check_logprobs
    from lit_trainer.engine.server import InferenceServer
    from lit_trainer.engine.weight_sync import WeightSync
    from lit_trainer.models.embedded import prepare_default_model

    env, extra = LAYOUTS[layout]
    os.environ.update(env)
    path = prepare_default_model().path
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    t0 = time.perf_counter()
    server = InferenceServer(InferenceConfig(cpu_kv_cache_gb=1, weight_sync=True, extra_args=extra)).start()
    start_s = time.perf_counter() - t0
    try:
        with WeightSync(server.base_url, WeightSyncConfig(), credentials=server.credentials) as sync:
            sync_s = sync.push_weights(model).total_s
        prompt = AutoTokenizer.from_pretrained(path)("The capital of France is")["input_ids"]
        gap = check_logprobs(server.base_url, server.model_name, model, [prompt], 0.02, api_key=server.api_key)
        headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}

        def one(i: int) -> int:
            body = {"model": server.model_name, "prompt": f"Question {i}: what is {i} times 7? Answer:",
                    "max_tokens": tokens, "temperature": 0.7, "ignore_eos": True}
            reply = requests.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=600)
            reply.raise_for_status()
            return reply.json()["usage"]["completion_tokens"]

        one(0)  # warm
        best = 0.0
        for _ in range(3):
            t = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                done = sum(pool.map(one, range(requests_n)))
            best = max(best, done / (time.perf_counter() - t))
    finally:
        server.stop()
    return {"layout": layout, "start_s": round(start_s, 1), "tokens_per_s": round(best, 1),
            "sync_s": round(sync_s, 2), "sync_check_gap": gap.max_abs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS)[:2],
                        help="what to compare (default: the first two)")
    args = parser.parse_args()
    for _ in range(args.rounds):
        for layout in args.layouts:  # alternately: the machine's load drifts
            print(json.dumps(measure(layout, args.tokens, args.requests, args.concurrency)), flush=True)


if __name__ == "__main__":
    main()
