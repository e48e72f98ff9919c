"""What ``@lit.trace`` and the openai instrumentor share around the user's call: ``quietly``, which runs one of lit's
own steps without ever raising; how a span is closed; and how a failure and a JSON value are recorded.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace

log = logging.getLogger("lit")

MAX_JSON_CHARS = 16_384
"""Input and output are recorded as JSON up to this many characters (then cut, with a marker)."""


class quietly:
    """Run one of lit's own steps (the ``with`` block) so that it never raises: telemetry never breaks the user's
    call. A failure is logged once, with its traceback, as "lit: could not <what>", and swallowed; ``failed`` says
    whether it happened, so that the caller can undo what the step had done. Only ``Exception`` is swallowed:
    KeyboardInterrupt and the like go on."""

    __slots__ = ("what", "failed")

    def __init__(self, what: str):
        self.what = what
        self.failed = False

    def __enter__(self) -> quietly:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if exc_type is None or not issubclass(exc_type, Exception):
            return False
        self.failed = True
        log.error("lit: could not %s", self.what, exc_info=(exc_type, exc, tb))
        return True


def close_span(span: Any, token: Any) -> None:
    """Make current again the span that was current before ``token`` (from ``otel_context.attach``), then end
    ``span``; either may be None (not opened), and each step runs even when the other fails."""
    if token is not None:
        with quietly("restore the current span"):
            otel_context.detach(token)
    if span is not None:
        with quietly("end a span"):
            span.end()


def mark_failed(span: Any, exc: BaseException) -> None:
    """Record the user's exception on a span and give the span error status (the exception itself is re-raised
    by the caller, unchanged). An exception whose ``str()`` fails is recorded by its type alone."""
    try:
        description = f"{type(exc).__name__}: {exc}"
    except Exception:
        span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, type(exc).__name__))
        return
    span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, description))
    span.record_exception(exc)


def to_json(value: Any) -> str:
    """``value`` as JSON text, cut at ``MAX_JSON_CHARS``: what JSON cannot encode is recorded by its ``repr``, and
    what has no working ``repr`` by its type (with a warning). Never raises."""
    try:
        text = json.dumps(value, default=_repr, ensure_ascii=False)
    except Exception:  # circular structures and the like
        text = json.dumps(_repr(value))
    if len(text) > MAX_JSON_CHARS:
        text = text[:MAX_JSON_CHARS] + "...[cut]"
    return text


def _repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:
        name = type(value).__qualname__
        log.warning("lit: repr() of a %s failed; recorded by its type", name, exc_info=True)
        return f"<{name}: repr() failed>"
