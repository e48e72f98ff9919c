"""The collector: a real ZeroMQ ROUTER on 127.0.0.1 writing into a real SQLite store.

Frames come from a plain DEALER (to send exactly the bytes a test wants, garbage included), from the SDK's
``SpanSender``, and from a real instrumented agent calling a fake vLLM through the plain openai client.
"""

from __future__ import annotations

import random
import threading
import time

import msgpack
import pytest
import zmq
from fake_llm import FakeLLM
from handed_out import hand_out
from openai import OpenAI

import lit_sdk as lit
from lit_sdk import protocol
from lit_sdk import semconv as sc
from lit_sdk.protocol import codec
from lit_sdk.sender import SpanSender
from lit_trainer.intake.collector import Collector, CollectorError
from lit_trainer.intake.store import SqliteStore, StoreError

TRACE = "0123456789abcdef" * 2
WAIT_S = 10.0


def span(n: int, rollout: str = "r1", parent: str | None = "f" * 16, name: str = "tool") -> protocol.SpanRecord:
    return protocol.SpanRecord(trace_id=TRACE, span_id=f"{n:016x}", parent_id=parent, name=name, start_ns=n,
                               end_ns=n + 1, rollout_id=rollout, attributes={"n": n, "ids": [n, n + 1]})


def spans_frame(batch: str, spans: list[protocol.SpanRecord]) -> bytes:
    return protocol.encode_spans(batch, "test", spans)


class Client:
    """A plain DEALER: sends raw bytes, reads decoded replies with a bounded wait."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, data: bytes) -> None:
        self.sock.send(data)

    def replies(self, n: int) -> list[protocol.Frame]:
        out = []
        deadline = time.monotonic() + WAIT_S
        while len(out) < n and time.monotonic() < deadline:
            if self.sock.poll(100):
                out.append(protocol.decode_frame(self.sock.recv()))
        assert len(out) == n, f"{len(out)} of {n} replies came within {WAIT_S} s"
        assert not self.sock.poll(50), "more replies than frames that deserve one"
        return out

    def close(self) -> None:
        self.sock.close()


HANDED_OUT = ("r1", "r7", "rA", "rB", "rZ", *(f"r{i}" for i in range(10)))
"""The rollouts these tests send spans of, registered as the dispatcher registers what it hands out."""


@pytest.fixture
def store(tmp_path):
    with SqliteStore(tmp_path / "lit.db") as s:
        hand_out(s, *HANDED_OUT)
        hand_out(s, "r-agent", secret="the-attempt-secret")
        yield s


@pytest.fixture
def collector(store):
    with Collector(store, "tcp://127.0.0.1:0", open_to_local_users=True) as c:
        yield c


@pytest.fixture
def client(collector):
    c = Client(collector.endpoint)
    yield c
    c.close()


def start_on(store: SqliteStore, endpoint: str, **kw) -> Collector:
    """A collector on a fixed endpoint; the previous one's port is freed by ZeroMQ a moment after it closes."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return Collector(store, endpoint, **kw, open_to_local_users=True).start()
        except CollectorError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_ack_after_commit_with_counts_and_a_random_port(collector, client, store):
    assert collector.endpoint.startswith("tcp://127.0.0.1:") and not collector.endpoint.endswith(":0")
    client.send(spans_frame("b1", [span(1), span(2)]))
    (ack,) = client.replies(1)
    assert ack == protocol.AckFrame("b1", stored=2, duplicates=0)
    assert store.spans_of_rollout("r1") == [span(1), span(2)]  # readable as soon as acknowledged
    counts = collector.counts
    assert (counts.frames, counts.spans_stored, counts.duplicates, counts.rejected) == (1, 2, 0, {})


