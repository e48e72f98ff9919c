"""Questions with gold SQL over the SQL agent's databases (``databases.py``), Spider style.

    make_tasks("train", 2000)      # [{"id": "train-0", "db": "students", "question": "...", "gold": "SELECT ...",
                                   #   "reference": {"writer": "SELECT ..."}}]
    make_tasks("validation", 64)   # questions on the held-out databases only

Training questions are about ``TRAIN_DOMAINS``, validation questions about ``HELD_OUT_DOMAINS``: no table, column or
value of a validation question ever appears in training. Both use the same question forms (counting, filtering,
extremes, aggregates on the main table; and three that need a join with the lookup table, ``JOIN_FORMS``), so the
held-out metric asks whether the model learned to write SQL for a schema it has never seen. Each task's ``kind`` is
its question form. Deterministic: a seeded ``random.Random`` per split.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from examples.sql.databases import DOMAINS, HELD_OUT_DOMAINS, TRAIN_DOMAINS, Domain, lookup_rows, rows_of

SEEDS = {"train": 4321, "validation": 8765}

Question = tuple[str, str]
"""(question, gold SQL)"""


def count_all(rng: random.Random, d: Domain) -> Question:
    return f"How many {d.plural} are there?", f"SELECT COUNT(*) FROM {d.table}"


def count_where(rng: random.Random, d: Domain) -> Question:
    c = rng.choice(d.categories)
    v = rng.choice(c.values)
    return (f"How many {d.plural} {c.phrase.format(v=v)}?",
            f"SELECT COUNT(*) FROM {d.table} WHERE {c.column} = '{v}'")


def names_where(rng: random.Random, d: Domain) -> Question:
    c = rng.choice(d.categories)
    v = rng.choice(c.values)
    return (f"Which {d.plural} {c.phrase.format(v=v)}?",
            f"SELECT name FROM {d.table} WHERE {c.column} = '{v}'")


def highest(rng: random.Random, d: Domain) -> Question:
    n = rng.choice(d.numbers)
    return (f"Which {d.singular} has the highest {n.column}?",
            f"SELECT name FROM {d.table} ORDER BY {n.column} DESC LIMIT 1")


def lowest(rng: random.Random, d: Domain) -> Question:
    n = rng.choice(d.numbers)
    return (f"Which {d.singular} has the lowest {n.column}?",
            f"SELECT name FROM {d.table} ORDER BY {n.column} ASC LIMIT 1")


def above(rng: random.Random, d: Domain) -> Question:
    n = rng.choice(d.numbers)
    values = sorted(r[n.column] for r in rows_of(d))
    threshold = values[rng.randint(len(values) // 3, 2 * len(values) // 3)]
    return (f"Which {d.plural} have a {n.column} above {threshold}?",
            f"SELECT name FROM {d.table} WHERE {n.column} > {threshold}")


def average(rng: random.Random, d: Domain) -> Question:
    n = rng.choice(d.numbers)
    return f"What is the average {n.column} of the {d.plural}?", f"SELECT AVG({n.column}) FROM {d.table}"


def maximum(rng: random.Random, d: Domain) -> Question:
    n = rng.choice(d.numbers)
    return f"What is the highest {n.column} of any {d.singular}?", f"SELECT MAX({n.column}) FROM {d.table}"


def total_where(rng: random.Random, d: Domain) -> Question:
    c, n = rng.choice(d.categories), rng.choice(d.numbers)
    v = rng.choice(c.values)
    return (f"What is the total {n.column} of the {d.plural} that {c.phrase.format(v=v)}?",
            f"SELECT SUM({n.column}) FROM {d.table} WHERE {c.column} = '{v}'")


def _join(d: Domain) -> str:
    return (f"FROM {d.table} JOIN {d.lookup.table} ON {d.table}.{d.categories[0].column} = "
            f"{d.lookup.table}.name WHERE")


def _lookup_condition(rng: random.Random, d: Domain, numbers: bool = True) -> tuple[str, str]:
    """(how the question says it, the WHERE condition) on a column of the lookup table: its text column, or (when
    ``numbers``) its number column above a value that leaves one to three of the four lookup rows."""
    lookup = d.lookup
    if numbers and rng.random() < 0.5:
        values = sorted(r[lookup.number.column] for r in lookup_rows(d))
        threshold = values[rng.randint(0, len(values) - 2)]
        return (lookup.number_phrase.format(v=threshold),
                f"{lookup.table}.{lookup.number.column} > {threshold}")
    v = rng.choice(lookup.texts)
    return lookup.text_phrase.format(v=v), f"{lookup.table}.{lookup.text} = '{v}'"


def join_names(rng: random.Random, d: Domain) -> Question:
    said, condition = _lookup_condition(rng, d)
    return f"Which {d.plural} {said}?", f"SELECT {d.table}.name {_join(d)} {condition}"


def join_count(rng: random.Random, d: Domain) -> Question:
    said, condition = _lookup_condition(rng, d)
    return f"How many {d.plural} {said}?", f"SELECT COUNT(*) {_join(d)} {condition}"


def join_total(rng: random.Random, d: Domain) -> Question:
    n = rng.choice(d.numbers)
    said, condition = _lookup_condition(rng, d, numbers=False)
    return (f"What is the total {n.column} of the {d.plural} that {said}?",
            f"SELECT SUM({d.table}.{n.column}) {_join(d)} {condition}")


JOIN_FORMS: list[Callable[[random.Random, Domain], Question]] = [join_names, join_count, join_total]
"""The forms whose questions need both tables."""
FORMS: list[Callable[[random.Random, Domain], Question]] = [
    count_all, count_where, names_where, highest, lowest, above, average, maximum, total_where, *JOIN_FORMS]


def make_tasks(split: str, n: int) -> list[dict]:
    """Up to ``n`` distinct questions of ``split`` ("train" or "validation"), forms and databases interleaved
    (fewer when the split's databases have fewer distinct questions)."""
    if split not in SEEDS:
        raise ValueError(f"split must be one of {sorted(SEEDS)}, got {split!r}")
    tables = TRAIN_DOMAINS if split == "train" else HELD_OUT_DOMAINS
    rng = random.Random(SEEDS[split])
    tasks: list[dict] = []
    seen: set[str] = set()
    for attempt in range(100 * n):
        if len(tasks) == n:
            break
        form = FORMS[attempt % len(FORMS)]
        domain = DOMAINS[tables[(attempt // len(FORMS)) % len(tables)]]
        question, gold = form(rng, domain)
        key = f"{domain.table}|{question}"
        if key in seen:
            continue
        seen.add(key)
        task = {"id": f"{split}-{len(tasks)}", "db": domain.table, "question": question, "gold": gold,
                "kind": form.__name__}
        # what a correct writer answers, for sft.source = "references" (the training split's only); the gold query
        # as the rewriter's reference too measured worse (docs/experiments/2026-12-06-sql-sft-twelve-databases.md)
        tasks.append({**task, "reference": {"writer": gold}} if split == "train" else task)
    return tasks
