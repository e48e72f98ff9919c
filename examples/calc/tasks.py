"""Arithmetic word problems for the calc agent, generated here (Calc-X style): short stories with two-digit numbers
and one or two operations, every answer a non-negative integer (division is always exact).

    make_tasks("train", 512)       # [{"id": "train-0", "question": "...", "answer": 42, "operation": "add",
                                   #   "kind": "in_template", "expression": "17+25"}, ...]
    make_tasks("validation", 64)   # half "in_template", half "out_of_template"

Each problem is an operation (``add``, ``multiply_subtract``...: the arithmetic and how its numbers are drawn) put
into words by a template with a person's name and an object. Every operation has two wordings: the training one
(``TEMPLATES``), used by both splits, and a held-out one (``HELD_OUT``) that only validation uses, for the
``"out_of_template"`` tasks. The split a problem may appear in is decided by its signature, the operation's name and
its numbers sorted (``signature``), never by its text: validation gets the signatures whose CRC is 0 modulo
``VALIDATION_SHARE``, train all others. So no validation problem, in either wording, is a training problem with
another name or object or its numbers swapped (same operation, same numbers).

Train: every task ``"in_template"``, distinct questions. Validation: task ``i`` is ``"in_template"`` when
``i // TWO_STEP_EVERY`` is even, ``"out_of_template"`` when odd (blocks of four, so each kind keeps the three
one-step to one two-step mix, and 64 tasks are 32 of each), each kind taking the operations in turn (the same mix
of operations in both kinds), no two tasks of a kind sharing a signature (see ``make_tasks``).

Deterministic: the same split and ``n`` give the same list on every machine and Python version (a seeded
``random.Random`` and no ``hash()``), and a shorter list is a prefix of a longer one. Knows nothing of agents, LLMs
or lit.
"""

from __future__ import annotations

import collections
import random
import zlib
from collections.abc import Callable

SEEDS = {"train": 1234, "validation": 5678}
"""One generator seed per split."""
TWO_STEP_EVERY = 4
"""Every fourth task (index 3, 7, ...) is two-step, the rest one-step: the untrained 135M model solves almost no
two-step problem (greedy 0-3%) against 25-30% of one-step ones, and GRPO learns only where rewards vary."""
VALIDATION_SHARE = 8
"""One signature (operation and numbers, by CRC) in this many belongs to validation; the rest to train."""
KINDS = ("in_template", "out_of_template")
"""Validation alternates them by blocks of ``TWO_STEP_EVERY`` tasks; train has only the first."""
MAX_DRAWS = 1000
"""Draws a validation operation gets to find a problem of its split not yet used in its kind, before its turn
passes to the next operation (so that ``make_tasks`` ends once an operation's validation problems run out)."""

NAMES = ["Ana", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kim", "Leo", "Mia",
         "Noah", "Omar", "Pia", "Rosa", "Sam", "Tom", "Zoe"]
THINGS = ["apples", "books", "cards", "coins", "cookies", "marbles", "pencils", "shells", "stamps", "stickers"]

Numbers = dict[str, int]
"""The numbers a template shows, by field name."""
Operation = Callable[[random.Random], tuple[Numbers, int]]
"""Draws the numbers of one problem; (numbers, answer)."""


def two_digit(rng: random.Random, low: int = 10, high: int = 99) -> int:
    return rng.randint(low, high)


def add(rng: random.Random) -> tuple[Numbers, int]:
    a, b = two_digit(rng), two_digit(rng)
    return {"a": a, "b": b}, a + b


def subtract(rng: random.Random) -> tuple[Numbers, int]:
    a = two_digit(rng, 20)
    b = two_digit(rng, 10, a - 1)
    return {"a": a, "b": b}, a - b


def multiply(rng: random.Random) -> tuple[Numbers, int]:
    a, b = two_digit(rng, 11, 40), rng.randint(3, 9)
    return {"a": a, "b": b}, a * b


