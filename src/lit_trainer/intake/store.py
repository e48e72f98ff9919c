"""The trainer's durable store: spans, rollouts, tasks and episodes, behind a small ``Store`` interface
(``rows.py``, with the rows it reads and writes).

``SqliteStore`` is the embedded default, one SQLite file in WAL mode. What it promises:

- **Durability**: ``synchronous=FULL``. In WAL mode every commit appends to the write-ahead log and fsyncs it before
  ``commit`` returns, so a transaction that committed survives a SIGKILL of the process (NORMAL would give that too)
  *and* an OS crash or power loss (NORMAL may lose the last commits then). The collector acknowledges a batch only
  after its commit, and an acknowledged batch is dropped by the agent, so FULL is what makes an ack mean "kept".
  The price is one fsync per transaction; the collector writes many frames per transaction, so it is small.
  Corruption is excluded by SQLite's journal in either mode.
- **Threads**: one connection per thread (made on first use), so the collector thread writes while the training
  loop reads from its own snapshot without waiting (WAL lets readers and one writer run together). Writes open
  with ``BEGIN IMMEDIATE``, so two writing threads queue on the busy timeout instead of failing on a lock upgrade.
  ``close()`` closes every thread's connection (a finished thread's stays open until then): call it once the
  other threads are done with the store.
- **Layout**: 16 KiB pages (span rows are 0.3-2 KB), 32 MiB page cache per connection, SQLite's default automatic
  checkpoints. Span attributes and events are MessagePack blobs (as the agent sent them, when they come through
  the collector), decoded only when read back. Spans live in one ``WITHOUT ROWID`` b-tree keyed by
  ``(rollout_id, span_id)``: one b-tree to write per span instead of three (table, span-id index, rollout index),
  which cut the insert time (bench/README.md), and a rollout's spans side by side for ``spans_of_rollout``.
- **Spans** are kept once per (rollout id, span id): a second delivery is a duplicate, counted and not written
  over. A span outside any rollout is keyed by the empty BLOB ``x''`` (key columns cannot be NULL, and no text
  rollout id equals a BLOB), read back as ``rollout_id=None``.
- **Rollout status** moves forward only: ``queued → running → {succeeded, failed, timed_out}``, and a queued rollout
  may end directly (it timed out waiting, failed to start, or its root span arrived before the running notice).
  An ended rollout is final; a retry is a new rollout with ``attempt + 1``.

Episodes are stored as whatever MessagePack-able dict the caller gives; the advantage each transition got in the
update, so that a rollout can be viewed as it was trained on (``lit show``). The store knows the span record of
``lit_sdk.protocol`` and, from ``semconv``, which span is a rollout's root (so that it can say which roots a batch
stored for the first time).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from lit_sdk import semconv
from lit_sdk.protocol import SPAN_FIELDS, PackedSpan, SpanRecord, codec, pack_span
from lit_trainer.intake.admission import Admission, is_root
from lit_trainer.intake.rows import (
    ALLOWED_TRANSITIONS,
    AdvantageRow,
    BatchOutcome,
    EpisodeRow,
    RolloutRow,
    RolloutStatus,
    TaskRow,
)

SCHEMA_VERSION = 3
"""A store of another version is refused with both versions named (none was released before 3)."""
_APP = "lit"
_PAGE_SIZE = 16384
_IN_CHUNK = 500
"""Rollout ids per ``IN (...)`` query when the collector looks up the rollouts of a batch."""
_BUSY_TIMEOUT_S = 30.0
"""How long a write waits for another thread's or process's write transaction before failing."""


class StoreError(RuntimeError):
    """The store cannot do what was asked: not a lit store, another schema version, closed, a bad transition."""


_SCHEMA = """
CREATE TABLE lit_schema (app TEXT NOT NULL, version INTEGER NOT NULL);
CREATE TABLE spans (
    trace_id TEXT NOT NULL, span_id TEXT NOT NULL, parent_id TEXT, name TEXT NOT NULL, start_ns INTEGER NOT NULL,
    end_ns INTEGER NOT NULL, status INTEGER NOT NULL, status_message TEXT NOT NULL, rollout_id TEXT NOT NULL,
    attributes BLOB NOT NULL, events BLOB NOT NULL, PRIMARY KEY (rollout_id, span_id)) WITHOUT ROWID;
