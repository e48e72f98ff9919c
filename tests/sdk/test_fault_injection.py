"""Telemetry never breaks the user's call: each of lit's own steps around it is made to raise in turn.

The calls are ``@lit.trace`` functions (sync and async, root and nested, returning and raising) and lit's patch of
the openai client (chat and text completions, sync and async, answered, failed, and streamed to an engine lit does
not manage) against the real HTTP fake engine. With a step failing, the user's call must behave as without lit:
the same return value and the same exception objects (``is``), the same rollout and OpenTelemetry current span
afterwards as before, and lit's failure logged once. Then the holes the review found, one test each: a return value
whose repr raises, an exception whose str raises, a failed start_span, a failing framework instrumentor; and a
reward whose recording fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import logging
import socket
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from ack_server import AckServer
from fake_llm import FakeLLM
from openai import AsyncOpenAI, OpenAI
from openai._base_client import AsyncAPIClient, SyncAPIClient
from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace import TracerProvider

import lit_sdk as lit
from lit_sdk import _agents, _context, _state
from lit_sdk import openai_instrumentor as openai_module
from lit_sdk import semconv as sc
from lit_sdk._processor import LitSpanProcessor

trace_module = importlib.import_module("lit_sdk.trace")  # ``lit_sdk.trace`` is also the decorator's name
instrument_module = importlib.import_module("lit_sdk.instrument")


class LitFault(Exception):
    """The failure injected into one of lit's own steps."""


class AgentFailed(RuntimeError):
    """The user's own exception."""


# Where each of lit's steps can be made to fail: every attribute that names it at the moment of the call.
POINTS: dict[str, list[tuple[Any, str]]] = {
    "state.active": [(_state, "active")],
    "context.current_rollout": [(_context, "current_rollout")],
    "context.begin_rollout": [(_context, "begin_rollout")],
    "context.enter_agent": [(_context, "enter_agent")],
    "context.leave": [(_context, "leave")],
    "to_json": [(trace_module, "to_json")],
    "mark_failed": [(trace_module, "mark_failed"), (openai_module, "mark_failed")],
    "otel.get_current_span": [(otel_trace, "get_current_span")],
    "otel.set_span_in_context": [(otel_trace, "set_span_in_context")],
    "otel.attach": [(otel_context, "attach")],
    "otel.detach": [(otel_context, "detach")],
    "tracer.start_span": [(sdk_trace.Tracer, "start_span")],
    "span.set_attribute": [(sdk_trace.Span, "set_attribute")],
    "span.set_attributes": [(sdk_trace.Span, "set_attributes")],
    "span.set_status": [(sdk_trace.Span, "set_status")],
    "span.record_exception": [(sdk_trace.Span, "record_exception")],
    "span.end": [(sdk_trace.Span, "end")],
    "processor.on_start": [(LitSpanProcessor, "on_start")],
    "processor.on_end": [(LitSpanProcessor, "on_end")],
    "processor.attach_bulk": [(LitSpanProcessor, "attach_bulk")],
    "openai.is_managed": [(openai_module._Patch, "_is_managed")],
    "openai.with_token_ids": [(openai_module, "_with_token_ids")],
    "openai.resolve_agent": [(_agents, "resolve_agent")],
    "openai.sampling_attributes": [(openai_module, "sampling_attributes")],
    "openai.parsed": [(openai_module, "_parsed")],
    "openai.record_response": [(openai_module, "record_response")],
}
RESTORING = {"context.leave": "rollout", "otel.detach": "span"}
"""The steps that put back the rollout or the current span: when one of them fails, that one cannot be put back
(neither can fail in practice: a token reset in the context that made it); everything else still holds."""

# The steps every recorded call goes through, whichever its outcome.
OPENING_AND_CLOSING = ["state.active", "context.current_rollout", "otel.get_current_span", "otel.set_span_in_context",
                       "otel.attach", "otel.detach", "tracer.start_span", "processor.on_start", "span.set_status",
                       "span.end", "processor.on_end"]


