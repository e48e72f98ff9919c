"""Arithmetic word problems for the calc agent, generated here (Calc-X style): short stories with two-digit numbers
and one or two operations, every answer a non-negative integer (division is always exact).

    make_tasks("train", 512)       # [{"id": "train-0", "question": "...", "answer": 42}, ...]
    make_tasks("validation", 64)

Deterministic: the same split and ``n`` give the same list on every machine and Python version (a seeded
``random.Random`` and no ``hash()``). The splits never share a question: each question is put in one split by a
CRC of its text, and each split draws from its own seed. Knows nothing of agents, LLMs or lit.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable

SEEDS = {"train": 1234, "validation": 5678}
"""One generator seed per split."""
TWO_STEP_EVERY = 4
"""Every fourth task (index 3, 7, ...) is two-step, the rest one-step: the untrained 135M model solves almost no
two-step problem (greedy 0-3%) against 25-30% of one-step ones, and GRPO learns only where rewards vary."""
VALIDATION_SHARE = 8
"""One question in this many (by CRC of its text) belongs to validation; the rest to train."""

NAMES = ["Ana", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kim", "Leo", "Mia",
         "Noah", "Omar", "Pia", "Rosa", "Sam", "Tom", "Zoe"]
THINGS = ["apples", "books", "cards", "coins", "cookies", "marbles", "pencils", "shells", "stamps", "stickers"]

Problem = tuple[str, int]
Template = Callable[[random.Random, str, str], Problem]


def two_digit(rng: random.Random, low: int = 10, high: int = 99) -> int:
    return rng.randint(low, high)


def add(rng: random.Random, name: str, thing: str) -> Problem:
    a, b = two_digit(rng), two_digit(rng)
    return f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", a + b


def subtract(rng: random.Random, name: str, thing: str) -> Problem:
    a = two_digit(rng, 20)
    b = two_digit(rng, 10, a - 1)
    return f"{name} had {a} {thing} and gave away {b}. How many {thing} are left?", a - b


def multiply(rng: random.Random, name: str, thing: str) -> Problem:
    a, b = two_digit(rng, 11, 40), rng.randint(3, 9)
    return f"{name} has {b} boxes with {a} {thing} in each box. How many {thing} are there in total?", a * b


def divide(rng: random.Random, name: str, thing: str) -> Problem:
    b = rng.randint(2, 9)
    q = two_digit(rng, 11, min(30, 99 // b))  # keeps the dividend two-digit
    return f"{name} shares {b * q} {thing} equally among {b} friends. How many {thing} does each friend get?", q


def add_subtract(rng: random.Random, name: str, thing: str) -> Problem:
    a, b = two_digit(rng), two_digit(rng)
    c = two_digit(rng, 10, min(99, a + b - 1))
    question = f"{name} has {a} {thing}, buys {b} more, then gives away {c}. How many {thing} does {name} have now?"
    return question, a + b - c


def multiply_add(rng: random.Random, name: str, thing: str) -> Problem:
    a, b, c = two_digit(rng, 11, 30), rng.randint(3, 9), two_digit(rng)
    question = f"{name} buys {b} packs of {a} {thing} and already had {c}. How many {thing} does {name} have?"
    return question, a * b + c


def multiply_subtract(rng: random.Random, name: str, thing: str) -> Problem:
    a, b = two_digit(rng, 11, 30), rng.randint(3, 9)
    c = two_digit(rng, 10, min(99, a * b - 1))
    question = f"{name} has {b} bags with {a} {thing} each and loses {c} of them. How many {thing} are left?"
    return question, a * b - c


def sum_divide(rng: random.Random, name: str, thing: str) -> Problem:
    c = rng.randint(2, 9)
    q = two_digit(rng, 11, min(30, 198 // c))  # keeps both addends two-digit
    a = two_digit(rng, max(10, c * q - 99), min(99, c * q - 10))
    b = c * q - a
    question = (f"{name} has {a} red and {b} blue {thing} and puts them equally into {c} bags. "
                f"How many {thing} are in each bag?")
    return question, q


ONE_STEP: list[Template] = [add, subtract, multiply, divide]
TWO_STEP: list[Template] = [add_subtract, multiply_add, multiply_subtract, sum_divide]


def split_of(question: str) -> str:
    """The one split a question may appear in."""
    return "validation" if zlib.crc32(question.encode()) % VALIDATION_SHARE == 0 else "train"


def make_tasks(split: str, n: int) -> list[dict]:
    """``n`` distinct problems of ``split`` ("train" or "validation"), three one-step to one two-step, in a fixed
    order: ``{"id": "<split>-<i>", "question": str, "answer": int}``."""
    if split not in SEEDS:
        raise ValueError(f"split must be one of {sorted(SEEDS)}, got {split!r}")
    rng = random.Random(SEEDS[split])
    tasks: list[dict] = []
    seen: set[str] = set()
    while len(tasks) < n:
        templates = TWO_STEP if len(tasks) % TWO_STEP_EVERY == TWO_STEP_EVERY - 1 else ONE_STEP
        question, answer = rng.choice(templates)(rng, rng.choice(NAMES), rng.choice(THINGS))
        if question in seen or split_of(question) != split:
            continue
        seen.add(question)
        tasks.append({"id": f"{split}-{len(tasks)}", "question": question, "answer": answer})
    return tasks
