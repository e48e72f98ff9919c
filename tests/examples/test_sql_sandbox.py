"""The SQL example's query sandbox (examples/sql/sandbox.py) against hostile queries a model can write: each is
refused or stopped quickly with bounded memory, as a readable error; the worker's event loop keeps running; nothing
is written; ordinary queries still work. Real SQLite files; the bounds are measured in a child process of its own."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.sql.agent import execute, sql_agent
from examples.sql.databases import database, run_query
from examples.sql.sandbox import HEAP_BYTES, QUERY_TIMEOUT_S, RESULT_BYTES, RESULT_ROWS, run_readonly

ROOT = Path(__file__).resolve().parents[2]

X = "replace(replace(replace(replace('x', 'x', 'xxxxxxxxx'), 'x', 'xxxxxxxxx'), 'x', 'xxxxxxxxx'), 'x', 'xxxxxxxxx')"
"""6561 x's, made by allowed functions within the sandbox's value limit."""
SLOW_STEPS = ("WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c LIMIT 15000) SELECT COUNT(*) FROM c "
              f"WHERE instr({X}, substr({X}, 1, 3280 + n % 2) || 'b')")
"""Few steps, each slow (instr() on long strings is quadratic): no step budget stops it, only a clock. Seconds
without the sandbox."""

HOSTILE = {
    "zeroblob": "SELECT length(hex(zeroblob(400000000)))",
    "printf": "SELECT length(printf('%.*c', 900000000, 'x'))",
    "nested replace": "SELECT length(" + "replace(" * 9 + "'x'" + ", 'x', 'xxxxxxxxxx')" * 9 + ")",
    "a doubling recursive CTE": "WITH RECURSIVE c(x) AS (SELECT 'ab' UNION ALL SELECT x || x FROM c) "
                                "SELECT length(x) FROM c LIMIT 1 OFFSET 29",
    "a recursive CTE piling rows into a sort": f"WITH RECURSIVE c(n, x) AS (SELECT 1, {X} UNION ALL SELECT n + 1, x "
                                               "FROM c) SELECT COUNT(*) FROM (SELECT x || n FROM c ORDER BY 1)",
    "slow steps": SLOW_STEPS,
}

CHILD = """
import json, resource, sqlite3, sys, time
from examples.sql.databases import database, run_query
database("students")
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # a runaway query fails here, not on the machine
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.monotonic()
try:
    rows, error = repr(run_query("students", sys.argv[1])), ""
except (sqlite3.Error, MemoryError) as exc:
    rows, error = "", f"{type(exc).__name__}: {exc}"
print(json.dumps({"s": time.monotonic() - start, "rows": rows, "error": error,
                  "rss_growth": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) * 1024}))
"""


@pytest.mark.parametrize("query", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_query_is_an_error_within_the_deadline_and_the_heap_limit(query, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    child = subprocess.run([sys.executable, "-c", CHILD, query], env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout)
    assert result["error"].startswith("QueryError: "), result  # a readable error, not rows nor a MemoryError
    assert result["s"] < QUERY_TIMEOUT_S + 2, result
    assert result["rss_growth"] < HEAP_BYTES + 64 * 2**20, result


def test_a_slow_query_leaves_the_event_loop_running(traced_rollout):
    """The checker's query runs in a thread: an asyncio task beside the rollout keeps ticking while it runs (run
    on the loop, it stopped the worker's heartbeats for as long as the query took)."""
    ticks: list[float] = []

    async def agent_beside_a_ticker(task: dict, llm):
        async def tick():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        try:
            return await sql_agent(task, llm)
        finally:
            ticker.cancel()

    task = {"id": "t1", "db": "students", "question": "How many students are there?",
            "gold": "SELECT COUNT(*) FROM students"}
    reward, _, llm = traced_rollout(agent_beside_a_ticker, task, [SLOW_STEPS, "SELECT COUNT(*) FROM students"])
    gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
    assert max(gaps) < QUERY_TIMEOUT_S, max(gaps)  # the query ran for QUERY_TIMEOUT_S and the ticker did not stop
    assert reward == 1.0 and len(llm.requests) == 2  # writer, then the rewriter after the error; no checker call
    assert f"interrupted: the query ran past {QUERY_TIMEOUT_S} s" in llm.requests[1]["messages"][-1]["content"]


@pytest.mark.parametrize(("query", "refused"), [
    ("ATTACH '{out}' AS a", "ATTACH"),
    ("VACUUM INTO '{out}'", "ATTACH"),  # VACUUM INTO attaches its target first
    ("SELECT fts3_tokenizer('simple')", "fts3_tokenizer()"),
    ("SELECT zeroblob(10)", "zeroblob()"),
    ("DELETE FROM students", "DELETE"),
    ("UPDATE students SET age = 0", "UPDATE"),
    ("INSERT INTO students (name) VALUES ('x')", "INSERT"),
    ("DROP TABLE students", "changing the schema"),
    ("CREATE TEMP TABLE t (x)", "changing the schema"),
    ("ALTER TABLE students ADD COLUMN x", "ALTER TABLE"),
    ("PRAGMA writable_schema = 1", "PRAGMA"),
    ("PRAGMA user_version = 3", "PRAGMA"),
    ("BEGIN IMMEDIATE", "TRANSACTION"),
])
def test_anything_but_reading_is_refused_and_writes_nothing(query, refused, tmp_path):
    out = tmp_path / "written.sqlite"
    path = database("students")
    before = path.read_bytes()
    with pytest.raises(sqlite3.Error, match=rf"^refused: the query may only read, and .*{refused}"):
        run_query("students", query.format(out=out))
    assert not out.exists() and path.read_bytes() == before
    assert run_query("students", "SELECT COUNT(*) FROM students") == [(16,)]


def test_ordinary_queries_still_work_and_results_are_capped(tmp_path):
    assert run_query("students", "SELECT name FROM students WHERE age > 100") == []
    ranked = run_query("students", "SELECT name, rank() OVER (ORDER BY score DESC), round(avg(age) OVER (), 2), "
                                   "strftime('%Y', '2024-05-01') FROM students ORDER BY score DESC LIMIT 3")
    assert [r[1] for r in ranked] == [1, 2, 3] and ranked[0][3] == "2024"
    counted = run_query("students", "WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c LIMIT 1000) "
                                    "SELECT n FROM c")
    assert len(counted) == RESULT_ROWS and counted[-1] == (RESULT_ROWS,)
    with pytest.raises(sqlite3.Error, match=f"result is larger than {RESULT_BYTES} bytes"):
        run_query("students", f"SELECT {X} FROM students")
    # A template for the user's own data: any SQLite file, opened read-only.
    own = tmp_path / "own.sqlite"
    with sqlite3.connect(own) as db:
        db.execute("CREATE TABLE t (x)")
        db.execute("INSERT INTO t VALUES (7)")
    db.close()
    assert run_readonly(own, "SELECT x * 6 FROM t") == [(42,)]


@pytest.mark.parametrize(("query", "error"), [
    ("SELECT '\ud800'", "not valid UTF-8"),  # a lone surrogate, as a JSON reply can carry
    ("SELECT 1\x00", "null character"),
    ("SELECT 1; SELECT 2", "one statement at a time"),
    ("SELECT 1 -- " + "x" * 200_000, "too large"),
])
def test_malformed_query_text_is_an_error_line_for_the_model(query, error):
    rows, message = asyncio.run(execute("students", query))
    assert rows is None and error in message and "\n" not in message
