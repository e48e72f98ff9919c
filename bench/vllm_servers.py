"""Several CPU vLLM servers side by side (``inference.servers``): what they generate together against one server.

Layouts, each started in turn as lit's ``Fleet`` starts them, on this process's cores:

- ``one server``: one server on every core (lit's default);
- ``two servers``: two servers, each process on its half of the cores (``placement.server_cores``: its API server
  and engine threads too, not only its OpenMP threads);
- ``two servers, threads bound``: the same two servers with only their OpenMP threads bound
  (``VLLM_CPU_OMP_THREADS_BIND``), each process free to run its other threads anywhere: how lit placed them
  before 2026-11-29, the baseline.

For each layout, ``--rounds`` times: ``--requests`` chat completions of ``--tokens`` tokens (``ignore_eos``,
temperature 0.7) sent to the first server alone, then as many to every server at once; seconds for each, and the
tokens/s of the second. Target: two servers together take about as long as one alone (each has its own cores),
and the placed layout is not slower than the one with threads bound only.

Run: ``.venv/bin/python bench/vllm_servers.py`` (about 4 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import requests

LAYOUTS = {"one server": (1, True), "two servers": (2, True), "two servers, threads bound": (2, False)}
"""name: (servers, whole process on its cores)."""


def measure(layout: str, rounds: int, requests_n: int, tokens: int) -> dict:
    import contextlib
    from unittest import mock

    from lit_trainer.engine import server as server_module
    from lit_trainer.engine.config import InferenceConfig
    from lit_trainer.engine.fleet import Fleet
    from lit_trainer.models.embedded import prepare_default_model

    servers, placed = LAYOUTS[layout]
    config = InferenceConfig(model=str(prepare_default_model().path), cpu_kv_cache_gb=1, servers=servers,
                             extra_args=["--enforce-eager"])
    # the baseline: no process-wide cores, as before placement.server_cores
    unplaced = mock.patch.object(server_module, "server_cores", lambda *args: None)
    with contextlib.nullcontext() if placed else unplaced, Fleet(config) as fleet:

        def complete(server, i: int) -> None:
            headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
            answer = requests.post(f"{server.openai_url}/chat/completions", headers=headers, timeout=600, json={
                "model": server.model_name, "messages": [{"role": "user", "content": f"Count to ten ({i})."}],
                "max_tokens": tokens, "temperature": 0.7, "ignore_eos": True})
            answer.raise_for_status()

        def timed(targets: list) -> float:
            jobs = [(server, i) for server in targets for i in range(requests_n)]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(jobs)) as pool:
                list(pool.map(lambda job: complete(*job), jobs))
            return time.perf_counter() - t0

        timed(fleet.servers)  # warm-up
        alone, together = [], []
        for _ in range(rounds):
            alone.append(timed(fleet.servers[:1]))
            together.append(timed(fleet.servers))
    return {"layout": layout, "alone_s": [round(s, 2) for s in alone], "together_s": [round(s, 2) for s in together],
            "together_tokens_per_s": round(servers * requests_n * tokens / statistics.median(together), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4, help="requests to each server at once")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    results = [measure(layout, args.rounds, args.requests, args.tokens) for layout in args.layouts]
    for result in results:
        print(json.dumps(result))
    by = {r["layout"]: r for r in results}
    if "two servers" in by and "two servers, threads bound" in by:
        placed, bound = (statistics.median(by[k]["together_s"]) for k in ("two servers", "two servers, threads bound"))
        print(f"two servers generating together: {placed:.2f} s placed vs {bound:.2f} s with only the threads bound "
              f"({bound / placed:.1f}x)")


if __name__ == "__main__":
    main()
