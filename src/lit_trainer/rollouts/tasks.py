"""The tasks of a run: the train and held-out splits from ``[data] tasks``, and which tasks each step samples.
A wrong ``[data]`` section raises ValueError naming the key and the fix."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from lit_sdk.protocol import codec
from lit_sdk.targets import check_takes, load_target
from lit_trainer.settings import at_least, check

log = logging.getLogger("lit")


@dataclass(frozen=True)
class DataConfig:
    SECTION = "data"
    RULES = dict.fromkeys(("train_size", "val_size"), at_least(1, "(how many tasks of the split to load)"))

    tasks: str = ""
    """``module:function`` called as ``fn(split, n)`` returning a list of tasks (dicts with an ``id``), or a folder
    with ``train.jsonl`` and ``validation.jsonl``."""
    train_size: int = 2000
    """Training tasks to load."""
    val_size: int = 64
    """Held-out tasks to validate on."""

    def __post_init__(self) -> None:
        check(self)


def sample_tasks(tasks: list[dict], seed: int, step: int, n: int, draw: int = 0) -> list[dict]:
    """The tasks of one step: a function of (seed, step) only, so a resumed run sees the same data. ``draw`` >= 1:
    the step's extra draw of that number (dynamic sampling), from ``tasks`` (those the step has not run)."""
    return random.Random(f"{seed}:{step}" + (f":{draw}" if draw else "")).sample(tasks, min(n, len(tasks)))


def load_tasks(data: DataConfig) -> tuple[list[dict], list[dict]]:
    """The train and validation tasks, from ``module:function`` or a folder of JSONL files; ValueError naming the
    rule a split breaks (a list of dicts, not empty, each with an ``id``, no id twice)."""
    if not data.tasks:
        raise ValueError("[data] tasks is not set: give module:function or a folder with train.jsonl")
    if ":" in data.tasks:
        make = load_target(data.tasks, "tasks")
        check_takes(make, ("split", "n"), f"[data] tasks = {data.tasks}: the tasks function",
                    " (split: 'train' or 'validation')")
        splits = tuple(_as_list(_made(make, name, size, data.tasks), data.tasks, name)
                       for name, size in (("train", data.train_size), ("validation", data.val_size)))
    else:
        folder = Path(data.tasks)
        splits = tuple(_read_jsonl(folder / f"{name}.jsonl")[:size]
                       for name, size in (("train", data.train_size), ("validation", data.val_size)))
    for name, tasks in zip(("train", "validation"), splits, strict=True):
        problem = _broken_rule(tasks)
        if problem:
            raise ValueError(f"[data] tasks = {data.tasks}: the {name} split {problem}. Each split must be a "
                             "non-empty list of dicts, each with an 'id' that no other task of the split has")
    shared = shared_with_training(*splits)
    if shared:
        log.warning("lit: warning: [data] tasks = %s: %d of the %d validation tasks are also in the train split (the "
                    "same fields apart from 'id'; the first: id %r): held-out accuracy counts what the model may "
                    "have learnt by heart; take them out of one split", data.tasks, len(shared), len(splits[1]),
                    shared[0])
    return list(splits[0]), list(splits[1])


def shared_with_training(train: list[dict], validation: list[dict]) -> list[object]:
    """The ids of the validation tasks that a training task repeats exactly: every field the same but ``id``
    (near-duplicates, a question reworded, are not found here). Tasks with no field but their ``id`` are left out:
    there is nothing in them to learn by heart."""
    seen = {_content(task) for task in train}
    return [task["id"] for task in validation if len(task) > 1 and _content(task) in seen]


def _content(task: dict) -> str:
    return json.dumps({k: v for k, v in task.items() if k != "id"}, sort_keys=True, default=repr)


