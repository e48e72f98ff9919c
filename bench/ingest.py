"""Trainer intake throughput: durable spans per second from several agent processes into the store.

Section "durable ingest": ``--senders`` processes each deliver ``--spans`` spans through the SDK's real
``SpanSender`` (batching, acks, resends) over ZeroMQ to the real ``Collector``, which validates them and commits
them to a ``SqliteStore`` (WAL, synchronous=FULL) before acknowledging. The figure is spans acknowledged after commit
per second, from the moment all senders start submitting until the last one has every span acknowledged. The
baseline, measured in the same run by the same number of processes, is raw ZeroMQ + MessagePack: each process sends
the same spans pre-encoded in frames of the same size to a ROUTER that only unpacks them (no validation, no store,
no acks). The spans are shaped like real ones, per rollout: a ``lit.rollout`` root, two ``lit.llm`` calls (200
prompt token ids, 50 response ids and 50 logprobs each), a ``lit.reward`` span and six small framework spans.

    .venv/bin/python bench/ingest.py [--senders 2] [--spans 100000] [--batch 512]

Section "episode building": every rollout of that store read back and rebuilt into an episode; spans per second,
with and without the SQLite read, beside the same raw rate.

Targets: >= 100k durable spans/s; >= 50k episode-building spans/s. ``main()`` runs the sections in ``SECTIONS``
in order, each returning table rows.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import secrets
import sqlite3
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgpack
import zmq

from lit_sdk import protocol
from lit_sdk import semconv as sc
from lit_sdk.sender import SpanSender
from lit_trainer.intake.collector import Collector
from lit_trainer.intake.episodes import Episode, build_episode
from lit_trainer.intake.rows import RolloutRow
from lit_trainer.intake.store import SqliteStore

SPANS_PER_ROLLOUT = 10
_DEADLINE_S = 300.0
"""No section waits longer than this for its senders."""


@dataclass
class Row:
    figure: str
    value: float
    baseline_name: str
    baseline: float
    unit: str


def make_rollout(rng: random.Random, rollout_id: str) -> list[dict]:
    """One rollout's spans in wire form, shaped like the golden traces of the real frameworks."""
    trace_id, root_id = secrets.token_hex(16), secrets.token_hex(8)
    now = time.time_ns()
    common = {sc.ROLLOUT_ID: rollout_id, sc.TASK_ID: "task-17", sc.ATTEMPT: 1}

    def span(name: str, parent: str | None, attributes: dict) -> dict:
        return {"trace_id": trace_id, "span_id": secrets.token_hex(8), "parent_id": parent, "name": name,
                "start_ns": now, "end_ns": now + 1000, "status": 1, "status_message": "", "rollout_id": rollout_id,
                "attributes": {**common, **attributes}, "events": []}

    def llm() -> dict:
        return span(sc.LLM_SPAN, root_id, {
            sc.AGENT_NAME: "solver", sc.LLM_API: "chat", sc.LLM_MODEL: "policy", sc.LLM_RESPONSE_ID: "chatcmpl-1",
            sc.LLM_PROMPT_TOKEN_IDS: [rng.randrange(49152) for _ in range(200)],
            sc.LLM_RESPONSE_TOKEN_IDS: [rng.randrange(49152) for _ in range(50)],
            sc.LLM_RESPONSE_LOGPROBS: [-rng.random() * 3 for _ in range(50)],
            sc.LLM_FINISH_REASON: "stop", sc.LLM_CHOICES: 1})

    def framework(name: str, kind: str) -> dict:
        return span(name, root_id, {sc.OI_SPAN_KIND: kind, sc.OI_GRAPH_NODE_ID: "agent", "llm.model_name": "policy"})

    root = span(sc.ROLLOUT_SPAN, None, {sc.ROLLOUT_NAME: "solve", sc.ROLLOUT_INPUT: '{"task": "2+3"}',
                                        sc.ROLLOUT_OUTPUT: "5.0", sc.ROLLOUT_RETURN_REWARD: 1.0})
    root["span_id"] = root_id
    return [llm(), framework("ChatOpenAI", "LLM"), framework("model", "CHAIN"), framework("calc", "TOOL"),
            framework("tools", "CHAIN"), llm(), framework("ChatOpenAI", "LLM"), framework("model", "CHAIN"),
            span(sc.REWARD_SPAN, root_id, {sc.REWARD_VALUE: 1.0, sc.REWARD_NAME: ""}), root]


