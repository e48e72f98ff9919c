"""Questions about your own SQLite databases, in the Spider format, as tasks for the SQL agent.

    python -m examples.sql.spider path/to/spider my_sql      # writes my_sql/train.jsonl and my_sql/validation.jsonl
    lit train examples/sql/config.toml data.tasks=my_sql

The source is a folder laid out as Spider is (``database/<db_id>/<db_id>.sqlite``, ``train_spider.json`` or
``train.json`` for training, ``dev.json`` or ``validation.json`` for validation), or any folder of SQLite files (or
one SQLite file) with ``--questions FILE``: one JSON list, or JSON lines, of ``{"db_id", "question", "query"}``
objects (Spider's keys; extra keys are ignored). A database is found as ``<db_id>/<db_id>.sqlite``,
``<db_id>.sqlite`` or ``<db_id>.db``, under the source or its ``database/`` folder; a single SQLite file serves
every question.

Held out means unseen: with ``--questions``, whole databases go to validation (``--held-out`` of them, at least
one), so validation asks about tables and values training never showed, as Spider's split does. Given separate
files, a validation question on a database that training also uses is an error, unless there is only one
database (then validation measures new questions on a known database, and the script says so). Every gold query
is run once here, in the agent's sandbox: one that fails is reported and left out (a task whose gold answer cannot
be computed could only fail its rollouts). Each task's ``db`` is the database's absolute path, and its ``kind`` is
``join`` when the gold query reads several tables, else ``superlative`` when it keeps the first row of an ordering
(``ORDER BY ... LIMIT 1``), else ``one table``: lit reports validation accuracy per kind.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sqlite3
import sys
import zlib
from pathlib import Path

from examples.sql.databases import database
from examples.sql.sandbox import run_readonly

TRAIN_FILES = ("train_spider.json", "train.json")
VALIDATION_FILES = ("dev.json", "validation.json")
SUFFIXES = (".sqlite", ".db", ".sqlite3")
_IDENTIFIER = r'(?:"[^"]+"|`[^`]+`|\[[^\]]+\]|[\w.]+)'
_SEVERAL_TABLES = re.compile(rf"\bJOIN\b|\bFROM\s+{_IDENTIFIER}(?:\s+(?:AS\s+)?\w+)?\s*,", re.IGNORECASE)
_FIRST_OF_ORDER = re.compile(r"\bORDER\s+BY\b.*\bLIMIT\s+1\b(?!\s*,)", re.IGNORECASE | re.DOTALL)


class SpiderError(ValueError):
    """A source that cannot be turned into tasks; the message says what to change."""


def read_questions(path: Path) -> list[dict]:
    """A questions file: one JSON list, or JSON lines, of objects with ``db_id``, ``question`` and ``query``."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise SpiderError(f"{path}, line {line}: not UTF-8 (byte {data[exc.start]:#04x}): save it as UTF-8") from None
    try:
        loaded = json.loads(text)
        items = loaded if isinstance(loaded, list) else [loaded]
    except json.JSONDecodeError:
        items = []
        for number, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 may sit inside a string
            if not line.strip():
                continue
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SpiderError(f"{path} is neither a JSON list nor JSON lines: line {number}: {exc}") from None
    for i, item in enumerate(items, 1):
        missing = [k for k in ("db_id", "question", "query") if not isinstance(item, dict) or
                   not isinstance(item.get(k), str) or not item[k].strip()]
        if missing:
            raise SpiderError(f"{path}: question {i} (counting from 1) has no {', '.join(missing)} (each needs "
                              "db_id, question and query, as in Spider)")
    return items


def find_database(source: Path, db_id: str) -> Path:
    """The SQLite file of ``db_id`` under ``source`` (or ``source`` itself when it is a file)."""
    if source.is_file():
        return source
    for folder in (source / "database", source):
        for suffix in SUFFIXES:
            for candidate in (folder / db_id / f"{db_id}{suffix}", folder / f"{db_id}{suffix}"):
                if candidate.is_file():
                    return candidate
    raise SpiderError(f"no SQLite file for the database {db_id!r} under {source}: looked for "
                      f"{db_id}/{db_id}.sqlite and {db_id}.sqlite there and in its database/ folder")


def kind(query: str) -> str:
    """``join`` when the query reads several tables (a JOIN, or a comma in FROM); else ``superlative`` when it
    keeps the first row of an ordering (``ORDER BY ... LIMIT 1``: "the highest"); else ``one table``."""
    if _SEVERAL_TABLES.search(query):
        return "join"
    return "superlative" if _FIRST_OF_ORDER.search(query) else "one table"


def splits(source: Path, questions: Path | None, held_out: float) -> tuple[list[dict], list[dict], str]:
    """(training questions, validation questions, a note for the user, or "")."""
    if questions is not None:
        items = read_questions(questions)
        ids = sorted({q["db_id"] for q in items})
        if len(ids) == 1 or source.is_file():
            val = [q for i, q in enumerate(items) if i % 5 == 4]
            return ([q for i, q in enumerate(items) if i % 5 != 4], val,
                    "one database: validation asks new questions about the database training uses (every fifth "
                    "question), not about unseen tables")
        ranked = sorted(ids, key=lambda db_id: zlib.crc32(db_id.encode()))
        unseen = set(ranked[:max(1, round(held_out * len(ids)))])
        return ([q for q in items if q["db_id"] not in unseen], [q for q in items if q["db_id"] in unseen],
                f"held out: {len(unseen)} of {len(ids)} databases ({', '.join(sorted(unseen))})")
    if source.is_file():
        raise SpiderError(f"{source} is one SQLite file: give its questions with --questions FILE")
    found = [next((source / f for f in names if (source / f).is_file()), None)
             for names in (TRAIN_FILES, VALIDATION_FILES)]
    if None in found:
        raise SpiderError(f"{source} has no {' or '.join(TRAIN_FILES if found[0] is None else VALIDATION_FILES)}:"
                          " give a Spider-format folder, or the questions with --questions FILE")
    train, val = (read_questions(path) for path in found)
    shared = sorted({q["db_id"] for q in train} & {q["db_id"] for q in val})
    if shared and len({q["db_id"] for q in train + val}) > 1:
        raise SpiderError(f"validation asks about {len(shared)} database(s) that training also uses "
                          f"({', '.join(shared[:5])}): held-out questions must be about unseen databases. Move "
                          "those questions to one file, or give all questions with --questions FILE to split "
                          "them by database")
    return train, val, ("one database: validation asks new questions about the database training uses"
                        if shared else "")


def to_tasks(items: list[dict], source: Path, split: str) -> tuple[list[dict], list[str]]:
    """The split's tasks, and a line for each question left out because its gold query fails."""
    tasks, dropped, paths = [], [], {}
    for i, item in enumerate(items):
        if item["db_id"] not in paths:  # found and checked once per database, not per question
            paths[item["db_id"]] = str(database(str(find_database(source, item["db_id"]).resolve())))
        path = paths[item["db_id"]]
        gold = " ".join(item["query"].split())
        try:
            run_readonly(path, gold)
        except sqlite3.Error as exc:
            dropped.append(f"{split} question {i} ({item['db_id']}): {exc}")
            continue
        task = {"id": f"{split}-{i}", "db": path, "question": item["question"].strip(), "gold": gold,
                "kind": kind(gold)}
        # the gold query is what a correct writer answers: demonstrations for sft.source = "references"
        tasks.append({**task, "reference": {"writer": gold}} if split == "train" else task)
    return tasks, dropped


def convert(source: Path, out: Path, questions: Path | None = None, held_out: float = 0.2) -> dict[str, int]:
    """Write ``out/train.jsonl`` and ``out/validation.jsonl``; the number of tasks of each split. SpiderError
    when the source cannot be used (nothing is written then)."""
    if not source.exists():
        raise SpiderError(f"{source} does not exist")
    if not 0 < held_out < 1:
        raise SpiderError(f"--held-out must be between 0 and 1, not {held_out}")
    train, val, note = splits(source, questions, held_out)
    written: dict[str, list[dict]] = {}
    for split, items in (("train", train), ("validation", val)):
        tasks, dropped = to_tasks(items, source, split)
        for line in dropped[:5]:
            print(f"left out, its gold query fails: {line}", file=sys.stderr)
        if len(dropped) > 5:
            print(f"... and {len(dropped) - 5} more {split} questions whose gold query fails", file=sys.stderr)
        if not tasks:
            raise SpiderError(f"the {split} split has no question whose gold query runs")
        written[split] = tasks
    if note:
        print(f"note: {note}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    for split, tasks in written.items():
        random.Random(split).shuffle(tasks)  # lit reads the first val_size; mix the databases
        tmp = out / f".{split}.jsonl.tmp"
        tmp.write_text("".join(json.dumps(t) + "\n" for t in tasks), encoding="utf-8")
        tmp.replace(out / f"{split}.jsonl")
    return {split: len(tasks) for split, tasks in written.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.sql.spider", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a Spider-format folder, a folder of SQLite files, or one file")
    parser.add_argument("out", type=Path, help="the folder to write train.jsonl and validation.jsonl into")
    parser.add_argument("--questions", type=Path, help="one questions file for both splits (split by database)")
    parser.add_argument("--held-out", type=float, default=0.2,
                        help="with --questions: the share of databases held out for validation (default 0.2)")
    args = parser.parse_args(argv)
    try:
        counts = convert(args.source, args.out, args.questions, args.held_out)
    except (SpiderError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out / 'train.jsonl'} ({counts['train']} tasks) and {args.out / 'validation.jsonl'} "
          f"({counts['validation']} tasks); train with: lit train examples/sql/config.toml data.tasks={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
