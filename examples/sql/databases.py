"""The SQL agent's databases: small generated SQLite databases of two tables each, one domain per database, and
any SQLite file of the user's.

    path = database("students")          # a generated database, built on first use; or database("my/shop.sqlite")
    rows = run_query("students", "SELECT COUNT(*) FROM students")
    schema_text("students")              # what the agent's prompts show, read from the database itself

Each generated database has a main table (``students``: a ``name``, a category column and two number columns) and a
lookup table its category column refers to with a foreign key (``students.city`` -> ``cities.name``, and the city's
``country`` and ``population``), so questions can need a join. Training uses the ``TRAIN_DOMAINS``; validation
uses ``HELD_OUT_DOMAINS``, databases whose tables, columns and values training never shows (Spider's split by
database): the held-out metric measures writing SQL, not remembering a schema. Deterministic: the same domain gives
the same rows on every machine (a seeded ``random.Random`` per domain, no ``hash()``). Numeric columns hold distinct
values, so "the highest" and "the lowest" have one answer.

A task's ``db`` is the name of a generated database or the path of a SQLite file (absolute, or relative to the
folder the worker runs in); ``spider.py`` makes such tasks from a Spider-format folder. ``schema_text`` reads the
tables, columns and foreign keys of either kind. Queries run in ``sandbox.py``: the model's SQL can read and nothing
else, briefly, with bounded memory and result.
"""

from __future__ import annotations

import contextlib
import functools
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
class Lookup:
    """The table a domain's category column refers to: one row per category value (its ``name``), with a text and
    a number column of its own."""

    table: str
    text: str
    texts: tuple[str, ...]
    """The text column's values, one per category value, in the category's order (distinct)."""
    text_phrase: str
    """How a question says "main rows whose lookup row has text {v}", e.g. ``live in a city in {v}``."""
    number: Number
    number_phrase: str
    """How a question says "main rows whose lookup row's number is above {v}"."""


@dataclass(frozen=True)
class Domain:
    table: str
    singular: str
    names: tuple[str, ...]
    """Values of the ``name`` column (one per row, ``ROWS`` of them)."""
    categories: tuple[Category, ...]
    numbers: tuple[Number, ...]
    lookup: Lookup
    """What ``categories[0]`` refers to."""

    @property
    def plural(self) -> str:
        return self.table


