"""Runs SQL that a model wrote on a SQLite file so that it can only read, and only briefly: the text-to-SQL agent's
query sandbox.

    rows = run_readonly(path, "SELECT name FROM students")  # or raises QueryError, a readable sqlite3.Error
    rows, error = await query_rows(path, sql)               # off the event loop; error is "" or one short line

A model's query is untrusted input. Without bounds, ``SELECT length(hex(zeroblob(400000000)))`` (40 characters)
holds a core for seconds and gigabytes of memory, and run on the agent's event loop it stops the worker's
heartbeats, so the trainer fails every rollout of that worker; ``ATTACH`` and ``VACUUM INTO`` write files even on a
read-only connection. Each query here therefore runs

- on a connection opened read-only (``mode=ro``), whose authorizer allows only reading (``SELECT``, reads of
  columns, recursive common table expressions) and the functions in ``ALLOWED_FUNCTIONS``: ``ATTACH``, ``DETACH``,
  ``VACUUM``, ``PRAGMA``, every write and ``fts3_tokenizer`` (which hands out and takes raw pointers) are refused
  before the statement runs;
- within ``QUERY_STEPS`` steps of SQLite's virtual machine (a progress handler counts them) and
  ``QUERY_TIMEOUT_S`` seconds (a timer interrupts it), with values of at most ``VALUE_BYTES``
  (``SQLITE_LIMIT_LENGTH``, which also bounds one function call, where nothing can interrupt), temporary tables
  in memory, and this process's SQLite heap capped at ``HEAP_BYTES`` (``PRAGMA hard_heap_limit``);
- returning at most ``RESULT_ROWS`` rows of at most ``RESULT_BYTES`` in all.

Every failure, refusals and limits included, is a ``QueryError`` whose message says what to change, so the agent
shows it to the model as a result instead of ending the rollout. ``query_rows`` runs the query in a thread and
gives up waiting after the deadline, so the event loop never waits on SQLite.

To adapt it to your own data: point ``run_readonly`` at your SQLite file (a copy the agent may read); raise the
limits if your honest queries need more (measure them first); add to ``ALLOWED_FUNCTIONS`` the functions your
questions need (JSON ones, say). ``HEAP_BYTES`` holds for every SQLite connection of the process (SQLite has no
per-connection heap limit), so run the agent in a process of its own, as ``lit worker`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from pathlib import Path

QUERY_STEPS = 2_000_000
"""SQLite virtual-machine steps a query may take: a runaway cross join or recursive query is interrupted."""
QUERY_TIMEOUT_S = 1.0
"""Wall time a query may take, for steps that are each slow (large values); ``query_rows`` waits a little longer."""
VALUE_BYTES = 10_000
"""The longest string or blob a query may make or read (``SQLITE_LIMIT_LENGTH``; SQLite's default is 10**9). It
also bounds one function call, which nothing interrupts: ``instr()`` or ``trim()`` on two values is quadratic."""
HEAP_BYTES = 256 * 2**20
"""SQLite's heap in this process (``PRAGMA hard_heap_limit``): past it an allocation fails with "out of memory"."""
RESULT_ROWS = 100
"""Rows returned; the rest are not fetched."""
RESULT_BYTES = 100_000
"""Bytes of strings and blobs (and 8 per other value) in the rows returned, before the query is refused."""

_PROGRESS_EVERY = 1000
"""Virtual-machine steps between two calls of the progress handler."""
_WAIT_MARGIN_S = 1.0
"""How much longer than ``QUERY_TIMEOUT_S`` ``query_rows`` waits for the thread before it answers with an error."""
_CONNECTION_LIMITS = {
    sqlite3.SQLITE_LIMIT_LENGTH: VALUE_BYTES,
    sqlite3.SQLITE_LIMIT_SQL_LENGTH: 100_000,
    sqlite3.SQLITE_LIMIT_COLUMN: 100,
    sqlite3.SQLITE_LIMIT_ATTACHED: 0,  # also stops VACUUM INTO, which attaches its target
    sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH: 1000,
}

ALLOWED_FUNCTIONS = frozenset({
    # scalar
    "abs", "char", "coalesce", "glob", "hex", "ifnull", "iif", "instr", "length", "like", "likelihood",
    "likely", "lower", "ltrim", "max", "min", "nullif", "quote", "replace", "round", "rtrim", "sign",
    "soundex", "substr", "substring", "trim", "typeof", "unicode", "unlikely", "upper",
    # aggregate
    "avg", "count", "group_concat", "sum", "total",
    # date and time
    "current_date", "current_time", "current_timestamp", "date", "datetime", "julianday", "strftime", "time",
    "unixepoch",
    # math
    "acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "ceil", "ceiling", "cos", "cosh", "degrees", "exp",
    "floor", "ln", "log", "log10", "log2", "mod", "pi", "pow", "power", "radians", "sin", "sinh", "sqrt", "tan",
    "tanh", "trunc",
    # window
    "cume_dist", "dense_rank", "first_value", "lag", "last_value", "lead", "nth_value", "ntile", "percent_rank",
    "rank", "row_number",
})
"""Functions a query may call: SQL's ordinary ones. Left out: ``fts3_tokenizer`` and ``load_extension`` (native
code), ``zeroblob`` and ``randomblob`` (large values for nothing), ``printf`` and ``format`` (``'%.*c'`` with a
precision of 10**9 loops for seconds in one call, past any limit), ``random``, and SQLite's introspection."""

_READ_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE}
_ACTION_NAMES = {getattr(sqlite3, name): name.removeprefix("SQLITE_").replace("_", " ") for name in (
    "SQLITE_ATTACH", "SQLITE_DETACH", "SQLITE_PRAGMA", "SQLITE_INSERT", "SQLITE_UPDATE", "SQLITE_DELETE",
    "SQLITE_TRANSACTION", "SQLITE_SAVEPOINT", "SQLITE_ANALYZE", "SQLITE_REINDEX", "SQLITE_ALTER_TABLE",
    "SQLITE_CREATE_VTABLE", "SQLITE_DROP_VTABLE")}
