"""The SQL agent's databases: small one-table SQLite databases from different domains, generated here.

    path = database("students")          # a read-only-openable SQLite file, built on first use
    rows = run_query("students", "SELECT COUNT(*) FROM students")
    schema_text("students")              # what the agent's prompts show

Training uses the ``TRAIN_DOMAINS``; validation uses ``HELD_OUT_DOMAINS``, databases whose tables, columns and
values training never shows (Spider's split by database): the held-out metric measures writing SQL, not remembering
a schema. Deterministic: the same domain gives the same rows on every machine (a seeded ``random.Random`` per
domain, no ``hash()``). Numeric columns hold distinct values, so "the highest" and "the lowest" have one answer.

Queries run in ``sandbox.py``: the model's SQL can read and nothing else, briefly, with bounded memory and result.
To use your own data, make ``database`` return the path of your SQLite file (a copy) and ``schema_text`` describe
its tables; ``run_query`` and the agent stay as they are.
"""

from __future__ import annotations

import os
import random
import sqlite3
import tempfile
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

from examples.sql.sandbox import run_readonly

ROWS = 16
"""Rows per table: enough for filters to matter, few enough that a result fits in a prompt."""


@dataclass(frozen=True)
class Category:
    column: str
    values: tuple[str, ...]
    phrase: str
    """How a question says "rows whose column is {v}", e.g. ``live in {v}``."""


@dataclass(frozen=True)
class Number:
    column: str
    low: int
    high: int


@dataclass(frozen=True)
class Domain:
    table: str
    singular: str
    names: tuple[str, ...]
    """Values of the ``name`` column (one per row, ``ROWS`` of them)."""
    categories: tuple[Category, ...]
    numbers: tuple[Number, ...]

    @property
    def plural(self) -> str:
        return self.table


DOMAINS: dict[str, Domain] = {d.table: d for d in [
    # Training databases.
    Domain("students", "student",
           ("Ana", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kim", "Leo",
                  "Mia", "Noah", "Omar", "Pia"),
           (Category("city", ("Paris", "Lima", "Oslo", "Cairo"), "live in {v}"),),
           (Number("age", 17, 30), Number("score", 40, 100))),
    Domain("products", "product",
           ("lamp", "chair", "desk", "mug", "kettle", "pillow", "rug", "mirror", "clock", "vase", "shelf",
                  "bench", "fan", "heater", "stool", "towel"),
           (Category("category", ("kitchen", "office", "bedroom", "garden"), "are in the {v} category"),),
           (Number("price", 5, 90), Number("stock", 0, 60))),
    Domain("employees", "employee",
           ("Alice", "Bruno", "Chen", "Dana", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Julia", "Kofi",
                  "Lena", "Marco", "Nadia", "Oscar", "Priya"),
           (Category("department", ("Sales", "Legal", "Support", "Research"), "work in {v}"),),
           (Number("salary", 30, 95), Number("age", 22, 64))),
    Domain("books", "book",
           ("Dune", "Emma", "Ulysses", "Beloved", "Hamlet", "Ivanhoe", "Lolita", "Matilda", "Rebecca",
                  "Shogun", "Walden", "Carrie", "Heidi", "Persuasion", "Dracula", "Frankenstein"),
           (Category("genre", ("novel", "drama", "poetry", "history"), "are {v} books"),),
           (Number("pages", 90, 900), Number("year", 1800, 2020))),
    Domain("cars", "car",
           ("Astra", "Corolla", "Civic", "Golf", "Polo", "Focus", "Fiesta", "Clio", "Megane", "Punto",
                  "Octavia", "Fabia", "Ibiza", "Leon", "Yaris", "Micra"),
           (Category("color", ("red", "blue", "black", "white"), "are {v}"),),
           (Number("price", 8, 60), Number("year", 1995, 2024))),
    Domain("teams", "team",
           ("Falcons", "Tigers", "Wolves", "Bears", "Eagles", "Sharks", "Lions", "Hawks", "Foxes", "Owls",
                  "Bulls", "Rams", "Cobras", "Pumas", "Storks", "Otters"),
           (Category("league", ("north", "south", "east", "west"), "play in the {v} league"),),
           (Number("wins", 0, 40), Number("points", 10, 99))),
    # Held-out databases: never seen in training.
    Domain("movies", "movie",
           ("Alien", "Amelie", "Brazil", "Casablanca", "Fargo", "Gravity", "Heat", "Jaws", "Memento", "Psycho",
                  "Rocky", "Seven", "Tron", "Up", "Vertigo", "Zodiac"),
           (Category("rating", ("G", "PG", "R", "NC17"), "are rated {v}"),),
           (Number("minutes", 80, 190), Number("budget", 1, 99))),
    Domain("plants", "plant",
           ("fern", "cactus", "orchid", "tulip", "rose", "ivy", "basil", "mint", "sage", "lily", "daisy",
                  "poppy", "aloe", "bamboo", "lotus", "thyme"),
           (Category("climate", ("dry", "wet", "cold", "warm"), "grow in a {v} climate"),),
           (Number("height", 5, 200), Number("water", 1, 30))),
    Domain("flights", "flight",
           ("AF12", "BA34", "DL56", "EK78", "IB90", "KL21", "LH43", "QF65", "SQ87", "TK19", "UA28", "VS37",
                  "AZ46", "LX55", "OS64", "SK73"),
           (Category("airline", ("Aero", "Sky", "Jet", "Wing"), "are run by {v}"),),
           (Number("distance", 300, 9000), Number("seats", 50, 400))),
    Domain("hotels", "hotel",
           ("Ritz", "Savoy", "Plaza", "Grand", "Royal", "Regent", "Palace", "Crown", "Harbor", "Summit",
                  "Garden", "Alpine", "Lagoon", "Meadow", "Orchid", "Willow"),
           (Category("town", ("Rome", "Bern", "Kyiv", "Baku"), "are in {v}"),),
           (Number("rooms", 10, 300), Number("stars", 1, 5))),
]}
TRAIN_DOMAINS = ("students", "products", "employees", "books", "cars", "teams")
HELD_OUT_DOMAINS = ("movies", "plants", "flights", "hotels")


