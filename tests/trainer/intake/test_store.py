"""The SQLite store: exact round trips, duplicates, rollout status rules, schema checks, threads, and a SIGKILL."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from lit_sdk import semconv as sc
from lit_sdk.protocol import STATUS_ERROR, STATUS_OK, SpanRecord, pack_span
from lit_trainer.intake.rows import ALLOWED_TRANSITIONS, RolloutRow, RolloutStatus, TaskRow
from lit_trainer.intake.store import SCHEMA_VERSION, SqliteStore, StoreError

TRACE = "0123456789abcdef" * 2


def span(n: int, rollout: str | None = "r1", parent: str | None = "f" * 16, name: str = "tool", **kw) -> SpanRecord:
    return SpanRecord(trace_id=TRACE, span_id=f"{n:016x}", parent_id=parent, name=name, start_ns=1_700_000_000 + n,
                      end_ns=1_700_000_100 + n, rollout_id=rollout, **kw)


@pytest.fixture
def store(tmp_path):
    with SqliteStore(tmp_path / "lit.db") as s:
        yield s


def test_every_span_field_round_trips_exactly(store):
    llm = span(1, name=sc.LLM_SPAN, status=STATUS_ERROR, status_message="Boom: ünïcode ✓", attributes={
        sc.LLM_PROMPT_TOKEN_IDS: [0, 1, 2**31, 151_643], sc.LLM_RESPONSE_LOGPROBS: [-0.1, -1e-300, 0.0],
        sc.AGENT_NAME: "solver", sc.LLM_TOKEN_IDS_MISSING: False, "big": 2**63 - 1, "neg": -(2**63), "f": 1.5,
        "empty": [], "strs": ["a", "b"]},
        events=[{"name": "exception", "time_ns": 1_700_000_050, "attributes": {"exception.type": "ValueError"}}])
    root = span(2, parent=None, name=sc.ROLLOUT_SPAN, status=STATUS_OK)
    other = span(3, rollout=None)
    assert store.add_spans([llm, root, other]) == (3, 0)
    assert store.spans_of_rollout("r1") == [llm, root]  # ordered by start time; the rollout-less span apart
    assert store.spans_of_rollout("nope") == []


def test_duplicates_are_stored_once_and_never_overwritten(store):
    first = span(1, attributes={"v": 1})
    assert store.add_spans([first, span(2)]) == (2, 0)
    changed = span(1, name="other", attributes={"v": 2})
    assert store.add_spans([changed, span(3), span(3)]) == (1, 2)  # across batches and within one
    assert store.spans_of_rollout("r1") == [first, span(2), span(3)]
    assert store.counts()["spans"] == 3


def test_batches_share_one_transaction_and_report_new_roots_once(store):
    root = span(9, parent=None, name=sc.ROLLOUT_SPAN)
    not_root = span(8, parent=None, name="some framework root")
    outcomes = store.add_span_batches([[span(1), root], [span(1), root, not_root], []])
    assert [(o.stored, o.duplicates, o.new_roots) for o in outcomes] == [(2, 0, ["r1"]), (1, 2, []), (0, 0, [])]
    (again,) = store.add_span_batches([[root]])
    assert (again.stored, again.duplicates, again.new_roots) == (0, 1, [])


def test_packed_spans_are_stored_as_the_bytes_given(store):
    record = span(1, attributes={"ids": [1, 2, 3], "f": 0.5})
    packed = pack_span(record)._replace(attributes=bytes.fromhex("82a369647393010203a166ca3f000000"))  # float32
    (outcome,) = store.add_packed_span_batches([[packed, packed]])
    assert (outcome.stored, outcome.duplicates) == (1, 1)
    (blob,) = store._conn().execute("SELECT attributes FROM spans").fetchone()
    assert blob == packed.attributes  # not re-encoded (MessagePack would write the float as float64)
    assert store.spans_of_rollout("r1") == [span(1, attributes={"ids": [1, 2, 3], "f": 0.5})]


def test_spans_outside_any_rollout_are_kept_once_and_apart_from_an_empty_rollout_id(store):
    assert store.add_spans([span(1, rollout=None), span(1, rollout=None), span(2, rollout="")]) == (2, 1)
    assert store.spans_of_rollout("") == [span(2, rollout="")]
    rows = store._conn().execute("SELECT span_id, nullif(rollout_id, x'') FROM spans ORDER BY span_id").fetchall()
    assert rows == [(f"{1:016x}", None), (f"{2:016x}", "")]


def test_a_failing_batch_stores_nothing_of_the_transaction(store):
    bad = span(2, attributes={"x": object()})  # MessagePack cannot encode it
    with pytest.raises(TypeError):
        store.add_span_batches([[span(1)], [bad]])
    assert store.counts()["spans"] == 0
    assert store.add_spans([span(1)]) == (1, 0)  # and the store goes on


def test_rollouts_by_step_and_status_transitions(store):
    store.add_rollouts([RolloutRow("a", "t1", step=3), RolloutRow("b", "t1", step=3, attempt=2),
                        RolloutRow("c", "t2", step=4, created_at=123.0)])
    assert [r.rollout_id for r in store.rollouts_of_step(3)] == ["a", "b"]
    assert store.rollouts_of_step(5) == []
    c = store.get_rollout("c")
    assert (c.task_id, c.step, c.attempt, c.status, c.created_at, c.started_at, c.ended_at, c.error) == (
        "t2", 4, 1, RolloutStatus.QUEUED, 123.0, None, None, None)
    assert store.get_rollout("zzz") is None

    store.set_rollout_status("a", RolloutStatus.RUNNING)
    store.set_rollout_status("a", RolloutStatus.FAILED, error="tool crashed")
    a = store.get_rollout("a")
    assert a.status is RolloutStatus.FAILED and a.error == "tool crashed"
    assert a.created_at <= a.started_at <= a.ended_at
    store.set_rollout_status("b", "timed_out")  # straight from the queue; a plain string is accepted
    assert store.get_rollout("b").status is RolloutStatus.TIMED_OUT and store.get_rollout("b").started_at is None

    with pytest.raises(StoreError, match="cannot go from failed to running; from failed it may go to nothing"):
        store.set_rollout_status("a", RolloutStatus.RUNNING)
    store.set_rollout_status("c", RolloutStatus.RUNNING)
    with pytest.raises(StoreError, match="from running to queued; from running it may go to failed, succeeded"):
        store.set_rollout_status("c", RolloutStatus.QUEUED)
    with pytest.raises(StoreError, match="no rollout 'zzz'"):
        store.set_rollout_status("zzz", RolloutStatus.RUNNING)
    with pytest.raises(StoreError, match="already stored"):
        store.add_rollouts([RolloutRow("d", "t", step=1), RolloutRow("a", "t", step=1)])
    assert store.get_rollout("d") is None  # the whole insert was refused


def test_attempts_a_killed_trainer_left_unfinished_end_failed_when_a_run_starts(store):
    store.add_rollouts([RolloutRow(r, "t", step=1) for r in ("queued", "running", "done", "failed")])
    store.set_rollout_status("running", RolloutStatus.RUNNING)
    store.set_rollout_status("done", RolloutStatus.SUCCEEDED)
    store.set_rollout_status("failed", RolloutStatus.FAILED, error="tool crashed")
    assert store.end_unfinished("the trainer stopped") == 2
    rows = {r.rollout_id: r for r in store.rollouts_of_step(1)}
    assert {k: (r.status, r.error) for k, r in rows.items()} == {
        "queued": (RolloutStatus.FAILED, "the trainer stopped"),
        "running": (RolloutStatus.FAILED, "the trainer stopped"),
        "done": (RolloutStatus.SUCCEEDED, None), "failed": (RolloutStatus.FAILED, "tool crashed")}
    assert rows["running"].ended_at is not None and store.end_unfinished("again") == 0


def test_transition_table_is_forward_only():
    order = list(RolloutStatus)
    for source, targets in ALLOWED_TRANSITIONS.items():
        assert all(order.index(t) > order.index(source) for t in targets), source


def test_tasks_episodes_and_counts(store):
    assert store.add_tasks([TaskRow("t1", "train", {"q": "2+3", "a": [5]}), TaskRow("t2", "test", "plain")]) == 2
    assert store.add_tasks([TaskRow("t1", "train", {"changed": True}), TaskRow("t3", "train", None)]) == 1
    assert store.get_task("t1") == TaskRow("t1", "train", {"q": "2+3", "a": [5]})
    assert store.get_task("t3") == TaskRow("t3", "train", None)
    assert store.get_task("t9") is None

    data = {"transitions": [{"prompt_ids": [1, 2], "response_ids": [3], "logprobs": [-0.5], "reward": None}]}
    store.save_episode("r1", data, 1.0)
    first = store.get_episode("r1")
    assert (first.rollout_id, first.data, first.episode_return) == ("r1", data, 1.0)
    store.save_episode("r1", {"rebuilt": True}, None)  # a later build replaces the earlier one
    again = store.get_episode("r1")
    assert (again.data, again.episode_return) == ({"rebuilt": True}, None) and again.built_at >= first.built_at
    assert store.get_episode("r2") is None
    store.add_spans([span(1)])
    assert store.counts() == {"spans": 1, "rollouts": 0, "tasks": 3, "episodes": 1}


def test_reopening_keeps_everything(tmp_path):
    with SqliteStore(tmp_path / "s.db") as s:
        s.add_spans([span(1)])
        s.add_rollouts([RolloutRow("a", "t", step=0)])
    with SqliteStore(tmp_path / "s.db") as s:
        assert s.spans_of_rollout("r1") == [span(1)] and s.get_rollout("a").task_id == "t"
        assert s.add_spans([span(1)]) == (0, 1)
        mode, sync = (s._conn().execute(f"PRAGMA {p}").fetchone()[0] for p in ("journal_mode", "synchronous"))
        assert (mode, sync) == ("wal", 2)  # 2 is FULL


def test_refuses_files_that_are_not_lit_stores_of_this_version(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello, this is not a database at all\n" * 100)
    with pytest.raises(StoreError, match="notes.txt is not a lit store"):
        SqliteStore(text)
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE users (id INTEGER)")
    with pytest.raises(StoreError, match="not a lit store .no lit_schema table; tables: users"):
        SqliteStore(foreign)
    future = tmp_path / "future.db"
    SqliteStore(future).close()
    with sqlite3.connect(future) as conn:
        conn.execute("UPDATE lit_schema SET version = ?", (SCHEMA_VERSION + 1,))
    with pytest.raises(StoreError, match=f"schema version {SCHEMA_VERSION + 1}; this lit reads version "
                                         f"{SCHEMA_VERSION} only"):
        SqliteStore(future)


_SCHEMA_1 = """
CREATE TABLE lit_schema (app TEXT NOT NULL, version INTEGER NOT NULL);
INSERT INTO lit_schema VALUES ('lit', 1);
CREATE TABLE spans (
    span_id TEXT PRIMARY KEY, trace_id TEXT NOT NULL, parent_id TEXT, rollout_id TEXT, name TEXT NOT NULL,
    start_ns INTEGER NOT NULL, end_ns INTEGER NOT NULL, status INTEGER NOT NULL, status_message TEXT NOT NULL,
    attributes BLOB NOT NULL, events BLOB NOT NULL);