DOMAINS: dict[str, Domain] = {d.table: d for d in [
    # Training databases.
    Domain("students", "student",
           ("Ana", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kim", "Leo",
                  "Mia", "Noah", "Omar", "Pia"),
           (Category("city", ("Paris", "Lima", "Oslo", "Cairo"), "live in {v}"),),
           (Number("age", 17, 30), Number("score", 40, 100)),
           Lookup("cities", "country", ("France", "Peru", "Norway", "Egypt"), "live in a city in {v}",
                  Number("population", 100, 999), "live in a city with a population above {v}")),
    Domain("products", "product",
           ("lamp", "chair", "desk", "mug", "kettle", "pillow", "rug", "mirror", "clock", "vase", "shelf",
                  "bench", "fan", "heater", "stool", "towel"),
           (Category("category", ("kitchen", "office", "bedroom", "garden"), "are in the {v} category"),),
           (Number("price", 5, 90), Number("stock", 0, 60)),
           Lookup("categories", "manager", ("Ada", "Bea", "Cyd", "Dot"), "are in a category managed by {v}",
                  Number("margin", 5, 60), "are in a category with a margin above {v}")),
    Domain("employees", "employee",
           ("Alice", "Bruno", "Chen", "Dana", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Julia", "Kofi",
                  "Lena", "Marco", "Nadia", "Oscar", "Priya"),
           (Category("department", ("Sales", "Legal", "Support", "Research"), "work in {v}"),),
           (Number("salary", 30, 95), Number("age", 22, 64)),
           Lookup("departments", "head", ("Rosa", "Sven", "Tara", "Umar"), "work in a department headed by {v}",
                  Number("funding", 100, 900), "work in a department with a funding above {v}")),
    Domain("books", "book",
           ("Dune", "Emma", "Ulysses", "Beloved", "Hamlet", "Ivanhoe", "Lolita", "Matilda", "Rebecca",
                  "Shogun", "Walden", "Carrie", "Heidi", "Persuasion", "Dracula", "Frankenstein"),
           (Category("genre", ("novel", "drama", "poetry", "history"), "are {v} books"),),
           (Number("pages", 90, 900), Number("year", 1800, 2020)),
           Lookup("genres", "shelf", ("oak", "pine", "elm", "ash"), "are of a genre kept on the {v} shelf",
                  Number("loans", 10, 500), "are of a genre with loans above {v}")),
    Domain("cars", "car",
           ("Astra", "Corolla", "Civic", "Golf", "Polo", "Focus", "Fiesta", "Clio", "Megane", "Punto",
                  "Octavia", "Fabia", "Ibiza", "Leon", "Yaris", "Micra"),
           (Category("color", ("red", "blue", "black", "white"), "are {v}"),),
           (Number("price", 8, 60), Number("year", 1995, 2024)),
           Lookup("colors", "finish", ("matte", "gloss", "satin", "pearl"), "have a color with a {v} finish",
                  Number("surcharge", 1, 30), "have a color with a surcharge above {v}")),
    Domain("teams", "team",
           ("Falcons", "Tigers", "Wolves", "Bears", "Eagles", "Sharks", "Lions", "Hawks", "Foxes", "Owls",
                  "Bulls", "Rams", "Cobras", "Pumas", "Storks", "Otters"),
           (Category("league", ("north", "south", "east", "west"), "play in the {v} league"),),
           (Number("wins", 0, 40), Number("points", 10, 99)),
           Lookup("leagues", "sponsor", ("Acme", "Bolt", "Crest", "Dyna"), "play in a league sponsored by {v}",
                  Number("prize", 50, 999), "play in a league with a prize above {v}")),
    Domain("songs", "song",
           ("Yesterday", "Imagine", "Hallelujah", "Respect", "Dreams", "Hurt", "Creep", "Roxanne", "Jolene",
                  "Vogue", "Africa", "Layla", "Angie", "Gloria", "Volare", "Waterloo"),
           (Category("artist", ("Nova", "Echo", "Pulse", "Vibe"), "are by {v}"),),
           (Number("seconds", 120, 420), Number("plays", 100, 9999)),
           Lookup("artists", "label", ("Apex", "Zenith", "Orbit", "Prism"), "are by an artist signed to {v}",
                  Number("followers", 10, 999), "are by an artist with followers above {v}")),
    Domain("restaurants", "restaurant",
           ("Basilico", "Cantina", "Dumpling", "Fonda", "Gyros", "Hanok", "Kimchi", "Laab", "Mezze", "Nacho",
                  "Olive", "Pho", "Quesada", "Souvlaki", "Taqueria", "Umami"),
           (Category("cuisine", ("thai", "greek", "mexican", "korean"), "serve {v} food"),),
           (Number("waiters", 2, 40), Number("seating", 20, 300)),
           Lookup("cuisines", "origin", ("Bangkok", "Athens", "Puebla", "Seoul"), "serve a cuisine from {v}",
                  Number("spice", 1, 99), "serve a cuisine with a spice level above {v}")),
    Domain("museums", "museum",
           ("Louvre", "Prado", "Uffizi", "Tate", "Getty", "Hermitage", "Orsay", "Belvedere", "Guggenheim",
                  "Rijks", "Albertina", "Bargello", "Pergamon", "Kunsthaus", "Ateneum", "Moco"),
           (Category("district", ("Centre", "Riverside", "Hillside", "Uptown"), "are in the {v} district"),),
           (Number("visitors", 100, 9000), Number("founded", 1750, 2015)),
           Lookup("districts", "mayor", ("Ilse", "Jorge", "Kaito", "Lucia"), "are in a district whose mayor is {v}",
                  Number("area", 2, 80), "are in a district with an area above {v}")),
    Domain("courses", "course",
           ("Algebra", "Biology", "Chemistry", "Drawing", "Economics", "French", "Geology", "History", "Italian",
                  "Jazz", "Latin", "Music", "Physics", "Poetry", "Statistics", "Yoga"),
           (Category("faculty", ("Arts", "Science", "Law", "Business"), "are taught in the {v} faculty"),),
           (Number("credits", 1, 30), Number("enrolled", 5, 300)),
           Lookup("faculties", "dean", ("Mara", "Niko", "Olga", "Pavel"), "are taught in a faculty whose dean is {v}",
                  Number("staff", 10, 200), "are taught in a faculty with staff above {v}")),
    Domain("games", "game",
           ("Tetris", "Pong", "Doom", "Myst", "Portal", "Halo", "Zelda", "Sonic", "Pacman", "Minecraft",
                  "Fortnite", "Asteroids", "Galaga", "Frogger", "Lemmings", "Braid"),
           (Category("platform", ("console", "mobile", "desktop", "arcade"), "run on {v}"),),
           (Number("downloads", 1, 999), Number("size", 1, 120)),
           Lookup("platforms", "maker", ("Vortex", "Quark", "Nimbus", "Helix"), "run on a platform made by {v}",
                  Number("users", 5, 900), "run on a platform with users above {v}")),
    Domain("parks", "park",
           ("Acadia", "Arches", "Badlands", "Bryce", "Denali", "Everglades", "Glacier", "Olympic", "Redwood",
                  "Sequoia", "Shenandoah", "Teton", "Yosemite", "Zion", "Canyonlands", "Congaree"),
           (Category("state", ("Utah", "Idaho", "Maine", "Texas"), "are in {v}"),),
           (Number("acres", 100, 9999), Number("trails", 1, 60)),
           Lookup("states", "capital", ("Salt Lake City", "Boise", "Augusta", "Austin"),
                  "are in a state whose capital is {v}",
                  Number("counties", 10, 260), "are in a state with counties above {v}")),
    # Held-out databases: never seen in training.
    Domain("movies", "movie",
           ("Alien", "Amelie", "Brazil", "Casablanca", "Fargo", "Gravity", "Heat", "Jaws", "Memento", "Psycho",
                  "Rocky", "Seven", "Tron", "Up", "Vertigo", "Zodiac"),
           (Category("rating", ("G", "PG", "R", "NC17"), "are rated {v}"),),
           (Number("minutes", 80, 190), Number("budget", 1, 99)),
           Lookup("ratings", "audience", ("kids", "teens", "adults", "everyone"), "have a rating meant for {v}",
                  Number("viewers", 10, 99), "have a rating with viewers above {v}")),
    Domain("plants", "plant",
           ("fern", "cactus", "orchid", "tulip", "rose", "ivy", "basil", "mint", "sage", "lily", "daisy",
                  "poppy", "aloe", "bamboo", "lotus", "thyme"),
           (Category("climate", ("dry", "wet", "cold", "warm"), "grow in a {v} climate"),),
           (Number("height", 5, 200), Number("water", 1, 30)),
           Lookup("climates", "biome", ("desert", "swamp", "tundra", "savanna"), "grow in a climate of the {v} biome",
                  Number("rainfall", 20, 900), "grow in a climate with a rainfall above {v}")),
    Domain("flights", "flight",
           ("AF12", "BA34", "DL56", "EK78", "IB90", "KL21", "LH43", "QF65", "SQ87", "TK19", "UA28", "VS37",
                  "AZ46", "LX55", "OS64", "SK73"),
           (Category("airline", ("Aero", "Sky", "Jet", "Wing"), "are run by {v}"),),
           (Number("distance", 300, 9000), Number("seats", 50, 400)),
           Lookup("airlines", "hub", ("Dubai", "Tokyo", "Lagos", "Quito"), "are run by an airline based in {v}",
                  Number("fleet", 10, 300), "are run by an airline with a fleet above {v}")),
    Domain("hotels", "hotel",
           ("Ritz", "Savoy", "Plaza", "Grand", "Royal", "Regent", "Palace", "Crown", "Harbor", "Summit",
                  "Garden", "Alpine", "Lagoon", "Meadow", "Orchid", "Willow"),
           (Category("town", ("Rome", "Bern", "Kyiv", "Baku"), "are in {v}"),),
           (Number("rooms", 10, 300), Number("stars", 1, 5)),
           Lookup("towns", "region", ("coast", "valley", "plateau", "delta"), "are in a town in the {v} region",
                  Number("residents", 2, 95), "are in a town with residents above {v}")),
]}
TRAIN_DOMAINS = ("students", "products", "employees", "books", "cars", "teams", "songs", "restaurants", "museums",
                 "courses", "games", "parks")
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
    """The main table's columns and their SQLite types."""
    return ([("name", "TEXT")] + [(c.column, "TEXT") for c in domain.categories]
            + [(n.column, "INTEGER") for n in domain.numbers])