_SCHEMA_WRITES = {sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE}

_heap_lock = threading.Lock()
_heap_limited = False


class QueryError(sqlite3.Error):
    """A query that failed, was refused or ran past a limit; the message is one line for the model to read."""


def run_readonly(path: str | Path, sql: str) -> list[tuple]:
    """The first ``RESULT_ROWS`` rows of ``sql`` on the SQLite file at ``path``, within the limits above; raises
    ``QueryError`` (a ``sqlite3.Error``) for bad SQL, a refused statement or a query past a limit."""
    _limit_heap()
    try:
        db = _open(path)
    except (sqlite3.Error, MemoryError) as exc:
        raise QueryError(f"the database did not open: {exc}") from exc
    refused: list[str] = []
    steps = 0
    late = threading.Event()

    def progress() -> int:
        nonlocal steps
        steps += _PROGRESS_EVERY
        return int(steps > QUERY_STEPS)  # non-zero interrupts the query

    def interrupt() -> None:
        late.set()
        with contextlib.suppress(sqlite3.ProgrammingError):  # closed in the meantime: nothing left to stop
            db.interrupt()

    # The deadline is a timer, not the progress handler: that runs only every _PROGRESS_EVERY steps, and a step
    # on long values (instr() on two of them) is slow; interrupt() stops the next step.
    timer = threading.Timer(QUERY_TIMEOUT_S, interrupt)
    try:
        db.set_authorizer(_authorizer(refused))
        db.set_progress_handler(progress, _PROGRESS_EVERY)
        timer.start()
        return _fetch(db.execute(sql))
    except QueryError:
        raise
    except (sqlite3.Error, sqlite3.Warning) as exc:
        raise QueryError(_explain(exc, refused, late.is_set())) from exc
    except ValueError as exc:  # text Python cannot hand to SQLite: a lone surrogate
        raise QueryError(f"the query's text is not valid UTF-8: {exc}") from exc
    except MemoryError as exc:  # SQLite's "out of memory" (the heap limit) arrives as Python's MemoryError
        raise QueryError(f"out of memory: the query needs more than the {HEAP_BYTES >> 20} MiB of SQLite's heap "
                         "limit; make it compute less") from exc
    finally:
        timer.cancel()
        db.close()


