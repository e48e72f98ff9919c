"""The SDK's process-wide state: the live instrumentation once ``lit.instrument()`` ran, None before it and after
``lit.uninstrument()``. ``instrument`` writes it; ``@lit.trace`` and ``lit.reward`` read it.
"""

from __future__ import annotations

from typing import Protocol

from opentelemetry.trace import Tracer


class Live(Protocol):
    """What the readers of the state use of the live instrumentation (``instrument.Instrumentation`` is one)."""

    @property
    def tracer(self) -> Tracer:
        """The tracer of lit's own TracerProvider: rollout, agent and reward spans start here."""
        ...


_active: Live | None = None


def active() -> Live | None:
    """The live instrumentation, or None before ``lit.instrument()`` / after ``lit.uninstrument()``."""
    return _active


def set_active(instrumentation: Live | None) -> None:
    global _active
    _active = instrumentation