def lookup_columns(domain: Domain) -> list[tuple[str, str]]:
    lookup = domain.lookup
    return [("name", "TEXT"), (lookup.text, "TEXT"), (lookup.number.column, "INTEGER")]


def lookup_rows(domain: Domain) -> list[dict]:
    """The lookup table's rows: one per value of the category column, distinct numbers."""
    lookup, category = domain.lookup, domain.categories[0]
    rng = random.Random(zlib.crc32(lookup.table.encode()))
    numbers = _distinct(rng, lookup.number, len(category.values))
    return [{"name": value, lookup.text: text, lookup.number.column: number}
            for value, text, number in zip(category.values, lookup.texts, numbers, strict=True)]


Schema = tuple[list[tuple[str, list[str]]], list[tuple[str, str, str, str]]]
"""(tables as (name, columns), foreign keys as (table, column, referenced table, referenced column))."""


def format_schema(schema: Schema) -> str:
    """A schema as the prompts show it, a line per table and per foreign key::

        Table students: name, city, age, score
        Table cities: name, country, population
        Key: students.city = cities.name
    """
    tables, keys = schema
    lines = [f"Table {_name(t)}: {', '.join(_name(c) for c in cols)}" for t, cols in tables]
    lines += [f"Key: {_name(t)}.{_name(c)} = {_name(rt)}.{_name(rc)}" for t, c, rt, rc in keys]
    return "\n".join(lines)