CREATE TABLE rollouts (
    rollout_id TEXT PRIMARY KEY, task_id TEXT NOT NULL, attempt INTEGER NOT NULL, step INTEGER NOT NULL,
    status TEXT NOT NULL, created_at REAL NOT NULL, started_at REAL, ended_at REAL, error TEXT, secret TEXT);
CREATE INDEX rollouts_of_step ON rollouts (step);
CREATE TABLE tasks (task_id TEXT PRIMARY KEY, split TEXT NOT NULL, payload TEXT NOT NULL);
CREATE TABLE episodes (
    rollout_id TEXT PRIMARY KEY, data BLOB NOT NULL, episode_return REAL, built_at REAL NOT NULL);
CREATE TABLE advantages (
    rollout_id TEXT NOT NULL, transition INTEGER NOT NULL, step INTEGER NOT NULL, advantage REAL NOT NULL,
    trainer_logprobs BLOB, PRIMARY KEY (rollout_id, transition)) WITHOUT ROWID;
CREATE TABLE superseded (
    rollout_id TEXT PRIMARY KEY, restart_step INTEGER NOT NULL, at REAL NOT NULL) WITHOUT ROWID;
"""
_ROLLOUT_KEY_IN, _ROLLOUT_KEY_OUT = "coalesce(?, x'')", "nullif(rollout_id, x'')"
"""A span outside any rollout is keyed by the empty BLOB (key columns cannot be NULL) and read back as None."""
_SPAN_COLUMNS = ", ".join(SPAN_FIELDS)
"""In ``PackedSpan``'s field order, so that a PackedSpan binds as it is."""
_INSERT_SPAN = (f"INSERT OR IGNORE INTO spans ({_SPAN_COLUMNS}) VALUES "
                f"({', '.join(_ROLLOUT_KEY_IN if f == 'rollout_id' else '?' for f in SPAN_FIELDS)})")
_SELECT_SPANS = f"SELECT {', '.join(_ROLLOUT_KEY_OUT if f == 'rollout_id' else f for f in SPAN_FIELDS)} FROM spans"
_ROLLOUT_COLUMNS = "rollout_id, task_id, step, attempt, status, created_at, started_at, ended_at, error, secret"


