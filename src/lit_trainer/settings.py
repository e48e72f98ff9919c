"""Declared settings: the range or the choices of each config field, stated once in the class that declares it and
checked by one function, whose messages name the key as a config file writes it (``section.key``)::

    @dataclass(frozen=True)
    class UpdateConfig:
        SECTION = "update"
        RULES = {"ppo_epochs": at_least(1), "overlong": one_of(OVERLONG)}
        ...
        def __post_init__(self) -> None:
            check(self)

Rules that join several fields, and special checks, stay code in ``__post_init__``, their messages naming keys the
same way. A class that serves several sections (``EndpointConfig``) names one; the loader renames it to the section
the value came from. This module imports nothing of lit, so that every config module may use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rule:
    """The values one setting may take: one of ``choices``, or a number in a range (NaN and infinity never are)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    """``low`` itself is outside the range (a positive number: ``low=0, low_open=True``)."""
    high_open: bool = False
    or_zero: bool = False
    """0 is allowed too, below ``low`` (it means off, or chosen for you)."""
    choices: tuple[Any, ...] = ()
    why: str = ""
    """What a value means or what to do, said after the range, e.g. ``(0: never)``."""

    def allows(self, value: Any) -> bool:
        if self.choices:
            return value in self.choices
        if self.or_zero and value == 0:
            return True
        if not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def wants(self, value: Any) -> str:
        """What the message says a value must be (a float's range as a number's: NaN and infinity are refused)."""
        if self.choices:
            return f"one of {self.choices}"
        low, high, number = _shown(self.low), _shown(self.high), isinstance(value, float)
        if self.low is not None and self.high is not None:
            wanted = f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        elif self.low == 0 and self.low_open:
            wanted = "a positive number"
        elif self.low is not None:
            wanted = f"{'a finite number ' if number else ''}{'>' if self.low_open else '>='} {low}"
        else:
            wanted = "a finite number"
        return f"0 or {wanted}" if self.or_zero else wanted


def at_least(least: float, why: str = "") -> Rule:
    """An integer >= ``least``, or (for a float field) a finite number >= ``least``."""
    return Rule(low=least, why=why)


def above(low: float, why: str = "") -> Rule:
    """A finite number > ``low``."""
    return Rule(low=low, low_open=True, why=why)


def positive(why: str = "") -> Rule:
    """A finite number > 0."""
    return above(0, why)


def between(low: float, high: float, why: str = "", low_open: bool = False, high_open: bool = False) -> Rule:
    """A number in [low, high] (or with an open end: (low, high], [low, high), (low, high))."""
    return Rule(low=low, high=high, low_open=low_open, high_open=high_open, why=why)


def one_of(choices: tuple[Any, ...], why: str = "") -> Rule:
    return Rule(choices=tuple(choices), why=why)


def finite(why: str = "") -> Rule:
    """Any number but NaN and infinity."""
    return Rule(why=why)


def check(config: Any) -> None:
    """Refuse the first field of ``config`` outside its class's ``RULES``, naming it ``SECTION.field``."""
    cls = type(config)
    for name, rule in getattr(cls, "RULES", {}).items():
        value = getattr(config, name)
        if not rule.allows(value):
            why = f" {rule.why}" if rule.why else ""
            raise ValueError(f"{cls.SECTION}.{name} must be {rule.wants(value)}{why}, got {value!r}")


def _shown(bound: float | None) -> str:
    return str(int(bound)) if isinstance(bound, float) and bound.is_integer() else str(bound)
