"""An other-domain evaluation set for the SQL agent: does what it learned carry to schemas unlike the training ones?

    python -m examples.sql.other_domain other_spider              # writes the Spider-format folder
    python -m examples.sql.spider other_spider other_sql          # 48 validation tasks (and a 2-question train split)
    lit eval examples/sql/config.toml data.tasks=other_sql                      # the base model
    lit eval examples/sql/config.toml data.tasks=other_sql --checkpoint RUN     # a trained run

Two databases of domains that ``databases.py`` never uses, ``harbour`` (``port``, ``vessel``, ``voyage``) and
``clinic`` (``doctor``, ``patient``, ``visit``), unlike the training ones in three ways: three tables instead of
two, singular table names, and no declared foreign key: a join column is only named alike in both tables
(``vessel.port_id`` and ``port.port_id``), so the prompt's schema has no ``Key:`` line and the model must find the
join itself. The rows are fixed, and each number column holds distinct values, so "the highest" has one answer.

Each database has 24 questions with gold SQL: counting, filtering, averages and totals on one table, superlatives
(``ORDER BY ... LIMIT 1``), and joins of two or three tables. All of them are in ``dev.json``; ``train_spider.json``
asks two questions about a third small database (``orchard``), only because a task folder needs a train split, so
``spider.py`` puts every one of the 48 in ``validation.jsonl``. Their ``kind`` (``join``, ``superlative``,
``one table``) makes ``lit eval`` report each group's accuracy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sqlite3
import sys
from pathlib import Path

Table = tuple[str, str, list[tuple]]
"""(name, column definitions as in CREATE TABLE, rows)."""

DATABASES: dict[str, list[Table]] = {
    "harbour": [
        ("port", "port_id INTEGER PRIMARY KEY, name TEXT, country TEXT, berths INTEGER", [
            (1, "Rotterdam", "Netherlands", 42), (2, "Hamburg", "Germany", 35), (3, "Antwerp", "Belgium", 28),
            (4, "Bergen", "Norway", 12), (5, "Genoa", "Italy", 19), (6, "Valencia", "Spain", 23),
            (7, "Trieste", "Italy", 16), (8, "Narvik", "Norway", 7)]),
        ("vessel", "vessel_id INTEGER PRIMARY KEY, name TEXT, port_id INTEGER, tonnage INTEGER, built INTEGER", [
            (1, "Aurora", 1, 5400, 1998), (2, "Boreas", 2, 3100, 2005), (3, "Calypso", 5, 2750, 2011),
            (4, "Delphine", 4, 1200, 1987), (5, "Eider", 1, 6800, 2016), (6, "Fulmar", 3, 980, 1979),
            (7, "Gannet", 6, 4150, 2002), (8, "Halcyon", 7, 2300, 1993), (9, "Ibis", 8, 1650, 2008),
            (10, "Jura", 2, 3900, 2014), (11, "Kittiwake", 5, 720, 1984), (12, "Lorelei", 4, 5050, 2020)]),
        ("voyage", "voyage_id INTEGER PRIMARY KEY, vessel_id INTEGER, port_id INTEGER, days INTEGER, "
                   "cargo INTEGER", [
            (1, 1, 3, 4, 3200), (2, 1, 6, 9, 4100), (3, 2, 4, 3, 1500), (4, 3, 2, 11, 2200),
            (5, 5, 8, 14, 6100), (6, 5, 5, 6, 5300), (7, 6, 1, 2, 450), (8, 7, 7, 8, 3600),
            (9, 8, 3, 5, 1900), (10, 9, 1, 12, 1100), (11, 10, 6, 7, 2900), (12, 10, 4, 13, 3400),
            (13, 12, 2, 10, 4700), (14, 12, 8, 16, 4400), (15, 4, 5, 1, 800), (16, 2, 7, 15, 2600)]),
    ],
    "clinic": [
        ("doctor", "doctor_id INTEGER PRIMARY KEY, name TEXT, specialty TEXT, years INTEGER", [
            (1, "Okafor", "cardiology", 21), (2, "Lindqvist", "pediatrics", 9), (3, "Moreau", "dermatology", 14),
            (4, "Tanaka", "cardiology", 6), (5, "Haddad", "neurology", 27), (6, "Novak", "pediatrics", 17),
            (7, "Ruiz", "orthopedics", 3), (8, "Kowalski", "neurology", 11)]),
        ("patient", "patient_id INTEGER PRIMARY KEY, name TEXT, town TEXT, age INTEGER", [
            (1, "Amara", "Leeds", 34), (2, "Bastian", "York", 71), (3, "Chiara", "Leeds", 8),
            (4, "Dmitri", "Bath", 52), (5, "Elif", "York", 45), (6, "Femi", "Derby", 12),
            (7, "Greta", "Bath", 66), (8, "Hamid", "Leeds", 29), (9, "Ilse", "Derby", 83),
            (10, "Joon", "York", 5), (11, "Kalani", "Bath", 39), (12, "Luca", "Derby", 58)]),
        ("visit", "visit_id INTEGER PRIMARY KEY, doctor_id INTEGER, patient_id INTEGER, fee INTEGER, "
                  "minutes INTEGER", [
            (1, 1, 2, 180, 40), (2, 2, 3, 95, 25), (3, 3, 1, 120, 20), (4, 5, 9, 240, 55),
            (5, 4, 5, 150, 30), (6, 6, 6, 85, 35), (7, 7, 4, 110, 15), (8, 2, 10, 90, 22),
            (9, 1, 7, 200, 45), (10, 8, 12, 160, 50), (11, 5, 2, 260, 60), (12, 3, 11, 130, 18),
            (13, 6, 3, 75, 28), (14, 4, 8, 140, 33), (15, 1, 5, 210, 38), (16, 7, 12, 100, 12)]),
    ],
    # Training's placeholder: a task folder needs a train split; the evaluation is on the two above.
    "orchard": [
        ("tree", "tree_id INTEGER PRIMARY KEY, variety TEXT, height INTEGER", [
            (1, "apple", 4), (2, "pear", 6), (3, "plum", 3), (4, "cherry", 5)]),
    ],
}

_VESSEL_PORT = "vessel JOIN port ON vessel.port_id = port.port_id"
_VOYAGE_VESSEL = "voyage JOIN vessel ON voyage.vessel_id = vessel.vessel_id"
_VOYAGE_PORT = "voyage JOIN port ON voyage.port_id = port.port_id"
_VISIT_DOCTOR = "visit JOIN doctor ON visit.doctor_id = doctor.doctor_id"
_VISIT_PATIENT = "visit JOIN patient ON visit.patient_id = patient.patient_id"
_VISIT_BOTH = f"{_VISIT_DOCTOR} JOIN patient ON visit.patient_id = patient.patient_id"

QUESTIONS: dict[str, list[tuple[str, str]]] = {
    "harbour": [
        ("How many ports are there?", "SELECT count(*) FROM port"),
        ("How many ports are in Norway?", "SELECT count(*) FROM port WHERE country = 'Norway'"),
        ("Which ports are in Italy?", "SELECT name FROM port WHERE country = 'Italy'"),
        ("How many vessels were built before 1990?", "SELECT count(*) FROM vessel WHERE built < 1990"),
        ("Which vessels have a tonnage above 5000?", "SELECT name FROM vessel WHERE tonnage > 5000"),
        ("What is the average tonnage of the vessels?", "SELECT avg(tonnage) FROM vessel"),
        ("What is the total cargo of all voyages?", "SELECT sum(cargo) FROM voyage"),
        ("How many voyages took more than 10 days?", "SELECT count(*) FROM voyage WHERE days > 10"),
        ("How many berths do the ports of Norway have in total?",
         "SELECT sum(berths) FROM port WHERE country = 'Norway'"),
        ("Which port has the most berths?", "SELECT name FROM port ORDER BY berths DESC LIMIT 1"),
        ("Which port has the fewest berths?", "SELECT name FROM port ORDER BY berths ASC LIMIT 1"),
        ("Which vessel is the oldest?", "SELECT name FROM vessel ORDER BY built ASC LIMIT 1"),
        ("Which vessel has the highest tonnage?", "SELECT name FROM vessel ORDER BY tonnage DESC LIMIT 1"),
        ("Which vessel has the lowest tonnage?", "SELECT name FROM vessel ORDER BY tonnage ASC LIMIT 1"),
        ("How many days did the longest voyage take?", "SELECT days FROM voyage ORDER BY days DESC LIMIT 1"),
        ("Which vessels are based in a port in Germany?",
         f"SELECT vessel.name FROM {_VESSEL_PORT} WHERE port.country = 'Germany'"),
        ("How many vessels are based in Rotterdam?",
         f"SELECT count(*) FROM {_VESSEL_PORT} WHERE port.name = 'Rotterdam'"),
        ("How many voyages went to a port in Norway?",
         f"SELECT count(*) FROM {_VOYAGE_PORT} WHERE port.country = 'Norway'"),
        ("What is the total cargo carried by the vessel Eider?",
         f"SELECT sum(voyage.cargo) FROM {_VOYAGE_VESSEL} WHERE vessel.name = 'Eider'"),
        ("Which vessel carried the largest cargo on one voyage?",
         f"SELECT vessel.name FROM {_VOYAGE_VESSEL} ORDER BY voyage.cargo DESC LIMIT 1"),
        ("Which ports did the vessel Lorelei sail to?",
         f"SELECT port.name FROM {_VOYAGE_VESSEL} JOIN port ON voyage.port_id = port.port_id "
         "WHERE vessel.name = 'Lorelei'"),
        ("How many voyages were made by vessels based in a port in Italy?",
         f"SELECT count(*) FROM {_VOYAGE_VESSEL} JOIN port ON vessel.port_id = port.port_id "
         "WHERE port.country = 'Italy'"),
        ("Which vessels made no voyage?",
         "SELECT vessel.name FROM vessel LEFT JOIN voyage ON vessel.vessel_id = voyage.vessel_id "
         "WHERE voyage.voyage_id IS NULL"),
        ("What is the average number of days of the voyages to Hamburg?",
         f"SELECT avg(voyage.days) FROM {_VOYAGE_PORT} WHERE port.name = 'Hamburg'"),
    ],
    "clinic": [
        ("How many doctors are there?", "SELECT count(*) FROM doctor"),
        ("How many doctors work in cardiology?", "SELECT count(*) FROM doctor WHERE specialty = 'cardiology'"),
        ("Which doctors work in neurology?", "SELECT name FROM doctor WHERE specialty = 'neurology'"),
        ("Which doctors have more than 15 years of experience?", "SELECT name FROM doctor WHERE years > 15"),
        ("How many patients live in York?", "SELECT count(*) FROM patient WHERE town = 'York'"),
        ("What is the average age of the patients who live in Leeds?",
         "SELECT avg(age) FROM patient WHERE town = 'Leeds'"),
        ("How many patients are younger than 18?", "SELECT count(*) FROM patient WHERE age < 18"),
        ("What is the total of the fees of all visits?", "SELECT sum(fee) FROM visit"),
        ("How many visits lasted longer than 30 minutes?", "SELECT count(*) FROM visit WHERE minutes > 30"),
        ("Which doctor has the most years of experience?", "SELECT name FROM doctor ORDER BY years DESC LIMIT 1"),
        ("Which doctor has the fewest years of experience?", "SELECT name FROM doctor ORDER BY years ASC LIMIT 1"),
        ("Who is the oldest patient?", "SELECT name FROM patient ORDER BY age DESC LIMIT 1"),
        ("Who is the youngest patient?", "SELECT name FROM patient ORDER BY age ASC LIMIT 1"),
        ("What was the highest fee of a single visit?", "SELECT fee FROM visit ORDER BY fee DESC LIMIT 1"),
        ("How many minutes did the shortest visit last?",
         "SELECT minutes FROM visit ORDER BY minutes ASC LIMIT 1"),
        ("How many visits did the doctor Okafor have?",
         f"SELECT count(*) FROM {_VISIT_DOCTOR} WHERE doctor.name = 'Okafor'"),
        ("What is the total of the fees charged by cardiology doctors?",
         f"SELECT sum(visit.fee) FROM {_VISIT_DOCTOR} WHERE doctor.specialty = 'cardiology'"),
        ("Which patients did the doctor Novak see?",
         f"SELECT patient.name FROM {_VISIT_BOTH} WHERE doctor.name = 'Novak'"),
        ("Which doctors saw the patient Bastian?",
         f"SELECT doctor.name FROM {_VISIT_BOTH} WHERE patient.name = 'Bastian'"),
        ("How many visits were made by patients who live in Derby?",
         f"SELECT count(*) FROM {_VISIT_PATIENT} WHERE patient.town = 'Derby'"),
        ("What is the average fee of the visits to neurology doctors?",
         f"SELECT avg(visit.fee) FROM {_VISIT_DOCTOR} WHERE doctor.specialty = 'neurology'"),
        ("Which doctor had the most visits?",
         f"SELECT doctor.name FROM {_VISIT_DOCTOR} GROUP BY doctor.doctor_id ORDER BY count(*) DESC LIMIT 1"),
        ("Which patient paid the highest fee for one visit?",
         f"SELECT patient.name FROM {_VISIT_PATIENT} ORDER BY visit.fee DESC LIMIT 1"),
        ("How many minutes in all did pediatrics doctors spend on visits of patients who live in Leeds?",
         f"SELECT sum(visit.minutes) FROM {_VISIT_BOTH} WHERE doctor.specialty = 'pediatrics' "
         "AND patient.town = 'Leeds'"),
    ],
    "orchard": [
        ("How many trees are there?", "SELECT count(*) FROM tree"),
        ("Which tree is the tallest?", "SELECT variety FROM tree ORDER BY height DESC LIMIT 1"),
    ],
}
EVALUATED = ("harbour", "clinic")
"""The databases whose questions go to ``dev.json``; the rest go to ``train_spider.json``."""


def write_database(path: Path, tables: list[Table]) -> None:
    """A SQLite file of ``tables``, replacing any file at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        for name, columns, rows in tables:
            db.execute(f"CREATE TABLE {name} ({columns})")
            db.executemany(f"INSERT INTO {name} VALUES ({', '.join('?' * len(rows[0]))})", rows)


def questions(db_ids: list[str]) -> list[dict]:
    """The questions of ``db_ids`` in Spider's format (``db_id``, ``question``, ``query``)."""
    return [{"db_id": db_id, "question": question, "query": query}
            for db_id in db_ids for question, query in QUESTIONS[db_id]]


def write_spider_folder(root: Path) -> Path:
    """Write the set as Spider lays out a folder (``database/<db_id>/<db_id>.sqlite``, ``train_spider.json``,
    ``dev.json``) under ``root``; ``root``."""
    for db_id, tables in DATABASES.items():
        write_database(root / "database" / db_id / f"{db_id}.sqlite", tables)
    held = list(EVALUATED)
    (root / "dev.json").write_text(json.dumps(questions(held), indent=1) + "\n", encoding="utf-8")
    (root / "train_spider.json").write_text(
        json.dumps(questions([d for d in DATABASES if d not in held]), indent=1) + "\n", encoding="utf-8")
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.sql.other_domain",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the Spider-format folder to write")
    args = parser.parse_args(argv)
    root = write_spider_folder(args.out)
    print(f"wrote {root}; then: python -m examples.sql.spider {root} TASKS and "
          "lit eval examples/sql/config.toml data.tasks=TASKS [--checkpoint RUN]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