def make_spans(n: int, seed: int) -> list[dict]:
    """``n`` spans (whole rollouts) with distinct ids. Rollouts reuse a few token-id lists so memory stays small;
    MessagePack encodes each span in full all the same."""
    rng = random.Random(seed)
    templates = [make_rollout(rng, "tmpl") for _ in range(8)]
    spans = []
    for i in range(-(-n // SPANS_PER_ROLLOUT)):
        rollout_id, trace_id = f"r{seed}-{i}", secrets.token_hex(16)
        template = templates[i % len(templates)]
        ids = {s["span_id"]: secrets.token_hex(8) for s in template}
        for s in template:
            attributes = {**s["attributes"], sc.ROLLOUT_ID: rollout_id}
            spans.append({**s, "trace_id": trace_id, "span_id": ids[s["span_id"]], "rollout_id": rollout_id,
                          "parent_id": ids.get(s["parent_id"]), "attributes": attributes})
    return spans[:n]


def send_with_sdk(endpoint: str, n: int, batch: int, seed: int, spool: str, go, results) -> None:
    """A sender process: the SDK's SpanSender delivers ``n`` spans; report (start, end, acknowledged)."""
    spans = make_spans(n, seed)
    sender = SpanSender(endpoint, spool_dir=Path(spool), max_batch_spans=batch, linger_s=0.01)
    go.wait(_DEADLINE_S)
    start = time.time()
    for span in spans:
        sender.submit(span)
    counts = sender.flush(timeout=_DEADLINE_S)
    end = time.time()
    sender.shutdown(timeout=1)
    results.put((start, end, counts.acknowledged, counts.pending))


def send_raw(endpoint: str, n: int, batch: int, seed: int, spool: str, go, results) -> None:
    """A baseline sender: the same spans, pre-encoded into frames, pushed through a plain DEALER."""
    spans = make_spans(n, seed)
    frames = [protocol.encode_span_dicts(f"raw-{seed}-{i}", "raw", spans[i:i + batch]) for i in range(0, n, batch)]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    go.wait(_DEADLINE_S)
    start = time.time()
    for frame in frames:
        sock.send(frame)
    sock.close(linger=-1)
    zmq.Context.instance().term()  # returns once every frame is out (the process would exit before that)
    results.put((start, None, n, 0))


def run_senders(target: Callable, endpoint: str, args: argparse.Namespace, tmp: Path) -> Callable[[], list[tuple]]:
    """Start the sender processes, let them go together; a function that waits for them and gives their results."""
    ctx = mp.get_context("spawn")  # no ZeroMQ context crosses a fork
    go, results = ctx.Barrier(args.senders + 1), ctx.Queue()  # all start together once each has built its spans
    procs = [ctx.Process(target=target, args=(endpoint, args.spans, args.batch, seed, str(tmp / f"spool{seed}"),
                                              go, results)) for seed in range(args.senders)]
    for proc in procs:
        proc.start()
    go.wait(_DEADLINE_S)

    def finish() -> list[tuple]:
        out = [results.get(timeout=_DEADLINE_S) for _ in procs]
        for proc in procs:
            proc.join(30)
        return out

    return finish


def measure_raw(args: argparse.Namespace, tmp: Path) -> float:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    total, received = args.spans * args.senders, 0
    finish = run_senders(send_raw, f"tcp://127.0.0.1:{port}", args, tmp)
    deadline = time.time() + _DEADLINE_S
    while received < total and time.time() < deadline:
        if sock.poll(1000):
            received += len(msgpack.unpackb(sock.recv_multipart()[-1])["spans"])
    end = time.time()
    results = finish()
    sock.close(linger=0)
    start = min(r[0] for r in results)
    assert received == total, f"raw baseline: {received} of {total} spans arrived"
    return received / (end - start)


def measure_durable(args: argparse.Namespace, tmp: Path) -> tuple[float, SqliteStore, Collector]:
    store = SqliteStore(tmp / "ingest.db")
    # handed out first, as the dispatcher does: the collector stores spans of the rollouts the store holds only
    store.add_rollouts(RolloutRow(f"r{seed}-{i}", "task-17", 1) for seed in range(args.senders)
                       for i in range(-(-args.spans // SPANS_PER_ROLLOUT)))
    collector = Collector(store, "tcp://127.0.0.1:0", open_to_local_users=True).start()
    results = run_senders(send_with_sdk, collector.endpoint, args, tmp)()
    collector.stop()
    acknowledged = sum(r[2] for r in results)
    assert sum(r[3] for r in results) == 0, f"spans left unacknowledged: {results}"
    assert store.counts()["spans"] == acknowledged == args.spans * args.senders, (store.counts(), acknowledged)
    return acknowledged / (max(r[1] for r in results) - min(r[0] for r in results)), store, collector


def section_ingest(args: argparse.Namespace, tmp: Path) -> list[Row]:
    durable, store, collector = measure_durable(args, tmp)
    raw = measure_raw(args, tmp)
    counts = collector.counts
    print(f"durable ingest: {args.senders} senders x {args.spans} spans, frames of {args.batch}; "
          f"{counts.frames} frames in {counts.commits} commits ({counts.frames / max(counts.commits, 1):.1f} "
          f"frames per transaction); database {(tmp / 'ingest.db').stat().st_size / 2**20:.0f} MiB")
    store.close()
    args.raw_rate = raw  # the baseline of the next section too
    return [Row("durable spans/s (acked after commit)", durable, "raw ZeroMQ+MessagePack spans/s", raw, "spans/s")]


def section_episodes(args: argparse.Namespace, tmp: Path) -> list[Row]:
    """Episode building over the store the ingest section filled: every rollout's spans read back from SQLite and
    rebuilt into an episode (``store.spans_of_rollout`` + ``build_episode``), and the rebuild alone."""
    with SqliteStore(tmp / "ingest.db") as store:
        conn = sqlite3.connect(tmp / "ingest.db")
        query = "SELECT DISTINCT rollout_id FROM spans WHERE typeof(rollout_id) = 'text'"  # x'': outside any rollout
        rollout_ids = [r for (r,) in conn.execute(query)]
        conn.close()
        t0 = time.perf_counter()
        per_rollout = [store.spans_of_rollout(r) for r in rollout_ids]
        t1 = time.perf_counter()
        episodes = [build_episode(spans) for spans in per_rollout]
        t2 = time.perf_counter()
    n_spans = sum(len(spans) for spans in per_rollout)
    built = sum(isinstance(e, Episode) for e in episodes)
    assert built == len(rollout_ids), f"{len(rollout_ids) - built} rollouts did not build: {episodes[:3]}"
    print(f"episode building: {built} episodes, {n_spans} spans, "
          f"{sum(len(e.transitions) for e in episodes)} transitions")
    return [
        Row("episode spans/s (store read + build)", n_spans / (t2 - t0), "raw ZeroMQ+MessagePack spans/s",
            args.raw_rate, "spans/s"),
        Row("episode spans/s (build only)", n_spans / (t2 - t1), "raw ZeroMQ+MessagePack spans/s",
            args.raw_rate, "spans/s"),
    ]


SECTIONS: list[Callable[[argparse.Namespace, Path], list[Row]]] = [section_ingest, section_episodes]
"""Each section measures one figure and its baseline in this run; append new ones here."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--senders", type=int, default=2, help="sender processes")
    parser.add_argument("--spans", type=int, default=100_000, help="spans per sender")
    parser.add_argument("--batch", type=int, default=512, help="spans per frame (SpanSender max_batch_spans)")
    args = parser.parse_args()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="lit-bench-ingest-") as tmp:
        for section in SECTIONS:
            rows.extend(section(args, Path(tmp)))
    print(f"\n| {'figure':38} | {'value':>10} | {'baseline':32} | {'value':>10} | {'ratio':>6} |")
    print(f"|{'-' * 40}|{'-' * 12}|{'-' * 34}|{'-' * 12}|{'-' * 8}|")
    for r in rows:
        print(f"| {r.figure:38} | {r.value:10,.0f} | {r.baseline_name:32} | {r.baseline:10,.0f} | "
              f"{r.value / r.baseline:6.2f} |")


if __name__ == "__main__":
    main()