def divide(rng: random.Random) -> tuple[Numbers, int]:
    b = rng.randint(2, 9)
    q = two_digit(rng, 11, min(30, 99 // b))  # keeps the dividend two-digit
    return {"total": b * q, "b": b}, q


def add_subtract(rng: random.Random) -> tuple[Numbers, int]:
    a, b = two_digit(rng), two_digit(rng)
    c = two_digit(rng, 10, min(99, a + b - 1))
    return {"a": a, "b": b, "c": c}, a + b - c


def multiply_add(rng: random.Random) -> tuple[Numbers, int]:
    a, b, c = two_digit(rng, 11, 30), rng.randint(3, 9), two_digit(rng)
    return {"a": a, "b": b, "c": c}, a * b + c


def multiply_subtract(rng: random.Random) -> tuple[Numbers, int]:
    a, b = two_digit(rng, 11, 30), rng.randint(3, 9)
    c = two_digit(rng, 10, min(99, a * b - 1))
    return {"a": a, "b": b, "c": c}, a * b - c


def sum_divide(rng: random.Random) -> tuple[Numbers, int]:
    c = rng.randint(2, 9)
    q = two_digit(rng, 11, min(30, 198 // c))  # keeps both addends two-digit
    a = two_digit(rng, max(10, c * q - 99), min(99, c * q - 10))
    return {"a": a, "b": c * q - a, "c": c}, q


ONE_STEP: list[Operation] = [add, subtract, multiply, divide]
TWO_STEP: list[Operation] = [add_subtract, multiply_add, multiply_subtract, sum_divide]

TEMPLATES: dict[str, str] = {
    "add": "{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?",
    "subtract": "{name} had {a} {thing} and gave away {b}. How many {thing} are left?",
    "multiply": "{name} has {b} boxes with {a} {thing} in each box. How many {thing} are there in total?",
    "divide": "{name} shares {total} {thing} equally among {b} friends. How many {thing} does each friend get?",
    "add_subtract": "{name} has {a} {thing}, buys {b} more, then gives away {c}. How many {thing} does {name} have "
                    "now?",
    "multiply_add": "{name} buys {b} packs of {a} {thing} and already had {c}. How many {thing} does {name} have?",
    "multiply_subtract": "{name} has {b} bags with {a} {thing} each and loses {c} of them. How many {thing} are "
                         "left?",
    "sum_divide": "{name} has {a} red and {b} blue {thing} and puts them equally into {c} bags. How many {thing} are "
                  "in each bag?",
}
"""The wording of each operation in train (and in validation's in-template tasks)."""
HELD_OUT: dict[str, str] = {
    "add": "A shelf holds {a} {thing}; {b} more are added. How many {thing} are on the shelf?",
    "subtract": "A jar held {a} {thing}. After {b} were taken out, how many {thing} remain in the jar?",
    "multiply": "Each of {b} tables has {a} {thing} on it. What is the total number of {thing} on the tables?",
    "divide": "A teacher splits {total} {thing} into {b} equal piles. How many {thing} are in one pile?",
    "add_subtract": "A class collects {a} {thing} on Monday and {b} on Tuesday, then uses {c}. How many {thing} "
                    "does the class still have?",
    "multiply_add": "A store gets {b} crates of {a} {thing} and has {c} {thing} in stock already. How many {thing} "
                    "does the store have now?",
    "multiply_subtract": "A club orders {b} cartons holding {a} {thing} each, and {c} {thing} get lost in the mail. "
                         "How many {thing} arrive?",
    "sum_divide": "A shop packs {a} large and {b} small {thing} into {c} boxes, the same number in each. How many "
                  "{thing} go in one box?",
}
"""A new wording of each operation, same numbers and arithmetic: validation's out-of-template tasks only."""
EXPRESSIONS: dict[str, str] = {
    "add": "{a}+{b}", "subtract": "{a}-{b}", "multiply": "{b}*{a}", "divide": "{total}/{b}",
    "add_subtract": "{a}+{b}-{c}", "multiply_add": "{b}*{a}+{c}", "multiply_subtract": "{b}*{a}-{c}",
    "sum_divide": "({a}+{b})/{c}",
}
"""Each operation as one arithmetic expression of its numbers, in the order the training wording gives them (a
task's ``"expression"``: its value is the answer)."""


def signature(operation: str, numbers: Numbers) -> str:
    """What makes two problems the same up to name, object and order of the numbers: ``"add:17,23"``."""
    return f"{operation}:{','.join(str(v) for v in sorted(numbers.values()))}"


def split_of(operation: str, numbers: Numbers) -> str:
    """The one split a problem (in either wording) may appear in."""
    return "validation" if zlib.crc32(signature(operation, numbers).encode()) % VALIDATION_SHARE == 0 else "train"


def kind_of(split: str, index: int) -> str:
    """``"in_template"`` or ``"out_of_template"`` for task ``index`` of ``split``."""
    out = split == "validation" and (index // TWO_STEP_EVERY) % 2 == 1
    return "out_of_template" if out else "in_template"


def make_tasks(split: str, n: int) -> list[dict]:
    """``n`` problems of ``split`` ("train" or "validation"), three one-step to one two-step (index ``i`` is
    two-step when ``i % TWO_STEP_EVERY == TWO_STEP_EVERY - 1``), in a fixed order: ``{"id": "<split>-<i>",
    "question": str, "answer": int, "operation": str, "kind": str, "expression": str}`` (``EXPRESSIONS``).

    Train: distinct questions, all ``"in_template"``, operations drawn at random. Validation: alternating blocks of
    ``TWO_STEP_EVERY`` in-template and out-of-template tasks (``kind_of``); each kind takes the one-step and the
    two-step operations in turn, the same mix in both kinds, and no two tasks of a kind share a signature. An
    operation that finds no unused validation signature in ``MAX_DRAWS`` draws gives its turn to the next one
    (``divide`` has only 5 validation signatures: with 64 tasks, each kind has 5 divisions and 7 additions
    where the turns alone would give 6 of each). No validation signature is a training one (see the module's doc).
    """
    if split not in SEEDS:
        raise ValueError(f"split must be one of {sorted(SEEDS)}, got {split!r}")
    rng = random.Random(SEEDS[split])
    tasks: list[dict] = []
    seen: set[str] = set()
    made: collections.Counter[tuple[str, bool]] = collections.Counter()  # tasks so far by (kind, two-step)
    misses = 0  # draws rejected for the task being made
    while len(tasks) < n:
        i = len(tasks)
        kind, two_step = kind_of(split, i), i % TWO_STEP_EVERY == TWO_STEP_EVERY - 1
        operations = TWO_STEP if two_step else ONE_STEP
        if split == "train":
            operation = rng.choice(operations)
        else:
            operation = operations[(made[kind, two_step] + misses // MAX_DRAWS) % len(operations)]
        numbers, answer = operation(rng)
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        wording = (HELD_OUT if kind == "out_of_template" else TEMPLATES)[operation.__name__]
        question = wording.format(name=name, thing=thing, **numbers)
        key = question if split == "train" else f"{kind} {signature(operation.__name__, numbers)}"
        if split_of(operation.__name__, numbers) != split or key in seen:
            misses += 1
            continue
        seen.add(key)
        made[kind, two_step] += 1
        misses = 0
        tasks.append({"id": f"{split}-{i}", "question": question, "answer": answer, "operation": operation.__name__,
                      "kind": kind, "expression": EXPRESSIONS[operation.__name__].format(**numbers)})
    return tasks
