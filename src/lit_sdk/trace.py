"""``@lit.trace`` marks an agent function as one rollout; ``lit.reward`` attaches rewards inside it.

The decorated function runs exactly as before: its return value and exceptions pass through unchanged (the same
objects), and a failure of lit's own is logged, never raised. Around it lit opens the rollout's root span (a new
trace, whatever span was current), records the input and output as JSON, and takes a numeric return value as the
rollout's final reward. Nested ``@lit.trace`` functions inside a rollout open a child span that names their agent
instead of a new rollout.

Spans go to whatever tracer ``instrument()`` set up.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import numbers
from collections.abc import Callable
from typing import Any, TypeVar, overload

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace

from lit_sdk import _context, _state, semconv
from lit_sdk._spans import close_span, mark_failed, quietly, to_json

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("lit")
_warned: set[str] = set()


@overload
def trace(fn: F) -> F: ...
@overload
def trace(*, name: str | None = None, agent: str | None = None) -> Callable[[F], F]: ...


def trace(fn: Callable[..., Any] | None = None, *, name: str | None = None, agent: str | None = None) -> Any:
    """Mark ``fn`` (sync or async) as a rollout: ``@lit.trace`` or ``@lit.trace(name=..., agent=...)``."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        span_name = name or fn.__name__
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                scope = _Scope(span_name, agent, args, kwargs)
                try:
                    result = await fn(*args, **kwargs)
                except BaseException as exc:
                    scope.fail(exc)
                    raise
                scope.succeed(result)
                return result

            run_async.__lit_trace__ = span_name  # type: ignore[attr-defined]
            return run_async

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            scope = _Scope(span_name, agent, args, kwargs)
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                scope.fail(exc)
                raise
            scope.succeed(result)
            return result

        run.__lit_trace__ = span_name  # type: ignore[attr-defined]
        return run

    return decorate(fn) if fn is not None else decorate


def is_traced(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is (or wraps, through ``functools.wraps``) a function marked by ``@lit.trace``."""
    seen = 0
    while fn is not None and seen < 100:
        if getattr(fn, "__lit_trace__", None) is not None:
            return True
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return False


def reward(value: float, name: str | None = None) -> None:
    """Give a reward at this point of the rollout (intermediate or final; several named rewards are fine).

    ``value`` must be a finite real number: anything else raises TypeError/ValueError, since a reward that is
    silently lost would train the wrong thing. Outside a rollout (or before ``lit.instrument()``) it is ignored
    with a warning. A failure of lit's own while recording a valid reward is logged, never raised.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"lit.reward() takes a real number, got {type(value).__name__}")
    if not math.isfinite(float(value)):
        raise ValueError(f"lit.reward() takes a finite number, got {value}")
    with quietly("record a reward"):
        state = _state.active()
        if state is None or _context.current_rollout() is None:
            _warn_once("reward", "lit.reward() called outside a @lit.trace rollout or before lit.instrument(): ignored")
            return
        attrs = {semconv.REWARD_VALUE: float(value), semconv.REWARD_NAME: name or ""}
        state.tracer.start_span(semconv.REWARD_SPAN, attributes=attrs).end()


class _Scope:
    """One traced call: its span and the context tokens that put back what was current before it. Each of lit's
    steps runs ``quietly``: when opening fails part-way, what was opened is undone and the call runs unrecorded."""

    __slots__ = ("span", "is_root", "rollout_token", "otel_token")

    def __init__(self, span_name: str, agent: str | None, args: tuple, kwargs: dict):
        self.span: Any = None
        self.is_root = False
        self.rollout_token: Any = None
        self.otel_token: Any = None
        with quietly("open the rollout span") as opening:
            self._open(span_name, agent, args, kwargs)
        if opening.failed:
            self._close()

    def _open(self, span_name: str, agent: str | None, args: tuple, kwargs: dict) -> None:
        state = _state.active()
        if state is None:
            _warn_once("trace", "a @lit.trace function ran before lit.instrument(): the rollout is not recorded")
            return
        self.is_root = _context.current_rollout() is None
        if self.is_root:
            _, self.rollout_token = _context.begin_rollout(agent or span_name)
            attrs = {
                semconv.ROLLOUT_NAME: span_name,
                semconv.ROLLOUT_INPUT: to_json({"args": args, "kwargs": kwargs}),
            }
            # An empty context makes the rollout a new trace even when the caller is inside a span.
            self.span = state.tracer.start_span(semconv.ROLLOUT_SPAN, context=otel_context.Context(), attributes=attrs)
        else:
            self.rollout_token = _context.enter_agent(agent) if agent else None
            attrs = {semconv.AGENT_NAME: agent} if agent else {}
            self.span = state.tracer.start_span(span_name, attributes=attrs)
        self.otel_token = otel_context.attach(otel_trace.set_span_in_context(self.span))

    def succeed(self, result: Any) -> None:
        if self.span is None:
            return
        with quietly("record the rollout's output"):
            if self.is_root:
                self.span.set_attribute(semconv.ROLLOUT_OUTPUT, to_json(result))
                if isinstance(result, numbers.Real) and not isinstance(result, bool) and math.isfinite(result):
                    self.span.set_attribute(semconv.ROLLOUT_RETURN_REWARD, float(result))
            self.span.set_status(otel_trace.Status(otel_trace.StatusCode.OK))
        self._close()

    def fail(self, exc: BaseException) -> None:
        if self.span is None:
            return
        with quietly("record the rollout's exception"):
            mark_failed(self.span, exc)
        self._close()

    def _close(self) -> None:
        """Put back the rollout and span that were current before this call, then end the span."""
        if self.rollout_token is not None:
            with quietly("restore the current rollout"):
                _context.leave(self.rollout_token)
        close_span(self.span, self.otel_token)
        self.span = self.rollout_token = self.otel_token = None


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)
