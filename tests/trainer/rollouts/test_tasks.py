"""Tasks: the splits come from ``module:function`` or a JSONL folder; each step's sample depends only on (seed,
step), so a resumed run sees the same tasks; a wrong ``[data]`` section is an error that names it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lit_trainer.rollouts.tasks import DataConfig, load_tasks, sample_tasks


def write_split(folder: Path, name: str, tasks: list[dict]) -> None:
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))


def test_a_step_samples_the_same_tasks_for_the_same_seed_and_step():
    tasks = [{"id": i} for i in range(50)]
    first = sample_tasks(tasks, seed=3, step=7, n=8)
    assert first == sample_tasks(list(tasks), seed=3, step=7, n=8)
    assert len({t["id"] for t in first}) == 8
    assert first != sample_tasks(tasks, seed=3, step=8, n=8)
    assert first != sample_tasks(tasks, seed=4, step=7, n=8)
    assert sorted(t["id"] for t in sample_tasks(tasks[:5], seed=0, step=0, n=8)) == [0, 1, 2, 3, 4]


def test_splits_load_from_a_jsonl_folder_cut_to_size(tmp_path: Path):
    write_split(tmp_path, "train", [{"id": i, "q": f"t{i}"} for i in range(10)])
    write_split(tmp_path, "validation", [{"id": f"v{i}"} for i in range(4)])
    train, val = load_tasks(DataConfig(tasks=str(tmp_path), train_size=6, val_size=3))
    assert [t["id"] for t in train] == [0, 1, 2, 3, 4, 5]
    assert [t["id"] for t in val] == ["v0", "v1", "v2"]


def test_splits_load_from_a_function(tmp_path: Path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(
        "def make(split, n):\n    return [{'id': f'{split}-{i}'} for i in range(n)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    train, val = load_tasks(DataConfig(tasks="my_tasks:make", train_size=3, val_size=2))
    assert [t["id"] for t in train] == ["train-0", "train-1", "train-2"]
    assert [t["id"] for t in val] == ["validation-0", "validation-1"]


@pytest.mark.parametrize(
    ("train", "validation", "words"),
    [
        (None, [{"id": 1}], "no train.jsonl"),
        ([{"id": 1}, {"id": 1}], [{"id": 2}], r"the train split has the id 1 twice \(positions 0 and 1\)"),
        ([{"id": 1}], [{"id": 2}, {"q": "no id"}], r"the validation split has a task without an 'id' at position 1"),
        ([{"id": 1}], [], "the validation split is empty. Each split must be a non-empty list of dicts"),
        ([{"id": 1}, [1]], [{"id": 2}], "the train split has a list at position 1, not a dict"),
        ([{"id": [1]}], [{"id": 2}], "has an id that is a list at position 0"),
        # one rollout key, one store row, one group for both: the run stopped at its first validation
        ([{"id": 1}], [{"id": 2}, {"id": "2"}], r"has the ids 2 and '2', which are one id to lit \(it takes an id as "
                                                  r"text; positions 0 and 1\)"),
        ([{"id": 1, "when": {"1": 2**70}}], [{"id": 2}], r"cannot send to a worker at position 0 \(id 1\): Integer "
                                                          "value out of range; a task holds integers of at most 64"),
    ],
)
def test_a_wrong_data_section_names_the_problem(tmp_path: Path, train, validation, words):
    if train is not None:
        write_split(tmp_path, "train", train)
    write_split(tmp_path, "validation", validation)
    with pytest.raises(ValueError, match=words):
        load_tasks(DataConfig(tasks=str(tmp_path)))


def test_a_line_that_is_not_json_is_named_with_its_file_and_number(tmp_path: Path):
    (tmp_path / "train.jsonl").write_text('{"id": 1, "q": "a"}\n\n{"id": 2, "q": "b"},\n')
    write_split(tmp_path, "validation", [{"id": 3}])
    with pytest.raises(ValueError) as raised:
        load_tasks(DataConfig(tasks=str(tmp_path)))
    assert str(raised.value) == (f"[data] {tmp_path / 'train.jsonl'} line 3 is not JSON (Extra data, column 20): one "
                                 "task, a JSON object, per line")


def test_validation_tasks_that_repeat_a_training_task_are_warned_about(tmp_path: Path, caplog):
    write_split(tmp_path, "train", [{"id": 1, "q": "2+2", "answer": 4}, {"id": 2, "q": "3+3", "answer": 6}])
    write_split(tmp_path, "validation", [{"id": "v1", "q": "5+5", "answer": 10}, {"id": "v2", "answer": 6, "q": "3+3"},
                                         {"id": "v3", "q": "3+3", "answer": 7}])
    train, val = load_tasks(DataConfig(tasks=str(tmp_path)))
    assert len(train) == 2 and len(val) == 3  # a warning: the split stays as the user made it
    [record] = [r for r in caplog.records if r.name == "lit"]
    assert record.levelname == "WARNING" and record.getMessage() == (
        f"lit: warning: [data] tasks = {tmp_path}: 1 of the 3 validation tasks are also in the train split (the "
        "same fields apart from 'id'; the first: id 'v2'): held-out accuracy counts what the model may have learnt "
        "by heart; take them out of one split")
    caplog.clear()
    write_split(tmp_path, "validation", [{"id": "v1"}, {"id": "v2", "q": "3+3 "}])  # only an id; not the same
    load_tasks(DataConfig(tasks=str(tmp_path)))
    assert not [r for r in caplog.records if r.name == "lit"]


def test_a_file_not_in_utf8_names_its_line_and_a_bom_or_a_line_separator_is_fine(tmp_path: Path):
    """A Latin-1 file gave 'utf-8 codec can't decode byte 0xe9 in position 16' with no file; U+2028 in a string
    (json.dumps writes it raw) split the line in two, 'not JSON'; a BOM was 'not JSON' either."""
    (tmp_path / "train.jsonl").write_bytes(b'{"id": 1, "q": "ok"}\n{"id": 2, "q": "Caf\xe9"}\n')
    (tmp_path / "validation.jsonl").write_text("\ufeff" + json.dumps({"id": 3, "q": "a\u2028b"}, ensure_ascii=False),
                                               encoding="utf-8")
    with pytest.raises(ValueError) as raised:
        load_tasks(DataConfig(tasks=str(tmp_path)))
    assert str(raised.value) == (f"[data] {tmp_path / 'train.jsonl'} line 2 is not UTF-8 (byte 0xe9): save the file "
                                 "as UTF-8")
    write_split(tmp_path, "train", [{"id": 1}])
    assert load_tasks(DataConfig(tasks=str(tmp_path)))[1] == [{"id": 3, "q": "a\u2028b"}]


def test_a_folder_that_is_not_there_or_a_file_says_which(tmp_path: Path):
    with pytest.raises(ValueError, match=r"tasks = .*nope: no such folder \(a relative path starts from the current"):
        load_tasks(DataConfig(tasks=str(tmp_path / "nope")))
    write_split(tmp_path, "train", [{"id": 1}])
    with pytest.raises(ValueError, match=r"train.jsonl is a file: give the folder that holds train.jsonl"):
        load_tasks(DataConfig(tasks=str(tmp_path / "train.jsonl")))


def test_no_tasks_configured_says_how_to_set_them():
    with pytest.raises(ValueError, match=r"\[data\] tasks is not set"):
        load_tasks(DataConfig())


def _tasks_module(tmp_path: Path, monkeypatch, body: str) -> str:
    """A tasks module of its own for each test (``user_tasks_<n>:make``): an imported module stays imported."""
    name = f"user_tasks_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}:make"


def test_a_generator_tasks_function_gives_its_tasks(tmp_path: Path, monkeypatch):
    """A generator was read empty before (its tasks went into the id check): it is read once, as a list."""
    target = _tasks_module(tmp_path, monkeypatch,
                           "def make(split, n):\n    for i in range(n):\n        yield {'id': f'{split}{i}'}\n")
    train, val = load_tasks(DataConfig(tasks=target, train_size=3, val_size=2))
    assert [t["id"] for t in train] == ["train0", "train1", "train2"] and len(val) == 2


@pytest.mark.parametrize(("body", "words"), [
    ("def make(split):\n    return []\n", r"the tasks function must take \(split, n\).*signature is \(split\)"),
    ("def make(split, n):\n    return {'id': 1}\n", "returned a dict for the train split, not a list of task dicts"),
    ("def make(split, n):\n    return None\n", "returned a NoneType for the train split"),
    ("import no_such_module_xyz\ndef make(split, n):\n    return []\n",
     "cannot import the tasks module 'user_tasks_.*': No module named 'no_such_module_xyz'"),
    ("def other(split, n):\n    return []\n", "the tasks module 'user_tasks_.*' has no function 'make'"),
    ("def make(split, n):\n    return [{'id': int('abc')}]\n",  # the user's bug: named as theirs
     r"the tasks function raised ValueError for the train split: invalid literal for int\(\)"),
    ("import datetime\ndef make(split, n):\n    return [{'id': 1, 'day': datetime.date(2026, 1, 1)}]\n",
     r"cannot send to a worker at position 0 \(id 1\): can not serialize 'datetime.date' object; a task holds text"),
])
def test_a_wrong_tasks_function_names_the_rule_it_breaks(tmp_path: Path, monkeypatch, body: str, words: str):
    target = _tasks_module(tmp_path, monkeypatch, body)
    with pytest.raises(ValueError, match=words):
        load_tasks(DataConfig(tasks=target, train_size=3, val_size=2))
