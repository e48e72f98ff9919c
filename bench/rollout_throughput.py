"""Rollouts per second through the whole of lit: dispatcher → worker processes → the agent's three traced LLM
calls → spans over ZeroMQ → the collector → SQLite, against a fast test LLM server, with exact counts.

The LLM server (its own process) answers every chat call at once with a fixed vLLM-shaped body (token ids and
logprobs), so what is timed is lit and the agent's client. The baseline, in the same run: the same agent code,
untraced, as 64 concurrent asyncio tasks in one process calling the same server (no dispatcher, workers, spans or
store). Figures: lit's rollouts/s, the baseline's, their ratio, and lit against Agent Lightning 0.3.0's published
192 ms per 3-call rollout with 4 runners (about 21 rollouts/s; the issue's target is 10x that).

    .venv/bin/python bench/rollout_throughput.py [--rollouts 1000] [--workers 2] [--concurrency 32]

``run_load`` is also what the load test (tests/trainer/rollouts/test_load.py) runs, with its counts asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

BENCH = Path(__file__).resolve().parent
AGENT_LIGHTNING_ROLLOUTS_PER_S = 4 / 0.192
"""Agent Lightning 0.3.0: 192 ms per 3-call rollout with 4 runners on this kind of machine (issue #14)."""


# -- the fast LLM server --------------------------------------------------------------------------------------------

def _body() -> bytes:
    ids = list(range(50_000, 50_008))
    return json.dumps({
        "id": "chatcmpl-load", "object": "chat.completion", "created": 0, "model": "policy",
        "prompt_token_ids": list(range(10_000, 10_040)),
        "choices": [{"index": 0, "finish_reason": "stop", "token_ids": ids,
                     "message": {"role": "assistant", "content": "fine"},
                     "logprobs": {"content": [{"token": f"t{t}", "logprob": -0.5, "bytes": [], "top_logprobs": []}
                                              for t in ids]}}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 8, "total_tokens": 48},
    }).encode()


async def _serve(port: int) -> None:
    body = _body()
    head = (f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: keep-alive\r\n\r\n").encode()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                headers = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in headers.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await reader.readexactly(length)
                writer.write(head + body)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


def start_llm_server() -> tuple[subprocess.Popen, str]:
    """The fast LLM server in a process of its own; (process, OpenAI base URL)."""
    proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    return proc, f"http://127.0.0.1:{port}/v1"


# -- lit, end to end ------------------------------------------------------------------------------------------------

@dataclass
class LoadResult:
    rollouts: int
    succeeded: int
    seconds: float
    rollouts_per_s: float
    spans_declared: int
    """The sum over rollouts of the span count each root declared (``lit.rollout.spans``)."""
    spans_stored: int
    incomplete: int
    """Rollouts whose stored spans fall short of what their root declared (``missing_spans``)."""
    duplicates: int
    """Spans the collector received again after storing them (resends); stored once all the same."""
    rejected: int
    refused: int
    """Spans of good frames the collector refused (intake/admission.py): none from honest workers."""
    peak_rss_mb: dict[str, float]
    rss_growth_mb: dict[str, float]
    """Peak resident memory above each process's own at the start: what running the rollouts cost it."""


def run_load(rollouts: int, workers: int, concurrency: int, llm_url: str, work_dir: Path) -> LoadResult:
    from lit_sdk import semconv
    from lit_sdk.protocol import security
    from lit_sdk.resources import LLM
    from lit_sdk.worker import spawn
    from lit_trainer.config import TrainConfig
    from lit_trainer.intake.collector import Collector
    from lit_trainer.intake.rows import RolloutStatus
    from lit_trainer.intake.store import SqliteStore
    from lit_trainer.rollouts.attempts import RolloutRequest
    from lit_trainer.rollouts.dispatcher import Dispatcher
    from lit_trainer.run.services import stop_workers, with_keys

    # as lit train runs them: both channels with the run's own CURVE keys, every span admitted by the collector
    keys_dir, _ = with_keys(TrainConfig(), work_dir / "keys")
    keys = security.load_server_keys(keys_dir)
    store = SqliteStore(work_dir / "lit.sqlite")
    collector = Collector(store, "tcp://127.0.0.1:0", keys=keys).start()
    dispatcher = Dispatcher(store, "tcp://127.0.0.1:0", collector.endpoint, [llm_url], keys=keys)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH), os.environ.get("PYTHONPATH", "")]),
           "LIT_SPOOL_DIR": str(work_dir / "spool"), "LIT_FRAMEWORKS": "", security.KEYS_ENV: str(keys_dir)}
    procs = [spawn("load_agent:three_calls", dispatcher.endpoint, concurrency, env) for _ in range(workers)]
    peaks: dict[str, float] = {}
    try:
        dispatcher.wait_for_workers(workers, timeout_s=120)
        llm = LLM(llm_url, "policy", temperature=1.0, max_tokens=8)
        requests = [RolloutRequest(f"load-{i}", f"t{i}", {"id": i}, llm, 0) for i in range(rollouts)]
        watched = [psutil.Process(), *(psutil.Process(p.pid) for p in procs)]

        names = ["trainer", *(f"worker{i}" for i in range(workers))]
        start = {name: proc.memory_info().rss / 2**20 for name, proc in zip(names, watched, strict=True)}

        def sample(_: object = None) -> None:
            for name, proc in zip(names, watched, strict=True):
                peaks[name] = max(peaks.get(name, 0.0), proc.memory_info().rss / 2**20)

        t0 = time.perf_counter()
        outcomes = dispatcher.run(requests, lambda o: sample() if int(o.request.task_id[1:]) % 50 == 0 else None)
        seconds = time.perf_counter() - t0
        sample()
        collector.check()
        ok = [o for o in outcomes if o.status is RolloutStatus.SUCCEEDED]
        declared = incomplete = 0
        for outcome in ok:
            incomplete += store.missing_spans(outcome.rollout_id) is not None
            root = [s for s in store.spans_of_rollout(outcome.rollout_id) if s.parent_id is None]
            declared += root[0].attributes.get(semconv.ROLLOUT_SPANS, 0) if root else 0
        counts = collector.counts
        return LoadResult(rollouts, len(ok), seconds, rollouts / seconds, declared, store.counts()["spans"],
                          incomplete, counts.duplicates, sum(counts.rejected.values()),
                          sum(counts.refused_spans.values()), peaks,
                          {name: round(peaks[name] - start[name], 1) for name in names})
    finally:
        stop_workers(dispatcher, procs)
        collector.stop()
        store.close()