def test_duplicates_across_frames_and_a_collector_restart(store):
    seen: list[str] = []
    root = span(9, rollout="r7", parent=None, name=sc.ROLLOUT_SPAN)
    first = Collector(store, "tcp://127.0.0.1:0", on_root_span=seen.append, open_to_local_users=True).start()
    endpoint = first.endpoint
    client = Client(endpoint)
    try:
        client.send(spans_frame("b1", [span(1), root]))
        client.send(spans_frame("b2", [span(1), span(2), root]))
        assert client.replies(2) == [protocol.AckFrame("b1", 2, 0), protocol.AckFrame("b2", 1, 2)]
        first.stop()
        second = start_on(store, endpoint, on_root_span=seen.append)
        try:
            client.send(spans_frame("b2", [span(1), span(2), root]))  # a resend after the trainer restarted
            assert client.replies(1) == [protocol.AckFrame("b2", 0, 3)]
            assert second.counts.duplicates == 3
        finally:
            second.stop()
    finally:
        client.close()
    assert seen == ["r7"]  # the root was reported once, not for its duplicates
    assert store.counts()["spans"] == 3


def test_on_root_span_runs_after_the_commit(store):
    found: list[list[str]] = []

    def on_root(rollout_id: str) -> None:
        found.append([s.name for s in store.spans_of_rollout(rollout_id)])

    with Collector(store, "tcp://127.0.0.1:0", on_root_span=on_root, open_to_local_users=True) as collector:
        client = Client(collector.endpoint)
        root = span(5, rollout="rA", parent=None, name=sc.ROLLOUT_SPAN)
        client.send(spans_frame("b1", [span(1, rollout="rA", name=sc.LLM_SPAN), root]))
        client.send(spans_frame("b2", [span(2, rollout="rB", parent=None, name="not lit's root")]))
        client.replies(2)
        client.close()
    assert found == [[sc.LLM_SPAN, sc.ROLLOUT_SPAN]]


def garbage(rng: random.Random, kind: str, i: int) -> tuple[bytes, bool]:
    """A bad frame of the given kind, and whether it carries a readable batch id (so deserves a nack)."""
    good = span(10_000 + i).to_wire()
    frame = {"v": 1, "t": "spans", "batch": f"bad-{i}", "sender": "x", "spans": [good]}
    if kind == "decode":
        variants = [(b"", False), (b"\xc1", False), (bytes(rng.randrange(128, 256) for _ in range(9)) + b"\xc1", False),
                    (msgpack.packb(frame)[:-5], True)]  # truncated: its batch id, early in the map, is readable
        return rng.choice(variants)
    if kind == "shape":
        variants = [[1, 2], "text", {**frame, "batch": 7}, {**frame, "spans": "nope"}, {**frame, "sender": None}]
        choice = rng.randrange(len(variants))
        return msgpack.packb(variants[choice]), choice >= 3
    if kind == "version":
        return msgpack.packb({**frame, "v": rng.choice([0, 2, None, "1"])}), True
    if kind == "type":
        if rng.random() < 0.5:
            return protocol.encode_ack(f"bad-{i}", 1, 0), True  # valid, but not for the collector
        return msgpack.packb({**frame, "t": "bogus"}), True
    if kind == "span":
        field, value = rng.choice([("span_id", "XYZ"), ("trace_id", 5), ("status", 9), ("start_ns", "0"),
                                   ("attributes", []), ("events", {}), ("name", None), ("parent_id", "g" * 16)])
        bad = {**good, field: value}
        return msgpack.packb({**frame, "spans": [good, bad]}), True
    assert kind == "too_large"
    return msgpack.packb({**frame, "pad": "x" * 5000}), True


def test_a_thousand_garbage_frames_leave_the_collector_running_and_the_data_intact(monkeypatch, store):
    monkeypatch.setattr(codec, "MAX_FRAME_BYTES", 4096)  # so "too large" frames are cheap to make
    rng = random.Random(4)
    kinds = ["decode", "shape", "version", "type", "span", "too_large"]
    expected: dict[str, int] = {}
    nacks, sent_good = 0, []
    with Collector(store, "tcp://127.0.0.1:0", open_to_local_users=True) as collector:
        client = Client(collector.endpoint)
        for i in range(1000):
            kind = kinds[i % len(kinds)] if i < 600 else rng.choice(kinds)
            data, readable = garbage(rng, kind, i)
            client.send(data)
            expected[kind] = expected.get(kind, 0) + 1
            nacks += readable
            if i % 10 == 0:
                good = [span(i * 10 + k, rollout=f"r{i % 7}") for k in range(3)]
                client.send(spans_frame(f"good-{i}", good))
                sent_good.extend(good)
        replies = client.replies(nacks + 100)
        last = [span(99_999, rollout="r0")]
        client.send(spans_frame("last", last))  # frames are handled in order: once this is acked, all were
        assert client.replies(1) == [protocol.AckFrame("last", 1, 0)]
        sent_good += last
        collector.check()
        assert collector.counts.rejected == expected
        assert collector.counts.frames == 101 and collector.counts.spans_stored == 301
        client.close()
    acks = [r for r in replies if isinstance(r, protocol.AckFrame)]
    assert sorted(a.batch for a in acks) == sorted(f"good-{i}" for i in range(0, 1000, 10))
    assert all((a.stored, a.duplicates) == (3, 0) for a in acks)
    refused = [r for r in replies if isinstance(r, protocol.NackFrame)]
    assert len(refused) == nacks and all(r.batch.startswith("bad-") for r in refused)
    stored = [s for r in range(7) for s in store.spans_of_rollout(f"r{r}")]
    assert sorted(stored, key=lambda s: s.span_id) == sorted(sent_good, key=lambda s: s.span_id)
    assert store.counts()["spans"] == 301  # no span of a bad frame was stored, not even its good ones


