"""What recording a call at the engine costs: lit's gateway (``lit_trainer.intake.gateway``) against calling the
engine directly, on loopback.

Section "cost per call": chat completions of one token, one at a time, alternately straight to the engine and
through the gateway under a rollout's URL (where each call is recorded into a SQLite store before its answer
ends), ``--calls`` of each; the figure is the difference of the two medians. Measured twice: against a stand-in
engine that answers at once with a vLLM-shaped answer (what the gateway itself costs, without vLLM's own noise),
and against the real vLLM on the default model.

Section "streamed tokens/s": ``--streams`` greedy streamed chat completions of ``--tokens`` tokens each
(``min_tokens`` holds the length), in turn direct, direct asking for what the gateway asks (token ids and logprobs:
what vLLM itself spends on them), and through the gateway, on the real vLLM; tokens per second of each, and the
gateway's ratio to both.

The gateway runs in a process of its own, as in ``lit train`` (the agents are other processes), and so does the
stand-in engine; the client is this process, with the standard library's ``http.client`` on kept-alive connections.

    .venv/bin/python bench/gateway.py [--calls 300] [--streams 6] [--tokens 128] [--url http://127.0.0.1:PORT/v1]

``--url`` uses a running vLLM (started by lit: ``lit_trainer.engine.server.InferenceServer``) instead of starting
one. Targets: at most 1 ms per call at the median; streamed tokens/s within 5 % of direct.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from urllib.parse import urlsplit

SECRET = "ab" * 16
ROLLOUT = "bench-a1"


def stand_in(port_queue: mp.Queue) -> None:
    """An engine that answers every chat completion at once, as vLLM shapes it (token ids, logprobs)."""
    from aiohttp import web

    answer = json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
                         "prompt_token_ids": list(range(40)), "choices": [{
                             "index": 0, "finish_reason": "length", "token_ids": [7],
                             "message": {"role": "assistant", "content": "x"},
                             "logprobs": {"content": [{"token": "x", "logprob": -0.5, "bytes": [120],
                                                       "top_logprobs": []}]}}],
                         "usage": {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41}}).encode()

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_queue.put(site._server.sockets[0].getsockname()[1])
        while True:
            await asyncio.sleep(3600)

    import asyncio

    asyncio.run(main())


def gateway(upstreams: list[str], url_queue: mp.Queue, folder: str) -> None:
    """lit's gateway on a store of its own, with one running rollout handed out."""
    from lit_trainer.intake.gateway.server import Gateway
    from lit_trainer.intake.rows import RolloutRow, RolloutStatus
    from lit_trainer.intake.store import SqliteStore

    store = SqliteStore(f"{folder}/lit.sqlite")
    store.add_rollouts([RolloutRow(ROLLOUT, "t", 0, secret=SECRET)])
    store.set_rollout_status(ROLLOUT, RolloutStatus.RUNNING)
    with Gateway(store, upstreams) as gw:
        url_queue.put([gw.rollout_url(u, ROLLOUT, SECRET) for u in upstreams])
        while True:
            time.sleep(3600)


class Client:
    """POSTs on one kept-alive connection; the seconds each call took, whole answer read."""

    def __init__(self, base_url: str):
        parts = urlsplit(base_url)
        self.path = parts.path.rstrip("/")
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)

    def post(self, route: str, body: dict) -> tuple[float, bytes]:
        data = json.dumps(body).encode()
        t0 = time.perf_counter()
        self.conn.request("POST", f"{self.path}/{route}", data, {"Content-Type": "application/json"})
        response = self.conn.getresponse()
        payload = response.read()
        seconds = time.perf_counter() - t0
        if response.status != 200:
            raise RuntimeError(f"{route}: {response.status} {payload[:300]!r}")
        return seconds, payload


def cost_per_call(direct: str, through: str, model: str, calls: int) -> tuple[float, float]:
    """Median seconds of one 1-token chat call, direct and through the gateway, alternating."""
    body = {"model": model, "messages": [{"role": "user", "content": "Say one word."}], "max_tokens": 1,
            "temperature": 0}
    a, b = Client(direct), Client(through)
    for client in (a, b):  # warm the connections
        client.post("chat/completions", body)
    times: dict[str, list[float]] = {"direct": [], "gateway": []}
    for _ in range(calls):
        times["direct"].append(a.post("chat/completions", body)[0])
        times["gateway"].append(b.post("chat/completions", body)[0])
    return statistics.median(times["direct"]), statistics.median(times["gateway"])


def streamed_rate(direct: str, through: str, model: str, streams: int, tokens: int) -> dict[str, float]:
    """Tokens per second of greedy streams of ``tokens`` tokens, in turn: direct as the agent asks, direct asking
    what the gateway adds (the engine's ids and logprobs: vLLM's own cost of them), and through the gateway."""
    body = {"model": model, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": tokens,
            "min_tokens": tokens, "temperature": 0, "stream": True}
    ways = {"direct": (direct, body), "direct, ids and logprobs asked": (direct, {**body, "return_token_ids": True,
                                                                                 "logprobs": True}),
            "gateway": (through, body)}
    seconds = dict.fromkeys(ways, 0.0)
    for _ in range(streams):
        for name, (url, ask) in ways.items():
            spent, payload = Client(url).post("chat/completions", ask)
            assert payload.count(b"data: ") >= tokens, f"{name}: a stream of {payload.count(b'data: ')} events"
            seconds[name] += spent
    return {name: streams * tokens / spent for name, spent in seconds.items()}


def start_vllm():
    from lit_trainer.engine.config import InferenceConfig
    from lit_trainer.engine.server import InferenceServer
    from lit_trainer.models.embedded import prepare_default_model

    server = InferenceServer(InferenceConfig(model=str(prepare_default_model().path), cpu_kv_cache_gb=1))
    return server.__enter__()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--url", default="", help="a running lit-managed vLLM's OpenAI URL (default: start one)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    ports: mp.Queue = ctx.Queue()
    engine = ctx.Process(target=stand_in, args=(ports,), daemon=True)
    engine.start()
    fake = f"http://127.0.0.1:{ports.get(timeout=60)}/v1"
    server = None if args.url else start_vllm()
    vllm, model = (args.url, "policy") if args.url else (server.openai_url, server.model_name)
    urls: mp.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        gw = ctx.Process(target=gateway, args=([fake, vllm], urls, folder), daemon=True)
        gw.start()
        fake_gw, vllm_gw = urls.get(timeout=60)
        try:
            rows = []
            for name, direct, through in (("stand-in engine", fake, fake_gw), ("vLLM", vllm, vllm_gw)):
                d, g = cost_per_call(direct, through, model, args.calls)
                rows.append(f"| cost per call, {name} | {d * 1e3:.3f} ms | {g * 1e3:.3f} ms | "
                            f"+{(g - d) * 1e3:.3f} ms ({g / d:.2f}x) |")
            rates = streamed_rate(vllm, vllm_gw, model, args.streams, args.tokens)
            g = rates.pop("gateway")
            rows.extend(f"| streamed tokens/s, vLLM ({name}) | {d:.1f} | {g:.1f} | {g / d:.3f}x |"
                        for name, d in rates.items())
        finally:
            gw.terminate()
            engine.terminate()
            if server is not None:
                server.__exit__(None, None, None)
    print("| figure | direct | through the gateway | difference |")
    print("| --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
