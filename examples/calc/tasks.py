"""Arithmetic word problems for the calc agent, generated here (Calc-X style): short stories with two-digit numbers
and one or two operations, every answer a non-negative integer (division is always exact).

    make_tasks("train", 512)       # [{"id": "train-0", "question": "...", "answer": 42, "operation": "add",
                                   #   "kind": "in_template"}, ...]
    make_tasks("validation", 64)   # half "in_template", half "out_of_template"

Each problem is an operation (``add``, ``multiply_subtract``...: the arithmetic and how its numbers are drawn) put
into words by a template with a subject (a person's name or a role such as "A baker") and an object. Every
operation has five training wordings (``TEMPLATES``, one drawn per problem), used by both splits, that differ in
verbs, sentence shape and the order the numbers come in, so that what the model learns is to read a problem rather
than one sentence; and a held-out wording (``HELD_OUT``) that only validation uses, for the ``"out_of_template"``
tasks, sharing no run of six words with a training wording (tests/examples/test_calc.py). The split a problem may
appear in is decided by its signature, the operation's name and its numbers sorted (``signature``), never by its
text: validation gets the signatures whose CRC is 0 modulo ``VALIDATION_SHARE``, train all others. So no validation
problem, in any wording, is a training problem with another subject, object or wording, or its numbers swapped
(same operation, same numbers).

To train on your own problems, return the same dicts from your own function (``data.tasks`` in the config names
it): ``question`` and ``answer`` are what the agent needs; ``kind`` splits the validation accuracy in the metrics.

Train: every task ``"in_template"``, distinct questions, one-step and two-step problems in turn
(``TRAIN_TWO_STEP_EVERY``). Validation: three one-step to one two-step; task ``i`` is ``"in_template"`` when
``i // TWO_STEP_EVERY`` is even, ``"out_of_template"`` when odd (blocks of four, so each kind keeps that mix, and 64
tasks are 32 of each), each kind taking the operations in turn (the same mix of operations in both kinds), no two
tasks of a kind sharing a signature (see ``make_tasks``).

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
TRAIN_TWO_STEP_EVERY = 2
"""Every second training task is two-step: trained on validation's 3:1 mix, most one-step groups soon have every
rollout right and teach nothing, while the two-step problems are where the signal is (examples/README.md)."""
VALIDATION_SHARE = 8
"""One signature (operation and numbers, by CRC) in this many belongs to validation; the rest to train."""
KINDS = ("in_template", "out_of_template")
"""Validation alternates them by blocks of ``TWO_STEP_EVERY`` tasks; train has only the first."""
MAX_DRAWS = 1000
"""Draws a validation operation gets to find a problem of its split not yet used in its kind, before its turn
passes to the next operation (so that ``make_tasks`` ends once an operation's validation problems run out)."""

NAMES = ["Ana", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kim", "Leo", "Mia",
         "Noah", "Omar", "Pia", "Rosa", "Sam", "Tom", "Zoe"]
ROLES = [("A baker", "the baker"), ("A farmer", "the farmer"), ("A librarian", "the librarian"),
         ("A coach", "the coach"), ("The school", "the school"), ("A museum", "the museum")]
"""Subjects that are not a person's name: (as a sentence starts with it, as it is named again)."""
SUBJECTS = [(name, name) for name in NAMES] + ROLES
"""Every subject, as ``ROLES``."""
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

TEMPLATES: dict[str, tuple[str, ...]] = {
    "add": (
        "{name} has {a} {thing} and gets {b} more. How many {thing} does {who} have now?",
        "{name} found {a} {thing} in the morning and {b} in the afternoon. How many {thing} did {who} find?",
        "There are {a} {thing} in a box, and {who} puts in {b} more. How many {thing} are in the box?",
        "{name} is given {b} {thing}. Before that, {who} had {a}. How many {thing} does {who} have?",
        "{name} counts {a} {thing} in one room and {b} in another. How many {thing} is that altogether?",
    ),
    "subtract": (
        "{name} had {a} {thing} and gave away {b}. How many {thing} are left?",
        "{name} had {a} {thing} and sold {b} of them. How many {thing} does {who} still have?",
        "{name} needs {a} {thing} and already has {b}. How many more {thing} does {who} need?",
        "There were {a} {thing} in a bag. {name} took {b} of them. How many {thing} stayed in the bag?",
        "{name} lost {b} of the {a} {thing} {who} owned. How many {thing} does {who} have now?",
    ),
    "multiply": (
        "{name} has {b} boxes with {a} {thing} in each box. How many {thing} are there in total?",
        "{name} buys {a} {thing} every day for {b} days. How many {thing} does {who} buy?",
        "A pack holds {a} {thing}. How many {thing} are in {b} packs?",
        "{name} fills {b} bags and puts {a} {thing} in every bag. How many {thing} did {who} use?",
        "{name} makes {a} {thing} an hour for {b} hours. How many {thing} does {who} make?",
    ),
    "divide": (
        "{name} shares {total} {thing} equally among {b} friends. How many {thing} does each friend get?",
        "{name} packs {total} {thing} evenly into {b} bags. How many {thing} are in each bag?",
        "{total} {thing} are given out evenly to {b} kids by {who}. How many {thing} does each kid get?",
        "{name} has {total} {thing} and makes {b} equal groups of them. How many {thing} are in each group?",
        "{name} wants to give {b} friends the same number of {thing} and has {total}. How many {thing} does each "
        "friend get?",
    ),
    "add_subtract": (
        "{name} has {a} {thing}, buys {b} more, then gives away {c}. How many {thing} does {who} have now?",
        "{name} picked {a} {thing} in the morning and {b} in the afternoon, and ate {c}. How many {thing} are left?",
        "There are {a} {thing} in a box. {name} adds {b} more and then removes {c}. How many {thing} are in the box?",
        "{name} had {a} {thing}. A friend gave {who} {b} more, but {who} lost {c}. How many {thing} does {who} have?",
        "{name} sold {c} {thing} after collecting {a} in May and {b} in June. How many {thing} does {who} keep?",
    ),
    "multiply_add": (
        "{name} buys {b} packs of {a} {thing} and already had {c}. How many {thing} does {who} have?",
        "{name} has {c} loose {thing} and {b} full boxes of {a} {thing} each. How many {thing} does {who} have in "
        "all?",
        "{name} fills {b} bags with {a} {thing} each and keeps {c} more in a drawer. How many {thing} are there?",
        "{name} earns {a} {thing} a day for {b} days and gets a bonus of {c} {thing}. How many {thing} does {who} "
        "get?",
        "{name} had {c} {thing}. Then {who} bought {b} sets of {a}. How many {thing} does {who} have now?",
    ),
    "multiply_subtract": (
        "{name} has {b} bags with {a} {thing} each and loses {c} of them. How many {thing} are left?",
        "{name} bakes {b} trays of {a} {thing} and sells {c}. How many {thing} are left?",
        "{name} buys {b} boxes of {a} {thing}, then gives {c} {thing} away. How many {thing} does {who} keep?",
        "There are {b} shelves with {a} {thing} on each. {name} takes {c} of them. How many {thing} stay on the "
        "shelves?",
        "{name} collects {a} {thing} a week for {b} weeks but loses {c}. How many {thing} does {who} have?",
    ),
    "sum_divide": (
        "{name} has {a} red and {b} blue {thing} and puts them equally into {c} bags. How many {thing} are in each "
        "bag?",
        "{name} and a friend found {a} and {b} {thing}. They share all of them equally among {c} people. How many "
        "{thing} does each person get?",
        "{name} collected {a} {thing} on one trip and {b} on another, then split them into {c} equal groups. How "
        "many {thing} are in each group?",
        "{name} has {a} old and {b} new {thing}. All of them are divided evenly among {c} baskets. How many {thing} "
        "does each basket get?",
        "There are {a} {thing} in one bag and {b} in another. {name} puts them all into {c} even stacks. How many "
        "{thing} are in each stack?",
    ),
}
"""The wordings of each operation in train (and in validation's in-template tasks): ``{name}`` is the subject as it
starts a sentence, ``{who}`` as it is named again ("Ana", or "A baker" then "the baker")."""
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
    """``n`` problems of ``split`` ("train" or "validation") in a fixed order: ``{"id": "<split>-<i>", "question":
    str, "answer": int, "operation": str, "kind": str}``. Index ``i`` is two-step when ``i % every == every - 1``,
    ``every`` being ``TRAIN_TWO_STEP_EVERY`` in train (one to one) and ``TWO_STEP_EVERY`` in validation (three
    one-step to one two-step).

    Train: distinct questions, all ``"in_template"``, operations and wordings drawn at random. Validation: alternating blocks of
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
        every = TRAIN_TWO_STEP_EVERY if split == "train" else TWO_STEP_EVERY
        kind, two_step = kind_of(split, i), i % every == every - 1
        operations = TWO_STEP if two_step else ONE_STEP
        if split == "train":
            operation = rng.choice(operations)
        else:
            operation = operations[(made[kind, two_step] + misses // MAX_DRAWS) % len(operations)]
        numbers, answer = operation(rng)
        name, who = rng.choice(SUBJECTS)
        thing = rng.choice(THINGS)
        if kind == "out_of_template":
            wording = HELD_OUT[operation.__name__]
        else:
            wording = rng.choice(TEMPLATES[operation.__name__])
        question = wording.format(name=name, who=who, thing=thing, **numbers)
        key = question if split == "train" else f"{kind} {signature(operation.__name__, numbers)}"
        if split_of(operation.__name__, numbers) != split or key in seen:
            misses += 1
            continue
        seen.add(key)
        made[kind, two_step] += 1
        misses = 0
        tasks.append({"id": f"{split}-{i}", "question": question, "answer": answer, "operation": operation.__name__,
                      "kind": kind})
    return tasks