@dataclass(frozen=True)
class TraceCase:
    is_async: bool
    nested: bool
    raises: bool

    @property
    def id(self) -> str:
        return "-".join(["async" if self.is_async else "sync", "nested" if self.nested else "root",
                         "raises" if self.raises else "returns"])

    def points(self) -> list[str]:
        points = [*OPENING_AND_CLOSING, "context.leave"]
        points += ["context.enter_agent"] if self.nested else ["context.begin_rollout", "to_json"]
        if self.raises:
            points += ["mark_failed", "span.record_exception"]
        elif not self.nested:
            points += ["span.set_attribute"]  # the output and the reward
        return points


@dataclass(frozen=True)
class OpenAICase:
    api: str
    """``chat`` or ``completion``."""
    is_async: bool
    outcome: str
    """``answers``; ``fails`` (the managed engine refuses the connection); ``streams`` (a streamed call to an
    engine lit does not manage, which the fake engine answers with HTTP 400)."""

    @property
    def id(self) -> str:
        return f"openai-{self.api}-{'async' if self.is_async else 'sync'}-{self.outcome}"

    def points(self) -> list[str]:
        if self.outcome == "streams":
            return ["context.current_rollout", "openai.is_managed"]
        points = [p for p in OPENING_AND_CLOSING if p != "state.active"]
        points += ["openai.is_managed", "openai.with_token_ids", "openai.resolve_agent", "openai.sampling_attributes"]
        if self.outcome == "answers":
            points += ["openai.parsed", "openai.record_response", "span.set_attributes", "processor.attach_bulk"]
        else:
            points += ["mark_failed", "span.record_exception"]
        return points


TRACE_CASES = [TraceCase(a, n, r) for a in (False, True) for n in (False, True) for r in (False, True)]
OPENAI_CASES = [OpenAICase(api, a, outcome) for api in ("chat", "completion") for a in (False, True)
                for outcome in ("answers", "fails")]
OPENAI_CASES += [OpenAICase("chat", a, "streams") for a in (False, True)]
CASES = [pytest.param(case, point, id=f"{case.id}/{point}")
         for case in [*TRACE_CASES, *OPENAI_CASES] for point in case.points()]


@dataclass
class Engines:
    managed: FakeLLM
    dead: str
    """A managed base URL where nothing listens."""
    other: FakeLLM
    """An engine lit does not manage."""
    settings: dict[str, Any]
    """``lit.instrument()``'s arguments."""


@pytest.fixture(scope="module")
def engines_on(tmp_path_factory) -> Iterator[Engines]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with FakeLLM() as managed, FakeLLM() as other, AckServer() as server:
        settings = {"endpoint": server.endpoint, "frameworks": (), "llm_base_urls": [managed.base_url, dead],
                    "spool_dir": tmp_path_factory.mktemp("spool")}
        try:
            yield Engines(managed, dead, other, settings)
        finally:
            lit.uninstrument()


@pytest.fixture
def engines(engines_on: Engines) -> Engines:
    lit.instrument(**engines_on.settings)  # once per module: the same settings again change nothing
    return engines_on


@dataclass
class Outcome:
    """What the caller of the user's call sees: its result or exception, and the rollout and current span before
    and after it."""

    result: Any = None
    error: BaseException | None = None
    before: tuple[Any, Any] = (None, None)
    after: tuple[Any, Any] = (None, None)
    fired: int = 0


def raising(what: str) -> Callable[..., Any]:
    def fault(*args: Any, **kwargs: Any) -> Any:
        raise LitFault(what)

    return fault


def current() -> tuple[Any, Any]:
    return _context.current_rollout(), otel_trace.get_current_span()


@contextlib.contextmanager
def failing(point: str, outcome: Outcome) -> Iterator[None]:
    """Make lit's step ``point`` raise ``LitFault`` (counted in ``outcome.fired``) inside the block."""

    def fault(*args: Any, **kwargs: Any) -> Any:
        outcome.fired += 1
        raise LitFault(point)

    with pytest.MonkeyPatch.context() as mp:
        for owner, name in POINTS[point]:
            mp.setattr(owner, name, fault)
        yield


def observe(call: Callable[[], Any], point: str) -> Outcome:
    outcome = Outcome(before=current())
    with failing(point, outcome):
        try:
            outcome.result = call()
        except BaseException as exc:  # whatever the caller would see
            outcome.error = exc
    outcome.after = current()
    return outcome


