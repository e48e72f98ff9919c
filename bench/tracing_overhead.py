"""Client-side time that lit adds to one LLM call, per framework.

Each framework's call goes to a mock HTTP transport (httpx.MockTransport) answering like vLLM with token ids, so
only client-side work is timed. For each case the same calls run untraced (baseline) and traced inside a
@lit.trace rollout, alternating rounds so that machine noise hits both alike; the figure is the median per-call
time of each, their difference (added ms per call) and ratio. Spans go over a real ZeroMQ socket to a collector
that acknowledges them, in a process of its own as in production (the trainer's): its decoding is not the agent's
cost, and in the agent's process it would hold the GIL the agent's thread waits for.

    .venv/bin/python bench/tracing_overhead.py [--calls 300] [--rounds 7]

Target: <= 0.15 ms added per plain openai call with lit's own patch (frameworks=[]).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS / "sdk"), str(TESTS)]
from ack_server import AckServer  # noqa: E402  (a test collector: acknowledges, stores nothing)

import lit_sdk as lit  # noqa: E402

MODEL_INFO = {"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
              "structured_output": False}
def body(prompt_tokens: int) -> bytes:
    return json.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "policy",
    "prompt_token_ids": list(range(100, 100 + prompt_tokens)),
    "choices": [{
        "index": 0, "finish_reason": "stop", "token_ids": list(range(500, 520)),
        "message": {"role": "assistant", "content": "The answer is 5."},
        "logprobs": {"content": [{"token": "t", "logprob": -0.5, "bytes": [], "top_logprobs": []}] * 20},
    }],
    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 20, "total_tokens": prompt_tokens + 20},
    }).encode()


BODY, LONG_BODY = body(60), body(2000)
BASE_URL = "http://engine.invalid/v1"
MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


def respond(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, content=BODY, headers={"content-type": "application/json"})


def respond_long(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, content=LONG_BODY, headers={"content-type": "application/json"})


def make_cases() -> dict[str, Callable[[int], None]]:
    from openai import AsyncOpenAI, OpenAI

    sync_http = httpx.Client(transport=httpx.MockTransport(respond))
    async_http = httpx.AsyncClient(transport=httpx.MockTransport(respond))
    client = OpenAI(base_url=BASE_URL, api_key="x", http_client=sync_http)

    def plain(n: int) -> None:
        for _ in range(n):
            client.chat.completions.create(model="policy", messages=MESSAGES)

    long_client = OpenAI(base_url=BASE_URL, api_key="x",
                         http_client=httpx.Client(transport=httpx.MockTransport(respond_long)))

    def plain_long(n: int) -> None:
        for _ in range(n):
            long_client.chat.completions.create(model="policy", messages=MESSAGES)

    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=BASE_URL, api_key="x", model="policy", http_client=sync_http)

    def langchain(n: int) -> None:
        for _ in range(n):
            chat.invoke("What is 2+3?")

    from autogen_core.models import UserMessage
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    autogen_client = OpenAIChatCompletionClient(model="policy", base_url=BASE_URL, api_key="x",
                                                model_info=MODEL_INFO, http_client=async_http)

    def autogen(n: int) -> None:
        async def run() -> None:
            for _ in range(n):
                await autogen_client.create([UserMessage(content="What is 2+3?", source="user")])
        asyncio.run(run())

    import agents
    from agents import Agent, OpenAIChatCompletionsModel, Runner

    agents.set_trace_processors([])  # nothing leaves the machine
    engine = AsyncOpenAI(base_url=BASE_URL, api_key="x", http_client=async_http)
    model = OpenAIChatCompletionsModel(model="policy", openai_client=engine)
    agent = Agent(name="calculator", instructions="Answer.", model=model)

    def agents_sdk(n: int) -> None:
        async def run() -> None:
            for _ in range(n):
                await Runner.run(agent, "What is 2+3?")
        asyncio.run(run())

    return {
        "openai (plain)": plain,
        "openai, 2000-token prompt": plain_long,
        "LangChain ChatOpenAI": langchain,
        "AutoGen model client": autogen,
        "OpenAI Agents SDK Runner": agents_sdk,
    }


def per_call_ms(fn: Callable[[int], None], calls: int, traced: bool) -> float:
    rollout = lit.trace(name="bench")(fn) if traced else fn
    t0 = time.perf_counter()
    rollout(calls)
    return (time.perf_counter() - t0) * 1000 / calls


def measure(cases, calls: int, rounds: int, frameworks: list[str], endpoint: str, spool: str) -> dict:
    results = {}
    for name, fn in cases.items():
        fn(20)  # warm up imports and pools
        base, traced = [], []
        for _ in range(rounds):  # alternating, so that a noisy moment hits both sides of one pair
            base.append(per_call_ms(fn, calls, traced=False))
            lit.instrument(endpoint=endpoint, frameworks=frameworks, llm_base_urls=[BASE_URL], spool_dir=spool)
            traced.append(per_call_ms(fn, calls, traced=True))
            counts = lit.flush(timeout=30)
            lit.uninstrument()
            assert counts.pending == 0, counts
        added = sorted(t - b for b, t in zip(base, traced, strict=True))
        quartiles = statistics.quantiles(added, n=4) if len(added) > 1 else [added[0]] * 3
        results[name] = (statistics.median(base), statistics.median(traced), quartiles)
    return results


def serve_acks() -> None:
    """The acknowledging collector, in this (separate) process: prints its endpoint, serves until stdin closes."""
    with AckServer() as server:
        print(server.endpoint, flush=True)
        sys.stdin.read()


def start_ack_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve-acks"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--serve-acks", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_acks:
        return serve_acks()
    cases = make_cases()
    server, endpoint = start_ack_server()
    try:
        run_all(cases, args, endpoint)
    finally:
        server.communicate("", timeout=10)


def run_all(cases: dict[str, Callable[[int], None]], args: argparse.Namespace, endpoint: str) -> None:
    with tempfile.TemporaryDirectory() as spool:
        for label, frameworks in (("lit patch only (frameworks=[])", []),
                                  ("lit + openinference instrumentors (default)", None)):
            results = measure(cases, args.calls, args.rounds, frameworks, endpoint, spool)
            print(f"\n{label}: {args.calls} calls x {args.rounds} rounds, ms per call")
            print("(added = median of the per-round differences traced - untraced; IQR = their middle half)")
            head = ("call", "untraced", "traced", "added ms", "IQR of added", "ratio")
            print("| {:28} | {:>9} | {:>9} | {:>9} | {:>15} | {:>6} |".format(*head))
            print(f"|{'-' * 30}|{'-' * 11}|{'-' * 11}|{'-' * 11}|{'-' * 17}|{'-' * 8}|")
            for name, (base, traced, (q1, q2, q3)) in results.items():
                iqr = f"{q1:.3f}..{q3:.3f}"
                print(f"| {name:28} | {base:9.3f} | {traced:9.3f} | {q2:9.3f} | {iqr:>15} | {traced / base:6.2f} |")


if __name__ == "__main__":
    main()