def rows_of(domain: Domain) -> list[dict]:
    """The table's rows: every name once, a category value each, distinct values in each number column."""
    rng = random.Random(zlib.crc32(domain.table.encode()))
    numbers = {n.column: _distinct(rng, n, ROWS) for n in domain.numbers}
    rows = []
    for i, name in enumerate(domain.names[:ROWS]):
        row = {"name": name}
        for c in domain.categories:
            row[c.column] = c.values[i % len(c.values)] if i < len(c.values) else rng.choice(c.values)
        for n in domain.numbers:
            row[n.column] = numbers[n.column][i]
        rows.append(row)
    return rows


def _distinct(rng: random.Random, number: Number, n: int) -> list[int]:
    span = number.high - number.low + 1
    if span >= n:
        return rng.sample(range(number.low, number.high + 1), n)
    return [rng.randint(number.low, number.high) for _ in range(n)]  # too narrow to be distinct (hotel stars)


def columns(domain: Domain) -> list[tuple[str, str]]:
    return ([("name", "TEXT")] + [(c.column, "TEXT") for c in domain.categories]
            + [(n.column, "INTEGER") for n in domain.numbers])


def schema_text(table: str) -> str:
    """The table as the prompts show it: ``students(name, city, age, score)``."""
    return f"{table}({', '.join(name for name, _ in columns(DOMAINS[table]))})"


_build_lock = threading.Lock()


def database(table: str) -> Path:
    """The SQLite file of ``table``'s domain, built once per machine under the user's cache folder (written to a
    temporary name, then renamed: a concurrent reader never sees half a database)."""
    domain = DOMAINS[table]
    folder = Path(os.environ.get("LIT_EXAMPLES_CACHE", Path.home() / ".cache" / "lit" / "examples")) / "sql"
    path = folder / f"{table}-v1.sqlite"
    if path.exists():
        return path
    with _build_lock:
        if path.exists():
            return path
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        os.close(fd)
        cols = columns(domain)
        with sqlite3.connect(tmp) as db:
            db.execute(f"CREATE TABLE {table} ({', '.join(f'{n} {t}' for n, t in cols)})")
            db.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' for _ in cols)})",
                           [tuple(r[n] for n, _ in cols) for r in rows_of(domain)])
        db.close()
        os.replace(tmp, path)
    return path


def run_query(table: str, sql: str) -> list[tuple]:
    """Rows of ``sql`` on ``table``'s database, in the sandbox; raises ``sandbox.QueryError`` (a
    ``sqlite3.Error``) for bad SQL, a refused statement or a query past a limit."""
    return run_readonly(database(table), sql)
