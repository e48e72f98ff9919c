"""Span helpers shared by ``@lit.trace`` and the openai instrumentor: how a failure and a JSON value are recorded."""

from __future__ import annotations

import json
from typing import Any

from opentelemetry import trace as otel_trace

MAX_JSON_CHARS = 16_384
"""Input and output are recorded as JSON up to this many characters (then cut, with a marker)."""


def mark_failed(span: Any, exc: BaseException) -> None:
    """Record the user's exception on a span and give the span error status (the exception itself is re-raised
    by the caller, unchanged)."""
    span.record_exception(exc)
    span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def to_json(value: Any) -> str:
    try:
        text = json.dumps(value, default=repr, ensure_ascii=False)
    except Exception:  # circular structures and the like
        text = json.dumps(repr(value))
    if len(text) > MAX_JSON_CHARS:
        text = text[:MAX_JSON_CHARS] + "...[cut]"
    return text