CREATE INDEX spans_of_rollout ON spans (rollout_id);
"""


def test_a_store_of_schema_version_1_is_refused_with_the_versions_named(tmp_path):
    old = tmp_path / "v1.db"
    with sqlite3.connect(old) as conn:
        conn.executescript(_SCHEMA_1)
    with pytest.raises(StoreError, match=f"v1.db has schema version 1; this lit reads version {SCHEMA_VERSION} only "
                                         ".use a new store"):
        SqliteStore(old)
    with sqlite3.connect(old) as conn:  # and it was left as it was
        assert conn.execute("SELECT version FROM lit_schema").fetchone() == (1,)


def test_closed_store_refuses_calls(tmp_path):
    s = SqliteStore(tmp_path / "s.db")
    s.close()
    s.close()  # idempotent
    with pytest.raises(StoreError, match="is closed"):
        s.add_spans([span(1)])


def test_one_thread_writes_while_another_reads(store):
    errors: list[BaseException] = []
    seen: list[int] = []

    def write() -> None:
        try:
            for batch in range(40):
                store.add_spans([span(batch * 50 + i) for i in range(50)])
        except BaseException as exc:
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    deadline = time.monotonic() + 30
    while writer.is_alive() and time.monotonic() < deadline:
        n = len(store.spans_of_rollout("r1"))
        assert n % 50 == 0, "a reader saw half a transaction"
        seen.append(n)
    writer.join(30)
    assert not errors and not writer.is_alive()
    assert seen == sorted(seen)
    assert len(store.spans_of_rollout("r1")) == 2000


_WRITER = textwrap.dedent("""
    import sys
    from lit_sdk.protocol import SpanRecord
    from lit_trainer.intake.store import SqliteStore

    store = SqliteStore(sys.argv[1])
    attrs = {"lit.llm.prompt_token_ids": list(range(300)), "pad": "x" * 2000}
    for batch in range(100_000):
        spans = [SpanRecord("ab" * 16, f"{batch * 100 + i:016x}", None, "s", 1, 2, rollout_id="r",
                            attributes=attrs) for i in range(100)]
        store.add_spans(spans)
        print(batch, flush=True)  # acknowledged: committed
""")


def test_store_survives_sigkill_of_a_writer_mid_write(tmp_path):
    path = tmp_path / "killed.db"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    acknowledged = -1
    try:
        deadline = time.monotonic() + 30
        while acknowledged < 30 and time.monotonic() < deadline:  # let it get well into writing
            line = proc.stdout.readline()
            assert line, f"the writer exited early with {proc.poll()}"
            acknowledged = int(line)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    assert acknowledged >= 30
    for line in proc.stdout:  # acknowledgements printed before the kill that we had not read yet
        acknowledged = int(line)
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    with SqliteStore(path) as s:
        stored = {r.span_id for r in s.spans_of_rollout("r")}
        expected = {f"{n:016x}" for n in range((acknowledged + 1) * 100)}
        assert expected <= stored
        assert len(stored) % 100 == 0, "a transaction was half kept"
        assert s.add_spans([SpanRecord("ab" * 16, "f" * 16, None, "after", 1, 2)]) == (1, 0)