def _name(identifier: str) -> str:
    """An identifier as SQL accepts it: plain, or double-quoted when it has spaces or other characters, or is a
    word SQLite keeps for itself (``order``, ``group``: the model's ``SELECT group FROM order`` would not parse)."""
    return '"' + identifier.replace('"', '""') + '"' if _needs_quotes(identifier) else identifier


@functools.cache
def _needs_quotes(identifier: str) -> bool:
    if not (identifier.replace("_", "a").isalnum() and not identifier[0].isdigit()):
        return True
    try:  # letters, digits and _ only: SQLite itself says whether the word stands as a name
        with contextlib.closing(sqlite3.connect(":memory:")) as db:
            db.execute(f"CREATE TABLE {identifier} ({identifier} INTEGER)")
            db.execute(f"SELECT {identifier}.{identifier} FROM {identifier} ORDER BY {identifier}")
    except sqlite3.Error:
        return True
    return False


def read_schema(path: Path) -> Schema:
    """The tables, columns and foreign keys of a SQLite file, read through a read-only connection (SQLite's own
    tables left out). A foreign key that names no column refers to the other table's primary key."""
    with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as db:
        names = [r[0] for r in db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY rowid")]
        info = {t: db.execute("SELECT name, pk FROM pragma_table_info(?)", (t,)).fetchall() for t in names}
        tables = [(t, [column for column, _ in info[t]]) for t in names]
        primary = {t: next((column for column, pk in info[t] if pk), None) for t in names}
        keys = []
        for t in names:
            for row in db.execute("SELECT * FROM pragma_foreign_key_list(?)", (t,)):
                other, column, target = row[2], row[3], row[4] or primary.get(row[2])
                if target:
                    keys.append((t, column, other, target))
    return tables, keys


_schemas: dict[tuple[Path, float], tuple[Schema, str]] = {}


def schema(db: str) -> Schema:
    """The tables, columns and foreign keys of a task's database (``read_schema``)."""
    return _schema_of(db)[0]


def schema_text(db: str) -> str:
    """The schema of a task's database as the prompts show it (``format_schema``)."""
    return _schema_of(db)[1]


def _schema_of(db: str) -> tuple[Schema, str]:
    """The schema and its text, read from the file once per process (again when the file changes)."""
    path = database(db)
    key = (path, path.stat().st_mtime)
    if key not in _schemas:
        read = read_schema(path)
        _schemas[key] = read, format_schema(read)
    return _schemas[key]


_build_lock = threading.Lock()


def database(db: str) -> Path:
    """The SQLite file of a task's ``db``: a generated database (built once per machine under the user's cache
    folder, written to a temporary name, then renamed: a concurrent reader never sees half a database), or the
    user's SQLite file at that path. ValueError when it is neither."""
    if db not in DOMAINS:
        return _users_database(db)
    domain = DOMAINS[db]
    folder = Path(os.environ.get("LIT_EXAMPLES_CACHE", Path.home() / ".cache" / "lit" / "examples")) / "sql"
    path = folder / f"{db}-v2.sqlite"
    if path.exists():
        return path
    with _build_lock:
        if path.exists():
            return path
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        os.close(fd)
        lookup, category = domain.lookup, domain.categories[0].column
        with contextlib.closing(sqlite3.connect(tmp)) as con, con:
            _create(con, db, columns(domain), rows_of(domain), {category: f"{lookup.table}(name)"})
            _create(con, lookup.table, lookup_columns(domain), lookup_rows(domain))
        os.replace(tmp, path)
    return path


def _create(con: sqlite3.Connection, table: str, cols: list[tuple[str, str]], rows: list[dict],
            references: dict[str, str] | None = None) -> None:
    """Create ``table`` (its ``name`` the primary key, ``references`` the foreign keys) and fill it."""
    references = references or {}
    defs = [f"{n} {t}" + (" PRIMARY KEY" if n == "name" else "")
            + (f" REFERENCES {references[n]}" if n in references else "") for n, t in cols]
    con.execute(f"CREATE TABLE {table} ({', '.join(defs)})")
    con.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' for _ in cols)})",
                    [tuple(r[n] for n, _ in cols) for r in rows])


def _users_database(db: str) -> Path:
    path = Path(db)
    if not path.is_file():
        raise ValueError(f"the task's database {db!r} is neither a generated one ({', '.join(DOMAINS)}) nor a "
                         f"file{' (no such file)' if not path.exists() else ''}; a relative path is read from "
                         f"{Path.cwd()}")
    with open(path, "rb") as f:
        if f.read(16) != b"SQLite format 3\x00":
            raise ValueError(f"the task's database {db!r} is not a SQLite file")
    return path


def run_query(db: str, sql: str) -> list[tuple]:
    """Rows of ``sql`` on a task's database, in the sandbox; raises ``sandbox.QueryError`` (a ``sqlite3.Error``)
    for bad SQL, a refused statement or a query past a limit."""
    return run_readonly(database(db), sql)