async def observe_async(call: Callable[[], Any], point: str) -> Outcome:
    outcome = Outcome(before=current())
    with failing(point, outcome):
        try:
            outcome.result = await call()
        except BaseException as exc:
            outcome.error = exc
    outcome.after = current()
    return outcome


def in_rollout(case: TraceCase | OpenAICase, call: Callable[[], Any]) -> Outcome:
    """``call`` observed inside a rollout (an outer ``@lit.trace`` function in which nothing fails), sync or async;
    each run in a context of its own, so that nothing it leaves behind reaches the next test."""
    if case.is_async:

        @lit.trace(agent="actor")
        async def episode() -> Outcome:
            return await call()

        return asyncio.run(episode())

    @lit.trace(agent="actor")
    def episode_sync() -> Outcome:
        return call()

    return contextvars.copy_context().run(episode_sync)


def run_trace_case(case: TraceCase, point: str, answer: object, error: AgentFailed) -> Outcome:
    if case.is_async:

        async def user_agent(task: str) -> object:
            await asyncio.sleep(0)
            if case.raises:
                raise error
            return answer

    else:

        def user_agent(task: str) -> object:
            if case.raises:
                raise error
            return answer

    agent = lit.trace(agent="critic")(user_agent) if case.nested else lit.trace(user_agent)
    observer = observe_async if case.is_async else observe

    def run() -> Any:
        return observer(lambda: agent("task"), point)

    if case.nested:
        return in_rollout(case, run)
    # A root rollout called inside a span of the user's own: that span is current again after it.
    user_tracer = TracerProvider().get_tracer("user")

    def in_user_span() -> Outcome:
        with user_tracer.start_as_current_span("user work"):
            return run() if not case.is_async else asyncio.run(run())

    return contextvars.copy_context().run(in_user_span)


def openai_call(case: OpenAICase, engines: Engines) -> Callable[[], Any]:
    base_url = {"answers": engines.managed.base_url, "fails": engines.dead, "streams": engines.other.base_url}
    client = (AsyncOpenAI if case.is_async else OpenAI)(base_url=base_url[case.outcome], api_key="x", max_retries=0)
    if case.api == "completion":
        return lambda: client.completions.create(model="m", prompt="2 + 3?")
    messages = [{"role": "user", "content": "2 + 3?"}]
    return lambda: client.chat.completions.create(model="m", messages=messages, stream=case.outcome == "streams")


@contextlib.contextmanager
def client_outcomes() -> Iterator[list[Any]]:
    """What the openai client's own request returned or raised, call by call: what the user must get back."""
    seen: list[Any] = []
    sync_request, async_request = SyncAPIClient.request, AsyncAPIClient.request

    def request(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            seen.append(sync_request(self, *args, **kwargs))
        except BaseException as exc:
            seen.append(exc)
            raise
        return seen[-1]

    async def arequest(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            seen.append(await async_request(self, *args, **kwargs))
        except BaseException as exc:
            seen.append(exc)
            raise
        return seen[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SyncAPIClient, "request", request)
        mp.setattr(AsyncAPIClient, "request", arequest)
        yield seen


@pytest.mark.parametrize(("case", "point"), CASES)
def test_a_failing_lit_step_leaves_the_users_call_as_it_was(engines, case, point, caplog):
    caplog.set_level(logging.WARNING)
    if isinstance(case, TraceCase):
        answer, error = object(), AgentFailed("the tool blew up")
        outcome = run_trace_case(case, point, answer, error)
        expected = error if case.raises else answer
    else:
        call = openai_call(case, engines)
        with client_outcomes() as seen:
            if case.is_async:
                outcome = in_rollout(case, lambda: observe_async(call, point))
            else:
                outcome = in_rollout(case, lambda: observe(call, point))
        (expected,) = seen
        assert isinstance(expected, BaseException) == (case.outcome != "answers")

    assert outcome.fired, f"{point} is not reached by {case.id}: this case does not test it"
    if isinstance(expected, BaseException):
        assert outcome.error is expected, f"lit's {outcome.error!r} replaced the user's {expected!r}"
        if isinstance(case, TraceCase):  # the traceback still ends where the user raised it
            assert traceback.extract_tb(expected.__traceback__)[-1].name == "user_agent"
            assert expected.__context__ is None and expected.__cause__ is None
    else:
        assert outcome.error is None, f"lit's {outcome.error!r} broke a call that succeeded"
        assert outcome.result is expected
    rollout_before, span_before = outcome.before
    rollout_after, span_after = outcome.after
    if RESTORING.get(point) != "rollout":
        assert rollout_after is rollout_before
    if RESTORING.get(point) != "span":
        assert span_after is span_before
    faults = [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], LitFault)]
    assert len(faults) == 1 and faults[0].name == "lit", [r.getMessage() for r in caplog.records]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == faults


