"""Every declared range or choice of every config section (``RULES``, lit_trainer/settings.py), tested from the
declarations themselves: a value just outside is refused by ``from_dict`` with a message naming ``section.key``, a
value just inside loads. A field given a rule is tested here without a line more."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import re
from pathlib import Path
from typing import Any

import pytest

import lit_trainer
from lit_trainer import config
from lit_trainer.config import ConfigError, TrainConfig, from_dict
from lit_trainer.settings import Rule, at_least, check

SECTIONS = {f.name: type(config._default(f)) for f in dataclasses.fields(TrainConfig)
            if dataclasses.is_dataclass(config._default(f))}

COMPANIONS: dict[tuple[str, Any], dict[str, dict[str, Any]]] = {
    ("weight_sync.transport", "nccl"): {"inference": {"weight_transfer_backend": "nccl"}},
    ("weight_sync.transport", "ipc"): {"inference": {"weight_transfer_backend": "ipc"}},
    ("loss.is_correction", "truncate"): {"update": {"recompute_old_logprobs": True}},
    ("loss.is_correction", "mask"): {"update": {"recompute_old_logprobs": True}},
    ("sft.source", "references"): {"sft": {"steps": 1}},
    ("sft.source", "teacher"): {"sft": {"steps": 1, "teacher_url": "http://127.0.0.1:9/v1", "teacher_model": "m"}},
    ("sft.source", "store"): {"sft": {"steps": 1, "store": "runs/earlier"}},
    ("inference.layout", "dedicated"): {"inference": {"gpus": [1]}},
}
"""What another section, or another key of the same one, must say for a value inside its range to load (the rules
between keys)."""
LIBRARY_ONLY = {("weight_sync.mode", "lora")}
"""Values a section accepts that ``lit train`` refuses (a cross-section rule): checked on the class alone."""


def _edge_values(rule: Rule, default: Any) -> tuple[list[Any], list[Any]]:
    """Values just outside and just inside ``rule``, of the field's type (that of its default)."""
    if rule.choices:
        return [f"not-{rule.choices[-1]}-either"], list(rule.choices)
    integer = isinstance(default, int)
    step = (lambda x, up: x + (1 if up else -1)) if integer else (lambda x, up: math.nextafter(x, math.inf if up
                                                                                                   else -math.inf))
    outside, inside = [], []
    for bound, is_open, up in ((rule.low, rule.low_open, False), (rule.high, rule.high_open, True)):
        if bound is None:
            continue
        bound = int(bound) if integer else float(bound)
        outside.append(bound if is_open else step(bound, up))
        inside.append(step(bound, not up) if is_open else bound)
    if not integer:
        outside += [math.nan, math.inf, -math.inf]
    if rule.or_zero:
        inside.append(0)
        outside = [v for v in outside if v != 0] + [-1]
    return outside, inside or [default]


def _cases(inside: bool) -> list[Any]:
    cases = []
    for section, cls in SECTIONS.items():
        defaults = {f.name: config._default(f) for f in dataclasses.fields(cls)}
        for name, rule in getattr(cls, "RULES", {}).items():
            outside, fine = _edge_values(rule, defaults[name])
            cases += [pytest.param(section, name, value, id=f"{section}.{name}={value!r}")
                      for value in (fine if inside else outside)]
    return cases


@pytest.mark.parametrize(("section", "name", "value"), _cases(inside=False))
def test_a_value_just_outside_its_declared_range_is_refused_by_its_key(section, name, value):
    with pytest.raises(ConfigError, match=re.escape(f"[{section}]: {section}.{name} must be ")) as raised:
        from_dict({section: {name: value}})
    assert f"got {value!r}" in str(raised.value)


@pytest.mark.parametrize(("section", "name", "value"), _cases(inside=True))
def test_a_value_just_inside_its_declared_range_loads(section, name, value):
    key = f"{section}.{name}"
    if (key, value) in LIBRARY_ONLY:
        assert getattr(SECTIONS[section](**{name: value}), name) == value
        return
    companions = COMPANIONS.get((key, value), {})
    loaded = from_dict({**companions, section: {**companions.get(section, {}), name: value}})
    assert getattr(getattr(loaded, section), name) == value


@pytest.mark.parametrize("cls", sorted(set(SECTIONS.values()), key=lambda c: c.__name__))
def test_every_section_names_itself_and_declares_rules_of_its_own_fields(cls):
    served = [section for section, of in SECTIONS.items() if of is cls]
    assert cls.SECTION in served or len(served) > 1, (cls, served)
    fields = {f.name: config._default(f) for f in dataclasses.fields(cls)}
    for name, rule in getattr(cls, "RULES", {}).items():
        assert name in fields, f"{cls.__name__}.RULES names {name!r}, which is no field"
        assert rule.allows(fields[name]), f"the default of {cls.SECTION}.{name} is outside its own rule"


def test_a_section_served_by_one_class_for_several_is_named_as_the_file_names_it():
    @dataclasses.dataclass(frozen=True)
    class Shared:
        SECTION = "endpoint"
        RULES = {"port": at_least(1)}
        port: int = 1

        def __post_init__(self) -> None:
            check(self)

    with pytest.raises(ConfigError, match=r"^c.toml \[collector\]: collector.port must be >= 1, got 0$"):
        config._build(Shared, {"port": 0}, "c.toml [collector]", "collector")
    with pytest.raises(ValueError, match=r"^endpoint.port must be >= 1"):
        Shared(port=0)
    assert "dispatch_endpoint.endpoint" in str(pytest.raises(ConfigError, from_dict,
                                                               {"dispatch_endpoint": {"endpoint": "bogus"}}).value)


CLASS_NAMED = re.compile(r"[A-Z][A-Za-z]+Config\.[a-z_]+")
SRC = Path(lit_trainer.__file__).parent
def _keys_named_by_class(source: str) -> list[str]:
    """``SomethingConfig.key`` in the string literals of ``source`` (an f-string's fields read as ``x``); not in
    docstrings, which describe the classes."""
    tree = ast.parse(source)
    docs = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            found += CLASS_NAMED.findall("".join(v.value if isinstance(v, ast.Constant) else "x" for v in node.values))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            found += CLASS_NAMED.findall(node.value)
    return found


@pytest.mark.parametrize("cls", sorted({*SECTIONS.values(), TrainConfig}, key=lambda c: c.__name__))
def test_no_config_check_names_a_key_by_its_class(cls):
    import textwrap

    assert not _keys_named_by_class(textwrap.dedent(inspect.getsource(cls)))


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_no_message_in_the_source_names_a_key_by_its_class(path):
    assert not _keys_named_by_class(path.read_text())