async def query_rows(path: str | Path, sql: str) -> tuple[list[tuple] | None, str]:
    """``(rows, "")`` or ``(None, the error in a line)``; the query runs in a thread, so the event loop (and the
    worker's heartbeats) keep running, and this gives up waiting ``_WAIT_MARGIN_S`` after the query's deadline
    even if SQLite is inside a single slow call that nothing can interrupt."""
    try:
        rows = await asyncio.wait_for(asyncio.to_thread(run_readonly, path, sql),
                                      QUERY_TIMEOUT_S + _WAIT_MARGIN_S)
    except QueryError as exc:
        return None, str(exc)
    except TimeoutError:
        return None, f"interrupted: the query ran past {QUERY_TIMEOUT_S} s; make it compute less"
    return rows, ""


def _open(path: str | Path) -> sqlite3.Connection:
    """A read-only connection with the limits set; our own settings first, before the authorizer refuses PRAGMA."""
    db = sqlite3.connect(f"{Path(path).absolute().as_uri()}?mode=ro", uri=True, isolation_level=None)
    try:
        for limit, value in _CONNECTION_LIMITS.items():
            db.setlimit(limit, value)
        db.execute("PRAGMA temp_store = MEMORY")  # sorts and temporary tables count in the heap, not on disk
    except BaseException:
        db.close()
        raise
    return db


def _limit_heap() -> None:
    """Sets the process's SQLite heap limit once (the pragma can only lower it, so a lower limit set by the
    user's own code stays)."""
    global _heap_limited
    with _heap_lock:
        if not _heap_limited:
            db = sqlite3.connect(":memory:")
            try:
                db.execute(f"PRAGMA hard_heap_limit = {HEAP_BYTES}")
            finally:
                db.close()
            _heap_limited = True


def _authorizer(refused: list[str]):
    """Allows reads and ``ALLOWED_FUNCTIONS``, denies everything else, and notes what it denied in ``refused``."""

    def authorize(action: int, arg1: str | None, arg2: str | None, _db: str | None, _trigger: str | None) -> int:
        if action in _READ_ACTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION:
            if (arg2 or "").lower() in ALLOWED_FUNCTIONS:
                return sqlite3.SQLITE_OK
            refused.append(f"the function {arg2}()")
        elif action in _SCHEMA_WRITES and (arg1 or "").startswith("sqlite_"):  # CREATE and DROP write these first
            refused.append("changing the schema")
        else:
            refused.append(_ACTION_NAMES.get(action, f"statement kind {action}"))
        return sqlite3.SQLITE_DENY

    return authorize


def _fetch(cursor: sqlite3.Cursor) -> list[tuple]:
    rows, size = [], 0
    for row in cursor:
        size += sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in row)
        if size > RESULT_BYTES:
            raise QueryError(f"the result is larger than {RESULT_BYTES} bytes; select fewer or shorter values")
        rows.append(row)
        if len(rows) == RESULT_ROWS:
            break
    return rows


def _explain(exc: sqlite3.Error, refused: list[str], late: bool) -> str:
    """One line for the model: what was refused or which limit the query reached, else SQLite's own message."""
    message = str(exc)
    if refused:
        return f"refused: the query may only read, and {refused[0]} is not allowed"
    if message == "interrupted":
        limit = f"{QUERY_TIMEOUT_S} s" if late else f"{QUERY_STEPS} steps"
        return f"interrupted: the query ran past {limit}; make it compute less"
    if "too big" in message:
        return f"{message}: values are limited to {VALUE_BYTES} bytes"
    return f"{type(exc).__name__}: {message[:200]}"  # as before the sandbox: "OperationalError: no such table: x"
