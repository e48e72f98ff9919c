"""The tasks of a run: the train and held-out splits from ``[data] tasks``, and which tasks each step samples.
A wrong ``[data]`` section raises ValueError naming the key and the fix."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from lit_sdk.worker import load_target


@dataclass(frozen=True)
class DataConfig:
    tasks: str = ""
    """``module:function`` called as ``fn(split, n)`` returning a list of tasks (dicts with an ``id``), or a folder
    with ``train.jsonl`` and ``validation.jsonl``."""
    train_size: int = 2000
    """Training tasks to load."""
    val_size: int = 64
    """Held-out tasks to validate on."""


def sample_tasks(tasks: list[dict], seed: int, step: int, n: int) -> list[dict]:
    """The tasks of one step: a function of (seed, step) only, so a resumed run sees the same data."""
    return random.Random(f"{seed}:{step}").sample(tasks, min(n, len(tasks)))


def load_tasks(data: DataConfig) -> tuple[list[dict], list[dict]]:
    """The train and validation tasks, from ``module:function`` or a folder of JSONL files."""
    if not data.tasks:
        raise ValueError("[data] tasks is not set: give module:function or a folder with train.jsonl")
    if ":" in data.tasks:
        make = load_target(data.tasks)
        splits = make("train", data.train_size), make("validation", data.val_size)
    else:
        folder = Path(data.tasks)
        splits = tuple(_read_jsonl(folder / f"{name}.jsonl")[:size]
                       for name, size in (("train", data.train_size), ("validation", data.val_size)))
    for name, tasks in zip(("train", "validation"), splits, strict=True):
        ids = [t.get("id") if isinstance(t, dict) else None for t in tasks]
        if not tasks or None in ids or len(set(ids)) != len(ids):
            raise ValueError(f"[data] {data.tasks}: the {name} split must be a non-empty list of dicts with "
                              "unique 'id' values")
    return list(splits[0]), list(splits[1])


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        raise ValueError(f"[data] no {path.name} in {path.parent}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
