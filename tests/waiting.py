"""Waiting in tests without sleeping and then asserting: poll a condition until a deadline (a loaded 2-core machine
may take its time; a condition that never holds fails with what was awaited)."""

from __future__ import annotations

import time
from collections.abc import Callable

DEADLINE_S = 30.0


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = DEADLINE_S, poll_s: float = 0.02):
    """``condition()``'s first true value, polled every ``poll_s``; AssertionError naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(poll_s)
