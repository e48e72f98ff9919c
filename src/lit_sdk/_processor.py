"""The OpenTelemetry span processor that turns finished spans into wire records for the sender.

It maps each trace to its rollout (set when the rollout's root span starts), keeps the live spans so that an LLM
call can find the agent it runs in, and converts a finished span into a ``SpanRecord`` wire dict for the sender.
It counts the spans of each rollout as they end, and stamps the count on the rollout's root span
(``semconv.ROLLOUT_SPANS``), so that the trainer can tell a complete rollout from one that lost a span.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.trace import StatusCode

from lit_sdk import _context, semconv
from lit_sdk.protocol.spans import STATUS_ERROR, STATUS_OK, STATUS_UNSET, SpanRecord

log = logging.getLogger("lit")
_STATUS = {StatusCode.UNSET: STATUS_UNSET, StatusCode.OK: STATUS_OK, StatusCode.ERROR: STATUS_ERROR}
MAX_TRACES = 10_000
"""Traces remembered after their root ended, for spans that end late (background tasks)."""


class LitSpanProcessor(SpanProcessor):
    def __init__(self, submit: Callable[[dict[str, Any]], None]):
        self._submit = submit
        self._lock = threading.Lock()
        self._trace_rollout: OrderedDict[int, _context.Rollout] = OrderedDict()
        self._live: dict[int, Span] = {}
        self._bulk: dict[int, dict[str, Any]] = {}
        self._ended: OrderedDict[str, int] = OrderedDict()  # spans ended so far, by rollout id

    def attach_bulk(self, span: Span, attributes: dict[str, Any]) -> None:
        """Add large list attributes (token ids, logprobs) to ``span``'s wire record, bypassing OpenTelemetry's
        per-element attribute validation: lit made these lists itself, and validating thousands of token ids per
        call is most of lit's own cost per LLM call. Other span processors do not see them."""
        with self._lock:
            self._bulk[span.get_span_context().span_id] = attributes

    def in_rollout(self, span: ReadableSpan) -> bool:
        """Whether ``span``'s trace belongs to a rollout: a span of it started while the rollout was current."""
        with self._lock:
            return span.get_span_context().trace_id in self._trace_rollout

    def on_start(self, span: Span, parent_context: Any = None) -> None:
        ctx = span.get_span_context()
        rollout = _context.current_rollout()
        with self._lock:
            self._live[ctx.span_id] = span
            if rollout is not None and ctx.trace_id not in self._trace_rollout:
                self._trace_rollout[ctx.trace_id] = rollout
                if len(self._trace_rollout) > MAX_TRACES:
                    self._trace_rollout.popitem(last=False)

    def on_end(self, span: ReadableSpan) -> None:
        ctx = span.get_span_context()
        with self._lock:
            self._live.pop(ctx.span_id, None)
            rollout = self._trace_rollout.get(ctx.trace_id)
            bulk = self._bulk.pop(ctx.span_id, None)
            ended = self._count_ended(span, rollout)
        try:
            record = to_wire(span, rollout)
            if bulk:
                record["attributes"].update(bulk)
            if ended is not None:
                record["attributes"][semconv.ROLLOUT_SPANS] = ended
            self._submit(record)
        except Exception:  # telemetry never breaks the user's call
            log.exception("lit: could not export a span")

    def _count_ended(self, span: ReadableSpan, rollout: _context.Rollout | None) -> int | None:
        """Count one more ended span of ``rollout`` (before converting it: a span lit fails to convert still
        counts, and its loss shows); the count when ``span`` is the rollout's root, else None. Call with the lock."""
        if rollout is None:
            return None
        rid = rollout.rollout_id
        n = self._ended.pop(rid, 0) + 1
        if span.parent is None and span.name == semconv.ROLLOUT_SPAN:
            return n
        self._ended[rid] = n
        if len(self._ended) > MAX_TRACES:  # spans that end after their root: remembered a while, then forgotten
            self._ended.popitem(last=False)
        return None

    def ancestors(self, span: Any) -> Iterator[Span]:
        """The live spans from ``span`` up to its root, innermost first (those that already ended are skipped)."""
        seen = 0
        current: Any = span
        while current is not None and seen < 256:
            yield current
            parent = getattr(current, "parent", None)
            if parent is None:
                return
            with self._lock:
                current = self._live.get(parent.span_id)
            seen += 1

    def shutdown(self) -> None:
        with self._lock:
            self._live.clear()
            self._bulk.clear()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def to_wire(span: ReadableSpan, rollout: _context.Rollout | None) -> dict[str, Any]:
    ctx = span.get_span_context()
    attrs = dict(span.attributes or {})
    for key, value in attrs.items():
        if isinstance(value, tuple):  # OpenTelemetry stores sequences as tuples; MessagePack wants lists
            attrs[key] = list(value)
    if rollout is not None:
        attrs[semconv.ROLLOUT_ID] = rollout.rollout_id
        attrs[semconv.TASK_ID] = rollout.task_id
        attrs[semconv.ATTEMPT] = rollout.attempt
        if rollout.secret is not None and span.parent is None and span.name == semconv.ROLLOUT_SPAN:
            attrs[semconv.ROLLOUT_SECRET] = rollout.secret
    status = span.status
    return SpanRecord(
        trace_id=format(ctx.trace_id, "032x"),
        span_id=format(ctx.span_id, "016x"),
        parent_id=format(span.parent.span_id, "016x") if span.parent is not None else None,
        name=span.name,
        start_ns=span.start_time or 0,
        end_ns=span.end_time or 0,
        status=_STATUS.get(status.status_code, STATUS_UNSET),
        status_message=status.description or "",
        rollout_id=rollout.rollout_id if rollout is not None else None,
        attributes=attrs,
        events=[_event(e) for e in span.events],
    ).to_wire()


def _event(event: Any) -> dict[str, Any]:
    attrs = {k: list(v) if isinstance(v, tuple) else v for k, v in (event.attributes or {}).items()}
    return {"name": event.name, "time_ns": event.timestamp, "attributes": attrs}