def _made(make, split: str, size: int, source: str) -> object:
    """``make(split, size)``; an error of the user's function comes back naming it, its traceback kept."""
    try:
        return make(split, size)
    except Exception as exc:
        raise ValueError(f"[data] tasks = {source}: the tasks function raised {type(exc).__name__} for the {split} "
                         f"split: {exc}") from exc


def _as_list(made: object, source: str, split: str) -> list:
    """What the tasks function returned for ``split``, as a list: a generator or other iterable is read once."""
    if isinstance(made, list):
        return made
    if isinstance(made, (str, bytes, dict)) or not isinstance(made, Iterable):
        raise ValueError(f"[data] tasks = {source}: the tasks function returned a {type(made).__name__} for the "
                         f"{split} split, not a list of task dicts")
    return list(made)


def _broken_rule(tasks: list) -> str | None:
    """Which rule of a split ``tasks`` breaks, in words; None when it keeps them all."""
    if not tasks:
        return "is empty"
    seen: dict[object, int] = {}
    for i, task in enumerate(tasks):
        if not isinstance(task, dict):
            return f"has a {type(task).__name__} at position {i}, not a dict"
        if task.get("id") is None:
            return f"has a task without an 'id' at position {i} (keys: {sorted(task)[:6]})"
        if not isinstance(task["id"], (str, int)):
            return f"has an id that is a {type(task['id']).__name__} at position {i} (ids are strings or integers)"
        key = str(task["id"])  # rollout ids, the store and the groups take an id as text
        if key in seen:
            first = tasks[seen[key]]["id"]
            if first == task["id"]:
                return f"has the id {first!r} twice (positions {seen[key]} and {i})"
            return (f"has the ids {first!r} and {task['id']!r}, which are one id to lit (it takes an id as text; "
                    f"positions {seen[key]} and {i})")
        seen[key] = i
        unsendable = _unsendable(task)
        if unsendable:
            return f"has a task lit cannot send to a worker at position {i} (id {task['id']!r}): {unsendable}"
    return None


_TASK_BYTES = codec.MAX_FRAME_BYTES // 2
"""The largest task, encoded: it travels to a worker in a ``run`` message, whose frame has other fields too."""


def _unsendable(task: dict) -> str | None:
    """Why ``task`` cannot travel to a worker as it is (MessagePack, maps keyed by text), or None."""
    try:
        data = codec.packb(task)
        codec.unpackb(data, strict_map_key=True)
    except TypeError as exc:
        return (f"{exc}; a task holds text, numbers, true/false, null, lists and dicts keyed by text (a date or a "
                "path as text)")
    except (OverflowError, ValueError) as exc:  # an int past 64 bits; a map keyed by a number
        return f"{exc}; a task holds integers of at most 64 bits and dicts keyed by text"
    if len(data) > _TASK_BYTES:
        return f"{len(data)} bytes encoded, over {_TASK_BYTES}: keep large data in a file the agent reads"
    return None


def _read_jsonl(path: Path) -> list[dict]:
    if path.parent.is_file():
        raise ValueError(f"[data] tasks = {path.parent} is a file: give the folder that holds train.jsonl and "
                         "validation.jsonl (or module:function)")
    if not path.parent.is_dir():
        raise ValueError(f"[data] tasks = {path.parent}: no such folder (a relative path starts from the current "
                         f"folder, {Path.cwd()})")
    if not path.exists():
        raise ValueError(f"[data] no {path.name} in {path.parent}")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        line = exc.object[:exc.start].count(b"\n") + 1
        raise ValueError(f"[data] {path} line {line} is not UTF-8 (byte {exc.object[exc.start]:#04x}): save the file "
                         "as UTF-8") from None
    except OSError as exc:
        raise ValueError(f"[data] {path} cannot be read: {exc.strerror or exc}") from None
    tasks = []
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 and the like may sit in a string
        if not line.strip():
            continue
        try:
            tasks.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"[data] {path} line {number} is not JSON ({exc.msg}, column {exc.colno}): one task, a "
                             "JSON object, per line") from None
    return tasks