def test_a_frame_with_invalid_attributes_is_rejected_and_counted(collector, client, store):
    """Attributes are stored as the agent sent them, undecoded; they are still checked before anything is kept."""
    wire = span(1).to_wire()
    bad_utf8 = msgpack.packb({"v": 1, "t": "spans", "batch": "b1", "sender": "s",
                              "spans": [wire, {**span(2).to_wire(), "attributes": {"k": "abc"}}]})
    client.send(bad_utf8.replace(b"\xa3abc", b"\xa3\xff\xfe\xfd"))
    client.send(msgpack.packb({"v": 1, "t": "spans", "batch": "b2", "sender": "s",
                               "spans": [wire, {**span(3).to_wire(), "attributes": ["not", "a", "map"]}]}))
    client.send(spans_frame("b3", [span(4)]))
    replies = client.replies(3)
    assert [type(r).__name__ for r in replies] == ["NackFrame", "NackFrame", "AckFrame"]
    assert replies[0].reason.startswith("decode:") and "'attributes' must be a map" in replies[1].reason
    assert collector.counts.rejected == {"decode": 1, "span": 1}
    assert store.spans_of_rollout("r1") == [span(4)]  # not even the good first span of a bad frame


def test_rejections_are_logged_once_per_kind(collector, client, caplog):
    with caplog.at_level("WARNING", logger="lit"):
        for i in range(5):
            client.send(msgpack.packb({"v": 9, "t": "spans", "batch": f"b{i}"}))
            client.send(b"\xc1")
        client.send(spans_frame("last", [span(1)]))  # handled after all the others
        client.replies(6)
    lines = [r.getMessage() for r in caplog.records if "rejected a frame" in r.getMessage()]
    assert len(lines) == 2 and any("(version)" in line for line in lines) and any("(decode)" in line for line in lines)
    assert collector.counts.rejected == {"version": 5, "decode": 5}


def test_a_busy_port_names_the_endpoint_and_the_setting(collector, store):
    with pytest.raises(CollectorError) as info:
        Collector(store, collector.endpoint, open_to_local_users=True).start()
    message = str(info.value)
    assert collector.endpoint in message and "already in use" in message and "Collector(endpoint=...)" in message
    assert "collector.endpoint in a lit train config" in message
    assert "LIT_ENDPOINT" in message


def test_an_error_in_the_thread_is_raised_in_the_caller(tmp_path):
    broken = SqliteStore(tmp_path / "broken.db")
    collector = Collector(broken, "tcp://127.0.0.1:0", open_to_local_users=True).start()
    broken.close()
    client = Client(collector.endpoint)
    try:
        client.send(spans_frame("b1", [span(1)]))
        deadline = time.monotonic() + WAIT_S
        with pytest.raises(CollectorError, match="is closed") as info:
            while time.monotonic() < deadline:
                collector.check()
                time.sleep(0.01)
        assert isinstance(info.value.__cause__, StoreError)
        assert not client.sock.poll(50), "a frame that was not stored must not be acknowledged"
        collector.stop()  # the error was raised once already
    finally:
        client.close()