class SqliteStore:
    """The ``Store`` in one SQLite file at ``path`` (created with the schema if new or empty)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[sqlite3.Connection] = []
        self._closed = False
        try:
            conn = self._conn()
            with self._write(conn):
                self._check_schema(conn)
        except BaseException:
            self.close()
            raise

    # -- connections -------------------------------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is not None and not self._closed:
            return conn
        with self._lock:
            if self._closed:
                raise StoreError(f"the store at {self.path} is closed")
            conn = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_S, isolation_level=None,
                                   check_same_thread=False)  # used by its own thread only; closed by close()
            self._connections.append(conn)
        try:
            # Takes effect only on a new file, and only before WAL mode is entered. Span rows are 0.3-2 KB:
            # 16 KiB pages insert faster than the default 4 KiB (bench/README.md).
            conn.execute(f"PRAGMA page_size={_PAGE_SIZE}")
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path} is not a lit store (SQLite cannot open it: {exc})") from None
        if mode != "wal":
            raise StoreError(f"{self.path}: SQLite refused WAL mode (journal_mode stays {mode!r})")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA cache_size=-32768")  # KiB: 32 MiB of pages per connection
        self._local.conn = conn
        return conn

    def _write(self, conn: sqlite3.Connection) -> _WriteTransaction:
        return _WriteTransaction(conn)

    def _check_schema(self, conn: sqlite3.Connection) -> None:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            for statement in filter(str.strip, _SCHEMA.split(";")):
                conn.execute(statement)
            conn.execute("INSERT INTO lit_schema VALUES (?, ?)", (_APP, SCHEMA_VERSION))
            return
        if "lit_schema" not in tables:
            raise StoreError(f"{self.path} is an SQLite database but not a lit store (no lit_schema table; "
                             f"tables: {', '.join(sorted(tables))})")
        row = conn.execute("SELECT app, version FROM lit_schema").fetchone()
        if row is None or row[0] != _APP:
            raise StoreError(f"{self.path} is not a lit store (lit_schema says {row!r})")
        if row[1] != SCHEMA_VERSION:
            raise StoreError(f"the store at {self.path} has schema version {row[1]}; this lit reads version "
                             f"{SCHEMA_VERSION} only (use a new store file, or the lit version that wrote it)")

    def close(self) -> None:
        """Close every thread's connection. Idempotent; later calls of any method raise StoreError."""
        with self._lock:
            self._closed = True
            connections, self._connections = self._connections, []
        for conn in connections:
            conn.close()

    # -- spans ---------------------------------------------------------------------------------------------------

    def add_spans(self, records: Sequence[SpanRecord]) -> tuple[int, int]:
        """Store spans in one transaction; (stored, duplicates). A span id already stored is not overwritten."""
        outcome = self.add_span_batches([records])[0]
        return outcome.stored, outcome.duplicates

    def add_span_batches(self, batches: Sequence[Sequence[SpanRecord]]) -> list[BatchOutcome]:
        """Store several batches in ONE transaction; what each batch did, in order."""
        pack = codec.packer()
        return self.add_packed_span_batches([[pack_span(r, pack) for r in records] for records in batches])

    def add_packed_span_batches(self, batches: Sequence[Sequence[PackedSpan]], admit: bool = False
                                ) -> list[BatchOutcome]:
        """``add_span_batches`` for spans whose attributes and events are already MessagePack (the collector's).
        ``admit``: the spans come from peers (the collector): only spans of rollouts this store holds are stored,
        and one root per rollout, carrying its secret (intake/admission.py); the others are counted in
        ``BatchOutcome.refused``. Without it the caller is trusted (the trainer's own code, tools, tests)."""
        conn = self._conn()
        outcomes = []
        with self._write(conn):
            admission = Admission(lambda rollout_ids: self._admission_of(conn, rollout_ids),
                                  lambda rollout_ids: self._usage_of(conn, rollout_ids))
            for spans in batches:
                before = conn.total_changes
                if admit:  # the admission knows which roots are new: every span in one call
                    admitted, refused, new_roots = admission.admit(spans)
                    conn.executemany(_INSERT_SPAN, admitted)
                else:  # roots one by one, to learn which were new; the rest (nine in ten spans) in one call
                    admitted, refused = spans, {}
                    roots = [s for s in admitted if is_root(s)]
                    conn.executemany(_INSERT_SPAN, [s for s in admitted if not is_root(s)] if roots else admitted)
                    new_roots = [s.rollout_id for s in roots if conn.execute(_INSERT_SPAN, s).rowcount]
                stored = conn.total_changes - before
                outcomes.append(BatchOutcome(stored, len(admitted) - stored, new_roots, refused))  # type: ignore[arg-type]
        return outcomes

    @staticmethod
    def _admission_of(conn: sqlite3.Connection, rollout_ids: list[str]) -> dict[str, tuple[str | None, str | None]]:
        """For each of ``rollout_ids`` the store holds: its secret and its stored root's span id (None: none)."""
        found: dict[str, tuple[str | None, str | None]] = {}
        for i in range(0, len(rollout_ids), _IN_CHUNK):
            chunk = rollout_ids[i:i + _IN_CHUNK]
            marks = ",".join("?" * len(chunk))
            secrets = dict(conn.execute(f"SELECT rollout_id, secret FROM rollouts WHERE rollout_id IN ({marks})",
                                        chunk).fetchall())
            roots = dict(conn.execute(f"SELECT rollout_id, span_id FROM spans WHERE rollout_id IN ({marks}) AND "
                                      "parent_id IS NULL AND name = ?", (*chunk, semconv.ROLLOUT_SPAN)).fetchall())
            found.update((rid, (secret, roots.get(rid))) for rid, secret in secrets.items())
        return found

    @staticmethod
    def _usage_of(conn: sqlite3.Connection, rollout_ids: list[str | None]) -> dict[str | None, tuple[int, int]]:
        """For each of ``rollout_ids`` with spans stored (None: outside any rollout): how many, and their bytes of
        attributes and events (``admission.MAX_ROLLOUT_SPANS``, ``MAX_ROLLOUT_BYTES``)."""
        keys = [b"" if rollout_id is None else rollout_id for rollout_id in rollout_ids]
        found: dict[str | None, tuple[int, int]] = {}
        for i in range(0, len(keys), _IN_CHUNK):
            chunk = keys[i:i + _IN_CHUNK]
            rows = conn.execute(f"SELECT rollout_id, count(*), total(length(attributes) + length(events)) FROM spans "
                                f"WHERE rollout_id IN ({','.join('?' * len(chunk))}) GROUP BY rollout_id", chunk)
            found.update((None if isinstance(key, bytes) else key, (n, int(size))) for key, n, size in rows)
        return found

    def spans_of_rollout(self, rollout_id: str) -> list[SpanRecord]:
        """Every stored span of the rollout, ordered by start time (then span id)."""
        rows = self._conn().execute(f"{_SELECT_SPANS} WHERE rollout_id = ? ORDER BY start_ns, span_id",
                                    (rollout_id,))
        return [PackedSpan(*row).unpack() for row in rows]

    def missing_spans(self, rollout_id: str) -> str | None:
        """None when every span the rollout's root declared (``semconv.ROLLOUT_SPANS``: how many had ended when it
        ended) is stored; otherwise what is missing, in words. A root from an SDK that declares no count is taken
        as complete."""
        conn = self._conn()
        stored = conn.execute("SELECT count(*) FROM spans WHERE rollout_id = ? AND name NOT LIKE ?",
                              (rollout_id, semconv.ENGINE_PREFIX + "%")).fetchone()[0]  # the gateway's: not sent
        row = conn.execute("SELECT attributes FROM spans WHERE rollout_id = ? AND parent_id IS NULL AND name = ?",
                           (rollout_id, semconv.ROLLOUT_SPAN)).fetchone()
        if row is None:
            if not stored:
                return ("none of its spans was stored: is the agent function decorated with @lit.trace, and did "
                        "lit.instrument() run in its process (lit worker does both checks)?")
            return f"its root span was not stored ({stored} other spans were)"
        declared = codec.unpackb(row[0], strict_map_key=False).get(semconv.ROLLOUT_SPANS)
        if type(declared) is int and stored < declared:
            return f"{stored} of its {declared} spans were stored: the others were lost on the way"
        return None

    # -- rollouts -----------------------------------------------------------------------------------------------

    def add_rollouts(self, rows: Iterable[RolloutRow]) -> None:
        """Insert new rollouts in one transaction; a rollout id already stored is an error (nothing is written)."""
        now = time.time()
        values = [(r.rollout_id, r.task_id, r.step, r.attempt, RolloutStatus(r.status).value,
                   now if r.created_at is None else r.created_at, r.started_at, r.ended_at, r.error, r.secret)
                  for r in rows]
        conn = self._conn()
        try:
            with self._write(conn):
                conn.executemany(f"INSERT INTO rollouts ({_ROLLOUT_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)", values)
        except sqlite3.IntegrityError as exc:
            raise StoreError(f"add_rollouts: a rollout id is already stored ({exc})") from None

    def set_rollout_status(self, rollout_id: str, status: RolloutStatus, error: str | None = None) -> None:
        """Move a rollout to ``status`` (see ``ALLOWED_TRANSITIONS``), stamping started_at or ended_at."""
        status = RolloutStatus(status)
        conn = self._conn()
        with self._write(conn):
            row = conn.execute("SELECT status FROM rollouts WHERE rollout_id = ?", (rollout_id,)).fetchone()
            if row is None:
                raise StoreError(f"set_rollout_status: no rollout {rollout_id!r} in the store")
            current = RolloutStatus(row[0])
            if status not in ALLOWED_TRANSITIONS[current]:
                allowed = ", ".join(sorted(s.value for s in ALLOWED_TRANSITIONS[current])) or "nothing (it ended)"
                raise StoreError(f"rollout {rollout_id!r} cannot go from {current.value} to {status.value}; "
                                 f"from {current.value} it may go to {allowed}")
            stamp = "started_at" if status is RolloutStatus.RUNNING else "ended_at"
            conn.execute(f"UPDATE rollouts SET status = ?, {stamp} = ?, error = COALESCE(?, error) "
                         "WHERE rollout_id = ?", (status.value, time.time(), error, rollout_id))

    def end_unfinished(self, error: str) -> int:
        """End every attempt still queued or running as failed with ``error``: what a trainer that was killed left
        behind, called when a run starts on the store (before any new attempt). The number ended."""
        conn = self._conn()
        with self._write(conn):
            cursor = conn.execute("UPDATE rollouts SET status = ?, ended_at = ?, error = COALESCE(error, ?) "
                                  "WHERE status IN (?, ?)", (RolloutStatus.FAILED.value, time.time(), error,
                                                             RolloutStatus.QUEUED.value, RolloutStatus.RUNNING.value))
            return cursor.rowcount

    def get_rollout(self, rollout_id: str) -> RolloutRow | None:
        row = self._conn().execute(f"SELECT {_ROLLOUT_COLUMNS} FROM rollouts WHERE rollout_id = ?",
                                   (rollout_id,)).fetchone()
        return None if row is None else _rollout_row(row)

    def rollouts_of_step(self, step: int) -> list[RolloutRow]:
        """The rollouts of one training step, in the order they were added."""
        rows = self._conn().execute(f"SELECT {_ROLLOUT_COLUMNS} FROM rollouts WHERE step = ? ORDER BY rowid",
                                    (step,))
        return [_rollout_row(row) for row in rows]

    def last_step(self) -> int | None:
        """The latest step of any rollout (validation rollouts count too); None when there is no rollout."""
        return self._conn().execute("SELECT max(step) FROM rollouts").fetchone()[0]

    def supersede(self, rollout_ids: Iterable[str], restart_step: int) -> int:
        """Mark rollouts as superseded: a stopped run made them for steps that the run now starting trains again,
        from its checkpoint of ``restart_step`` (0: from the start). They are kept as they are; readers leave them
        out of a step's rollouts (``runs.Run.rollouts``). How many were not marked before (an id the store has no
        rollout of is not marked)."""
        values = [(restart_step, time.time(), rollout_id) for rollout_id in rollout_ids]
        conn = self._conn()
        with self._write(conn):
            before = conn.total_changes
            conn.executemany("INSERT OR IGNORE INTO superseded (rollout_id, restart_step, at) "
                             "SELECT rollout_id, ?, ? FROM rollouts WHERE rollout_id = ?", values)
            return conn.total_changes - before

    def superseded(self, rollout_ids: Sequence[str]) -> dict[str, int]:
        """Of ``rollout_ids``, those superseded (``supersede``), each with the step its run was restarted from."""
        found: dict[str, int] = {}
        conn = self._conn()
        for i in range(0, len(rollout_ids), _IN_CHUNK):
            chunk = list(rollout_ids[i:i + _IN_CHUNK])
            found.update(conn.execute(f"SELECT rollout_id, restart_step FROM superseded WHERE rollout_id IN "
                                      f"({','.join('?' * len(chunk))})", chunk).fetchall())
        return found

    # -- tasks and episodes -------------------------------------------------------------------------------------

    def add_tasks(self, rows: Iterable[TaskRow]) -> int:
        """Insert tasks in one transaction; ids already stored are kept as they are (a resumed run adds its
        dataset again). How many were new."""
        values = [(t.task_id, t.split, json.dumps(t.payload)) for t in rows]
        conn = self._conn()
        with self._write(conn):
            before = conn.total_changes
            conn.executemany("INSERT OR IGNORE INTO tasks (task_id, split, payload) VALUES (?,?,?)", values)
            return conn.total_changes - before

    def get_task(self, task_id: str) -> TaskRow | None:
        row = self._conn().execute("SELECT task_id, split, payload FROM tasks WHERE task_id = ?",
                                   (task_id,)).fetchone()
        return None if row is None else TaskRow(row[0], row[1], json.loads(row[2]))

    def save_episode(self, rollout_id: str, data: dict[str, Any], episode_return: float | None) -> None:
        """Keep the episode built from a rollout, replacing an earlier build of the same rollout."""
        blob = codec.packb(data)
        conn = self._conn()
        with self._write(conn):
            conn.execute("INSERT OR REPLACE INTO episodes (rollout_id, data, episode_return, built_at) "
                         "VALUES (?,?,?,?)", (rollout_id, blob, episode_return, time.time()))

    def get_episode(self, rollout_id: str) -> EpisodeRow | None:
        row = self._conn().execute("SELECT rollout_id, data, episode_return, built_at FROM episodes "
                                   "WHERE rollout_id = ?", (rollout_id,)).fetchone()
        return None if row is None else EpisodeRow(row[0], codec.unpackb(row[1], strict_map_key=False), row[2], row[3])

    def save_advantages(self, rows: Iterable[AdvantageRow]) -> None:
        """Keep the advantages of an update, in one transaction, replacing earlier ones of the same transitions."""
        values = [(r.rollout_id, r.index, r.step, r.advantage) for r in rows]
        conn = self._conn()
        with self._write(conn):
            conn.executemany("INSERT OR REPLACE INTO advantages (rollout_id, transition, step, advantage) "
                             "VALUES (?,?,?,?)", values)

    def save_trainer_logprobs(self, rows: Iterable[tuple[str, int, list[float]]]) -> None:
        """Keep the trainer's logprob of each response token of transitions whose advantage is saved: (rollout id,
        transition index, logprobs), for the viewer's trainer-vs-engine gap."""
        values = [(codec.packb(list(logprobs)), rollout_id, index) for rollout_id, index, logprobs in rows]
        conn = self._conn()
        with self._write(conn):
            conn.executemany("UPDATE advantages SET trainer_logprobs = ? WHERE rollout_id = ? AND transition = ?",
                             values)

    def trainer_logprobs_of_rollout(self, rollout_id: str) -> dict[int, list[float]]:
        """Transition index → the trainer's token logprobs, for the rollout's transitions an update trained on."""
        rows = self._conn().execute("SELECT transition, trainer_logprobs FROM advantages WHERE rollout_id = ? AND "
                                    "trainer_logprobs IS NOT NULL", (rollout_id,))
        return {index: codec.unpackb(blob) for index, blob in rows.fetchall()}

    def advantages_of_rollout(self, rollout_id: str) -> dict[int, float]:
        """Transition index → advantage, for the rollout's transitions that an update saw (empty: none did)."""
        rows = self._conn().execute("SELECT transition, advantage FROM advantages WHERE rollout_id = ?",
                                    (rollout_id,))
        return dict(rows.fetchall())

    def counts(self) -> dict[str, int]:
        """Rows per table: spans, rollouts, tasks, episodes."""
        conn = self._conn()
        return {table: conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
                for table in ("spans", "rollouts", "tasks", "episodes")}

    def __enter__(self) -> SqliteStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _WriteTransaction:
    """``BEGIN IMMEDIATE`` … ``COMMIT`` (``ROLLBACK`` on an exception)."""

    def __init__(self, conn: sqlite3.Connection):
        self._conn = conn

    def __enter__(self) -> None:
        self._conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            try:
                self._conn.execute("COMMIT")
                return
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")


def _rollout_row(row: tuple) -> RolloutRow:
    return RolloutRow(rollout_id=row[0], task_id=row[1], step=row[2], attempt=row[3], status=RolloutStatus(row[4]),
                      created_at=row[5], started_at=row[6], ended_at=row[7], error=row[8], secret=row[9])