def run_baseline(rollouts: int, concurrency: int, llm_url: str) -> float:
    """The same three calls per rollout, untraced, ``concurrency`` at once in this process: rollouts/s."""
    sys.path.insert(0, str(BENCH))
    from load_agent import calls

    from lit_sdk.resources import LLM

    llm = LLM(llm_url, "policy", temperature=1.0, max_tokens=8)

    async def main() -> float:
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with gate:
                await calls({"id": i}, llm)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(rollouts)))
        return rollouts / (time.perf_counter() - t0)

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32, help="rollouts at once per worker process")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(0))
        return
    server, url = start_llm_server()
    try:
        baseline = run_baseline(args.rollouts, args.workers * args.concurrency, url)
        with tempfile.TemporaryDirectory() as tmp:
            result = run_load(args.rollouts, args.workers, args.concurrency, url, Path(tmp))
    finally:
        server.kill()
    print(json.dumps(asdict(result), indent=2))
    print(f"lit: {result.rollouts_per_s:.1f} rollouts/s ({args.workers} workers x {args.concurrency}); baseline "
          f"(untraced asyncio, {args.workers * args.concurrency} at once, one process): {baseline:.1f} rollouts/s; "
          f"ratio {result.rollouts_per_s / baseline:.2f}; vs Agent Lightning 0.3.0 "
          f"({AGENT_LIGHTNING_ROLLOUTS_PER_S:.1f}/s): {result.rollouts_per_s / AGENT_LIGHTNING_ROLLOUTS_PER_S:.1f}x "
          "(target 10x)")


if __name__ == "__main__":
    main()