def test_a_failing_lit_step_while_recording_a_valid_reward_is_not_raised(engines, caplog):
    @lit.trace
    def agent() -> str:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sdk_trace.Tracer, "start_span", raising("reward"))
            lit.reward(1.0)
        with pytest.raises(ValueError, match="finite"):  # a bad value is still the user's error
            lit.reward(float("inf"))
        return "done"

    with caplog.at_level(logging.WARNING, logger="lit"):
        assert agent() == "done"
    (record,) = caplog.records
    assert isinstance(record.exc_info[1], LitFault) and "reward" in record.getMessage()


class Unprintable:
    def __repr__(self) -> str:
        return str(1 / 0)


class UnprintableError(RuntimeError):
    def __str__(self) -> str:
        return str(1 / 0)


def test_a_return_value_whose_repr_raises_is_returned_unchanged(tracing, caplog):
    value = Unprintable()

    @lit.trace
    def agent() -> Unprintable:
        return value

    with caplog.at_level(logging.WARNING, logger="lit"):
        assert agent() is value
    (record,) = caplog.records
    assert isinstance(record.exc_info[1], ZeroDivisionError) and "Unprintable" in record.getMessage()
    (root,) = [s for s in tracing.delivered() if s["name"] == sc.ROLLOUT_SPAN]
    assert root["status"] == 1 and root["attributes"][sc.ROLLOUT_OUTPUT] == '"<Unprintable: repr() failed>"'


def test_an_exception_whose_str_raises_is_reraised_unchanged(tracing):
    error = UnprintableError()

    @lit.trace
    def user_agent() -> None:
        raise error

    with pytest.raises(UnprintableError) as info:
        user_agent()
    assert info.value is error and info.value.__context__ is None
    assert traceback.extract_tb(info.value.__traceback__)[-1].name == "user_agent"
    (root,) = [s for s in tracing.delivered() if s["name"] == sc.ROLLOUT_SPAN]
    assert root["status"] == 2 and root["status_message"] == "UnprintableError"


def test_a_failed_start_span_leaves_no_rollout_behind(tracing):
    @lit.trace
    def agent() -> float:
        return 1.0

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sdk_trace.Tracer, "start_span", raising("start_span"))
        assert agent() == 1.0
    assert _context.current_rollout() is None
    assert agent() == 1.0  # the next call is a rollout of its own, not nested in a leftover one
    (root,) = [s for s in tracing.delivered() if s["name"] == sc.ROLLOUT_SPAN]
    assert root["parent_id"] is None and root["attributes"][sc.ROLLOUT_RETURN_REWARD] == 1.0


def test_one_failing_instrumentor_leaves_the_others_on(monkeypatch, tmp_path, caplog):
    from openinference.instrumentation.autogen_agentchat import AutogenAgentChatInstrumentor

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("this autogen is not the one the instrumentor knows")

    monkeypatch.setattr(AutogenAgentChatInstrumentor, "instrument", broken)
    (tmp_path / "lit_broken_instrumentor.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.setitem(instrument_module._INSTRUMENTORS, "langchain",
                        ("langchain_core", "lit_broken_instrumentor:LangChainInstrumentor", {}))
    try:
        with caplog.at_level(logging.WARNING, logger="lit"):
            on = lit.instrument(endpoint="tcp://127.0.0.1:9", frameworks=["langchain", "autogen", "openai_agents"],
                                spool_dir=tmp_path / "spool")
        assert [type(i).__name__ for i in on.instrumentors] == ["OpenAIAgentsInstrumentor"]
        assert on.openai_instrumentor.is_instrumented_by_opentelemetry
        warnings = sorted(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
        assert len(warnings) == 2 and "autogen" in warnings[0] and "langchain" in warnings[1], warnings
    finally:
        lit.uninstrument()
