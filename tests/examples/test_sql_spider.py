"""The SQL agent on the user's own databases: a Spider-format folder the test generates (three SQLite databases with
foreign keys, training and validation questions on different databases) goes through the user's command
(``python -m examples.sql.spider``), lit's task loading (``data.tasks`` = the folder written) and the real LangGraph
agent, traced by lit against tests/fake_llm.py (the model's replies are scripted; the SQLite files, the sandbox,
the ZeroMQ delivery and the trainer's store and episode builder are real). vLLM does not run here: the measured run
in examples/sql/README.md trains on vLLM."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from examples.sql.agent import sql_agent
from examples.sql.databases import schema_text
from examples.sql.spider import convert, kind
from lit_trainer.intake.episodes import Episode, build_episode
from lit_trainer.rollouts.tasks import DataConfig, load_tasks

ROOT = Path(__file__).parents[2]
SCHEMAS = {
    "shop": ["CREATE TABLE customer (customer_id INTEGER PRIMARY KEY, name TEXT, town TEXT)",
             "CREATE TABLE orders (order_id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customer, "
             "total REAL)"],
    "school": ["CREATE TABLE teacher (teacher_id INTEGER PRIMARY KEY, name TEXT)",
               "CREATE TABLE \"class room\" (room_id INTEGER PRIMARY KEY, teacher_id INTEGER, seats INTEGER, "
               "FOREIGN KEY (teacher_id) REFERENCES teacher(teacher_id))"],
    "port": ["CREATE TABLE port (port_id INTEGER PRIMARY KEY, name TEXT, country TEXT)",
             "CREATE TABLE ship (ship_id INTEGER PRIMARY KEY, name TEXT, port_id INTEGER REFERENCES port(port_id), "
             "tonnage INTEGER)"],
}
ROWS = {
    "shop": ["INSERT INTO customer VALUES (1, 'Ada', 'Leeds'), (2, 'Bo', 'York')",
             "INSERT INTO orders VALUES (1, 1, 9.5), (2, 1, 20.0), (3, 2, 4.0)"],
    "school": ["INSERT INTO teacher VALUES (1, 'Kai'), (2, 'Lu')",
               "INSERT INTO \"class room\" VALUES (1, 1, 30), (2, 2, 12), (3, 2, 18)"],
    "port": ["INSERT INTO port VALUES (1, 'Hamburg', 'Germany'), (2, 'Genoa', 'Italy')",
             "INSERT INTO ship VALUES (1, 'Anna', 1, 900), (2, 'Berta', 2, 300), (3, 'Clio', 2, 500)"],
}
TRAIN = [
    {"db_id": "shop", "question": "How many customers are there?", "query": "SELECT count(*) FROM customer"},
    {"db_id": "shop", "question": "What is the total of Ada's orders?",
     "query": "SELECT sum(T2.total) FROM customer AS T1 JOIN orders AS T2 ON T1.customer_id = T2.customer_id "
              "WHERE T1.name = 'Ada'"},
    {"db_id": "school", "question": "How many seats do Lu's rooms have?",
     "query": "SELECT sum(seats) FROM \"class room\" AS r, teacher AS t WHERE r.teacher_id = t.teacher_id "
              "AND t.name = 'Lu'"},
    {"db_id": "school", "question": "A question whose gold query is broken", "query": "SELECT title FROM nowhere"},
]
VALIDATION = [
    {"db_id": "port", "question": "Which ships are in a port in Italy?",
     "query": "SELECT ship.name FROM ship JOIN port ON ship.port_id = port.port_id WHERE port.country = 'Italy'"},
    {"db_id": "port", "question": "How many ports are there?", "query": "SELECT count(*) FROM port"},
]


def spider_folder(root: Path, train: list[dict] = TRAIN, validation: list[dict] = VALIDATION) -> Path:
    """A folder laid out as Spider is: database/<db_id>/<db_id>.sqlite, train_spider.json, dev.json."""
    for db_id, statements in SCHEMAS.items():
        (root / "database" / db_id).mkdir(parents=True)
        with sqlite3.connect(root / "database" / db_id / f"{db_id}.sqlite") as db:
            for statement in statements + ROWS[db_id]:
                db.execute(statement)
        db.close()
    (root / "train_spider.json").write_text(json.dumps(train))
    (root / "dev.json").write_text(json.dumps(validation))
    return root


def test_a_spider_folder_becomes_tasks_that_lit_loads_held_out_by_database(tmp_path: Path):
    source, out = spider_folder(tmp_path / "spider"), tmp_path / "my_sql"
    done = subprocess.run([sys.executable, "-m", "examples.sql.spider", str(source), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert ("left out, its gold query fails: train question 3 (school): OperationalError: no such table: nowhere"
            in done.stderr)
    assert f"data.tasks={out}" in done.stdout

    train, val = load_tasks(DataConfig(tasks=str(out), train_size=100, val_size=100))
    assert sorted(t["question"] for t in train) == sorted(q["question"] for q in TRAIN[:3])
    assert sorted(t["question"] for t in val) == sorted(q["question"] for q in VALIDATION)
    assert {Path(t["db"]).name for t in train} == {"shop.sqlite", "school.sqlite"}
    assert {Path(t["db"]).name for t in val} == {"port.sqlite"} and all(Path(t["db"]).is_absolute() for t in val)
    assert {t["question"]: t["kind"] for t in train + val} == {
        "How many customers are there?": "one table", "What is the total of Ada's orders?": "join",
        "How many seats do Lu's rooms have?": "join", "Which ships are in a port in Italy?": "join",
        "How many ports are there?": "one table"}


def test_the_schema_is_read_from_the_users_database(tmp_path: Path):
    source = spider_folder(tmp_path / "spider")
    assert schema_text(str(source / "database" / "port" / "port.sqlite")) == (
        "Table port: port_id, name, country\n"
        "Table ship: ship_id, name, port_id, tonnage\n"
        "Key: ship.port_id = port.port_id")
    assert schema_text(str(source / "database" / "school" / "school.sqlite")) == (
        "Table teacher: teacher_id, name\n"
        "Table \"class room\": room_id, teacher_id, seats\n"
        "Key: \"class room\".teacher_id = teacher.teacher_id")
    # A key that names no column refers to the primary key.
    assert schema_text(str(source / "database" / "shop" / "shop.sqlite")).endswith(
        "Key: orders.customer_id = customer.customer_id")


def test_names_sqlite_keeps_for_itself_are_quoted_in_the_schema(tmp_path: Path):
    """A table `order` with a column `group` was shown as `Table order: group`, and the model's `SELECT group FROM
    order` could not parse. Words SQLite takes as names (key, name, action) stay plain."""
    db = tmp_path / "shop.sqlite"
    with sqlite3.connect(db) as conn:
        conn.execute('CREATE TABLE "order" ("group" TEXT, key INTEGER, name TEXT, "select" TEXT)')
    text = schema_text(str(db))
    assert text == 'Table "order": "group", key, name, "select"'
    with sqlite3.connect(db) as conn:  # as shown, each name works in a query
        conn.execute('SELECT "group", key, name, "select" FROM "order"')


def test_the_agent_answers_a_held_out_join_question_on_the_users_database(tmp_path: Path, traced_rollout):
    out = tmp_path / "my_sql"
    convert(spider_folder(tmp_path / "spider"), out)
    _, val = load_tasks(DataConfig(tasks=str(out)))
    [task] = [t for t in val if t["kind"] == "join"]
    right = "SELECT ship.name FROM ship JOIN port ON ship.port_id = port.port_id WHERE port.country = 'Italy'"
    reward, spans, llm = traced_rollout(sql_agent, task, [right, "No."])
    assert reward == 1.0 and len(llm.requests) == 2  # writer, checker (accepts)
    prompt = llm.requests[0]["messages"][-1]["content"]
    assert prompt == f"{schema_text(task['db'])}\nQuestion: {task['question']}"
    assert "Key: ship.port_id = port.port_id" in prompt
    assert "Result: Berta; Clio" in llm.requests[1]["messages"][-1]["content"]  # the checker saw the rows
    episode = build_episode(spans, agents={"writer", "rewriter"})
    assert isinstance(episode, Episode) and episode.final_reward == 1.0

    # Without the join the query cannot name the country: it fails, goes to the rewriter, and earns nothing.
    reward, _, llm = traced_rollout(sql_agent, task, ["SELECT name FROM ship WHERE country = 'Italy'",
                                                      "SELECT name FROM ship"])
    assert reward == 0.0 and "no such column: country" in llm.requests[1]["messages"][-1]["content"]


def test_one_questions_file_is_split_by_database(tmp_path: Path):
    source = spider_folder(tmp_path / "spider")
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in TRAIN[:3] + VALIDATION))
    counts = convert(source, tmp_path / "out", questions, held_out=0.3)
    train, val = load_tasks(DataConfig(tasks=str(tmp_path / "out")))
    assert counts == {"train": len(train), "validation": len(val)} and len(train) + len(val) == 5
    assert not {t["db"] for t in train} & {t["db"] for t in val}  # whole databases held out
    assert len({t["db"] for t in val}) == 1


def test_one_sqlite_file_holds_out_every_fifth_question(tmp_path: Path, capsys):
    source = spider_folder(tmp_path / "spider") / "database" / "shop" / "shop.sqlite"
    questions = tmp_path / "q.json"
    questions.write_text(json.dumps([{"db_id": "any", "question": f"How many customers? ({i})",
                                      "query": "SELECT count(*) FROM customer"} for i in range(10)]))
    assert convert(source, tmp_path / "out", questions) == {"train": 8, "validation": 2}
    assert "note: one database: validation asks new questions" in capsys.readouterr().err


@pytest.mark.parametrize(("change", "message"), [
    ("shared", "validation asks about 1 database(s) that training also uses (shop)"),
    ("missing_db", "no SQLite file for the database 'harbour' under"),
    ("no_query", "question 1 (counting from 1) has no query (each needs db_id, question and query, as in Spider)"),
    ("latin1", "dev.json, line 1: not UTF-8 (byte 0xe9): save it as UTF-8"),
    ("no_dev", "has no dev.json or validation.json: give a Spider-format folder, or the questions with"),
    ("not_sqlite", "is not a SQLite file"),
])
def test_a_source_that_cannot_be_used_is_an_error_naming_the_fix_and_writes_nothing(
        tmp_path: Path, change: str, message: str):
    source = spider_folder(tmp_path / "spider")
    if change == "shared":
        (source / "dev.json").write_text(json.dumps(VALIDATION + [TRAIN[0]]))
    elif change == "missing_db":
        (source / "dev.json").write_text(json.dumps([{**VALIDATION[0], "db_id": "harbour"}]))
    elif change == "no_query":
        (source / "dev.json").write_text(json.dumps([{"db_id": "port", "question": "q"}]))
    elif change == "latin1":
        (source / "dev.json").write_bytes(json.dumps([{**VALIDATION[0], "question": "Caf\u00e9?"}]).encode()
                                          .replace(b"\\u00e9", b"\xe9"))
    elif change == "no_dev":
        (source / "dev.json").unlink()
    else:
        (source / "database" / "port" / "port.sqlite").write_text("not a database")
    done = subprocess.run([sys.executable, "-m", "examples.sql.spider", str(source), str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and message in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("query", "expected"), [
    ("SELECT count(*) FROM ship", "one table"),
    ("SELECT a, b FROM ship WHERE x IN (1, 2) GROUP BY a, b", "one table"),
    ("SELECT T1.name FROM ship AS T1 JOIN port AS T2 ON T1.port_id = T2.port_id", "join"),
    ("SELECT s.name FROM ship s, port p WHERE s.port_id = p.port_id", "join"),
    ("SELECT name FROM ship ORDER BY tonnage DESC LIMIT 1", "superlative"),
    ("select name from ship order by tonnage limit 1 offset 1", "superlative"),
    ("SELECT name FROM ship ORDER BY tonnage DESC LIMIT 10", "one table"),
    ("SELECT name FROM ship ORDER BY tonnage DESC LIMIT 1, 5", "one table"),
    ("SELECT name FROM ship LIMIT 1", "one table"),
    ("SELECT T1.name FROM ship AS T1 JOIN port AS T2 ON T1.port_id = T2.port_id ORDER BY T1.tonnage LIMIT 1", "join"),
])
def test_the_kind_says_whether_the_gold_query_reads_several_tables(query: str, expected: str):
    assert kind(query) == expected