def test_an_error_in_on_root_span_is_raised_by_stop(store):
    def on_root(rollout_id: str) -> None:
        raise RuntimeError(f"callback failed for {rollout_id}")

    collector = Collector(store, "tcp://127.0.0.1:0", on_root_span=on_root, open_to_local_users=True).start()
    client = Client(collector.endpoint)
    client.send(spans_frame("b1", [span(1, rollout="rZ", parent=None, name=sc.ROLLOUT_SPAN)]))
    assert client.replies(1) == [protocol.AckFrame("b1", 1, 0)]  # stored and acknowledged before the callback
    client.close()
    with pytest.raises(RuntimeError, match="callback failed for rZ"):
        collector.stop()


def test_the_sdk_span_sender_interoperates(collector, store, tmp_path):
    sender = SpanSender(collector.endpoint, spool_dir=tmp_path / "spool", max_batch_spans=64, linger_s=0.01)
    try:
        wire = [span(i, rollout=f"r{i % 3}").to_wire() for i in range(500)]
        for s in wire:
            sender.submit(s)
        sender.submit({**span(999).to_wire(), "status": 7})  # refused for good: its batch is nacked
        counts = sender.flush(timeout=WAIT_S)
    finally:
        sender.shutdown(timeout=1)
    assert counts.pending == 0 and counts.dropped == 0
    assert counts.acknowledged + counts.rejected == 501 and 1 <= counts.rejected <= 64
    assert counts.duplicates == 0
    assert collector.counts.rejected == {"span": 1}
    stored = {s.span_id for r in range(3) for s in store.spans_of_rollout(f"r{r}")}
    assert len(stored) == counts.acknowledged == collector.counts.spans_stored


def test_end_to_end_from_a_real_instrumented_agent(store, tmp_path):
    finished = threading.Event()
    roots: list[str] = []

    def on_root(rollout_id: str) -> None:
        roots.append(rollout_id)
        finished.set()

    with FakeLLM() as llm, \
            Collector(store, "tcp://127.0.0.1:0", on_root_span=on_root, open_to_local_users=True) as collector:
        # The plain openai client is patched by lit itself; no framework instrumentor is needed.
        lit.instrument(endpoint=collector.endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path / "spool",
                       frameworks=[])
        try:
            client = OpenAI(base_url=llm.base_url, api_key="x")

            @lit.trace(agent="solver")
            def solve(task: str) -> float:
                for _ in range(2):
                    client.chat.completions.create(model="m", messages=[{"role": "user", "content": task}])
                lit.reward(0.5, name="halfway")
                return 1.0

            with lit.assign_rollout("r-agent", secret="the-attempt-secret"):  # as a lit worker does
                assert solve("2+3?") == 1.0
            counts = lit.flush(timeout=WAIT_S)
            assert counts.pending == 0 and counts.rejected == 0 and counts.dropped == 0
            assert finished.wait(WAIT_S)
        finally:
            lit.uninstrument()
        responses = list(llm.responses)
    (rollout_id,) = roots
    spans = store.spans_of_rollout(rollout_id)
    by_name = {name: [s for s in spans if s.name == name] for name in (sc.ROLLOUT_SPAN, sc.LLM_SPAN, sc.REWARD_SPAN)}
    (root,) = by_name[sc.ROLLOUT_SPAN]
    assert root.parent_id is None and root.attributes[sc.ROLLOUT_RETURN_REWARD] == 1.0
    assert len(by_name[sc.LLM_SPAN]) == 2 and len(responses) == 2
    for stored, response in zip(sorted(by_name[sc.LLM_SPAN], key=lambda s: s.start_ns), responses, strict=True):
        choice = response["choices"][0]
        assert stored.attributes[sc.LLM_PROMPT_TOKEN_IDS] == response["prompt_token_ids"]
        assert stored.attributes[sc.LLM_RESPONSE_TOKEN_IDS] == choice["token_ids"]
        assert stored.attributes[sc.LLM_RESPONSE_LOGPROBS] == [c["logprob"] for c in choice["logprobs"]["content"]]
        assert stored.attributes[sc.AGENT_NAME] == "solver" and stored.trace_id == root.trace_id
    (reward,) = by_name[sc.REWARD_SPAN]
    assert reward.attributes[sc.REWARD_VALUE] == 0.5
    assert all(s.rollout_id == rollout_id for s in spans)
