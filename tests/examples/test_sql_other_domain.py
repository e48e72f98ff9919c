"""The other-domain evaluation set (examples/sql/other_domain.py): the Spider-format folder it writes goes through the
user's command (``python -m examples.sql.spider``) and lit's task loading, every question lands in validation, and
its databases differ from the training ones as promised: three tables, no declared foreign key, gold queries that
answer, superlatives with one answer."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from examples.sql.databases import DOMAINS, schema_text
from examples.sql.other_domain import EVALUATED, main, write_spider_folder
from examples.sql.sandbox import run_readonly
from lit_trainer.rollouts.tasks import DataConfig, load_tasks

ROOT = Path(__file__).parents[2]
_ORDER_KEY = re.compile(r"ORDER BY (.+) (?:ASC|DESC) LIMIT 1$")


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    """The set, converted by spider.py's command, as lit loads it (train, validation)."""
    tmp = tmp_path_factory.mktemp("other_domain")
    source, out = write_spider_folder(tmp / "other_spider"), tmp / "other_sql"
    done = subprocess.run([sys.executable, "-m", "examples.sql.spider", str(source), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "left out" not in done.stderr  # every gold query ran in the sandbox
    return load_tasks(DataConfig(tasks=str(out), train_size=100, val_size=100))


def test_the_command_writes_the_same_folder_every_time(tmp_path: Path, capsys):
    first = write_spider_folder(tmp_path / "first")
    assert main([str(tmp_path / "again")]) == 0 and main([str(tmp_path / "again")]) == 0  # over an old copy
    assert "python -m examples.sql.spider" in capsys.readouterr().out
    for name in ("dev.json", "train_spider.json"):
        assert (first / name).read_text() == (tmp_path / "again" / name).read_text()
    for db in sorted((first / "database").glob("*/*.sqlite")):
        dumps = []
        for path in (db, tmp_path / "again" / db.relative_to(first)):
            with sqlite3.connect(path) as conn:
                dumps.append(list(conn.iterdump()))
            conn.close()
        assert dumps[0] == dumps[1] and len(dumps[0]) > 3, db


def test_every_question_is_held_out_and_reported_by_kind(converted):
    train, val = converted
    assert len(val) == 48 and len({t["question"] for t in val}) == 48
    assert Counter(Path(t["db"]).stem for t in val) == {"harbour": 24, "clinic": 24}
    assert {Path(t["db"]).stem for t in train} == {"orchard"}  # the placeholder a task folder needs
    assert Counter(t["kind"] for t in val) == {"one table": 18, "superlative": 12, "join": 18}
    for db_id in EVALUATED:
        assert Counter(t["kind"] for t in val if Path(t["db"]).stem == db_id) == {
            "one table": 9, "superlative": 6, "join": 9}


def test_the_databases_are_of_another_shape_than_the_training_ones(converted):
    _, val = converted
    for db in sorted({t["db"] for t in val}):
        with sqlite3.connect(db) as conn:
            tables = conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'").fetchall()
        conn.close()
        assert len(tables) == 3 and not set(name for name, _ in tables) & set(DOMAINS), tables
        assert not any(re.search(r"FOREIGN\s+KEY|REFERENCES", sql, re.IGNORECASE) for _, sql in tables)
        text = schema_text(db)
        assert len(text.splitlines()) == 3 and all(line.startswith("Table ") for line in text.splitlines())
        assert "Key:" not in text
    assert schema_text(next(t["db"] for t in val if t["db"].endswith("harbour.sqlite"))) == (
        "Table port: port_id, name, country, berths\n"
        "Table vessel: vessel_id, name, port_id, tonnage, built\n"
        "Table voyage: voyage_id, vessel_id, port_id, days, cargo")


def test_every_gold_query_answers_and_every_superlative_has_one_answer(converted):
    _, val = converted
    for task in val:
        rows = run_readonly(Path(task["db"]), task["gold"])
        assert rows and rows not in ([(0,)], [(None,)]), (task["question"], rows)
        key = _ORDER_KEY.search(task["gold"])
        if key:  # the first two rows of the ordering differ in its key: no tie for "the highest"
            first_two = run_readonly(Path(task["db"]), task["gold"].replace("SELECT ", f"SELECT {key[1]}, ", 1)
                                     .replace("LIMIT 1", "LIMIT 2"))
            assert len(first_two) == 2 and first_two[0][0] != first_two[1][0], (task["question"], first_two)
    assert sum(bool(_ORDER_KEY.search(t["gold"])) for t in val) == 15  # 12 superlatives, 3 of them with a join
