"""lit beside the user's own tracing: a framework the user instrumented for their backend stays theirs (both get the
spans of lit's rollouts, lit's ``uninstrument()`` leaves it on, lit takes nothing else), with real LangChain and
OpenAI Agents SDK agents against the local engine."""

from __future__ import annotations

import asyncio
import importlib
from dataclasses import dataclass

import pytest
from ack_server import AckServer
from fake_llm import FakeLLM
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import lit_sdk as lit
from lit_sdk import semconv as sc

LIT_OWN = (sc.LLM_SPAN, sc.ROLLOUT_SPAN, sc.REWARD_SPAN)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@dataclass
class Theirs:
    """The user's own tracing: their provider, with an in-memory exporter standing in for their backend."""

    provider: TracerProvider
    exporter: InMemorySpanExporter

    def spans(self) -> dict[str, str]:
        """The spans their backend got, name by span id."""
        return {format(s.context.span_id, "016x"): s.name for s in self.exporter.get_finished_spans()}


def users_tracing(instrumentor_class: type):
    """Set up the user's tracing before lit: a provider of theirs, a framework instrumented onto it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = instrumentor_class()
    instrumentor.instrument(tracer_provider=provider)
    try:
        yield Theirs(provider, exporter)
    finally:
        instrumentor.uninstrument()


@pytest.fixture
def users_langchain_tracing():
    from openinference.instrumentation.langchain import LangChainInstrumentor

    yield from users_tracing(LangChainInstrumentor)


@pytest.fixture
def users_agents_sdk_tracing():
    from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor

    yield from users_tracing(OpenAIAgentsInstrumentor)


def failing_on(span_name: str, hook):
    def hook_that_fails(span, *args, **kwargs):
        if span.name == span_name:
            raise RuntimeError("lit fails")
        return hook(span, *args, **kwargs)

    return hook_that_fails


def framework_spans(lits: list[dict]) -> dict[str, str]:
    return {s["span_id"]: s["name"] for s in lits if s["name"] not in LIT_OWN}


def test_a_langchain_agent_the_user_instrumented_reaches_both_and_stays_theirs(users_langchain_tracing, tmp_path):
    from langchain.agents import create_agent
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from openinference.instrumentation.langchain import LangChainInstrumentor

    theirs = users_langchain_tracing
    with FakeLLM(tool_args={"a": 2, "b": 3}) as llm, AckServer() as server:
        agent = create_agent(ChatOpenAI(base_url=llm.base_url, api_key="unused", model="policy"), tools=[tool(add)],
                             name="calc")
        lit.instrument(endpoint=server.endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path / "spool")
        try:
            @lit.trace
            def solve(question: str) -> float:
                agent.invoke({"messages": [{"role": "user", "content": question}]})
                return 1.0

            assert solve("2+3?") == 1.0
            in_rollout = theirs.spans()
            agent.invoke({"messages": [{"role": "user", "content": "2+3?"}]})  # the user's own run, not a rollout
            counts = lit.flush(timeout=10)
            assert counts is not None and counts.pending == 0
        finally:
            lit.uninstrument()
        lits = server.spans()
        assert {"calc", "model", "tools", "add", "ChatOpenAI"} <= set(in_rollout.values())
        assert len(theirs.spans()) == 2 * len(in_rollout)  # their backend got both runs
        # Every LangChain span of the rollout reached lit as well (same span ids), and none of the other run.
        assert framework_spans(lits) == in_rollout
        calls = [s for s in lits if s["name"] == sc.LLM_SPAN]
        assert len(calls) == 2 and {c["attributes"][sc.AGENT_NAME] for c in calls} == {"calc"}  # named through them
        assert len({s["rollout_id"] for s in lits}) == 1 and None not in {s["rollout_id"] for s in lits}

        # After lit: the user's instrumentation is still on and still theirs alone.
        assert LangChainInstrumentor().is_instrumented_by_opentelemetry
        theirs.exporter.clear()
        agent.invoke({"messages": [{"role": "user", "content": "2+3?"}]})
        assert {"calc", "ChatOpenAI"} <= set(theirs.spans().values())
        assert len(server.spans()) == len(lits)  # nothing more reached lit


def test_an_agents_sdk_agent_the_user_instrumented_reaches_both_and_stays_theirs(users_agents_sdk_tracing, tmp_path):
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool
    from openai import AsyncOpenAI
    from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor

    theirs = users_agents_sdk_tracing
    with FakeLLM(tool_args={"a": 2, "b": 3}) as llm, AckServer() as server:
        model = OpenAIChatCompletionsModel(model="policy",
                                           openai_client=AsyncOpenAI(base_url=llm.base_url, api_key="unused"))
        agent = Agent(name="calculator", instructions="Use the tool.", tools=[function_tool(add)], model=model)
        lit.instrument(endpoint=server.endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path / "spool")
        try:
            @lit.trace
            async def solve(question: str) -> float:
                await Runner.run(agent, question)
                return 1.0

            assert asyncio.run(solve("2+3?")) == 1.0
            counts = lit.flush(timeout=10)
            assert counts is not None and counts.pending == 0
        finally:
            lit.uninstrument()
        lits = server.spans()
        users = theirs.spans()
        assert {"calculator", "turn", "generation", "add"} <= set(users.values())
        assert framework_spans(lits) == users
        calls = [s for s in lits if s["name"] == sc.LLM_SPAN]
        assert len(calls) == 2 and {c["attributes"][sc.AGENT_NAME] for c in calls} == {"calculator"}
        assert len({s["rollout_id"] for s in lits}) == 1 and len({s["trace_id"] for s in lits}) == 1

        assert OpenAIAgentsInstrumentor().is_instrumented_by_opentelemetry
        theirs.exporter.clear()
        asyncio.run(Runner.run(agent, "2+3?"))
        assert {"calculator", "generation"} <= set(theirs.spans().values())
        assert len(server.spans()) == len(lits)


def test_lit_turns_off_only_what_it_turned_on(tmp_path):
    from openinference.instrumentation.autogen_agentchat import AutogenAgentChatInstrumentor
    from openinference.instrumentation.langchain import LangChainInstrumentor

    user = AutogenAgentChatInstrumentor()
    user.instrument(tracer_provider=TracerProvider())
    try:
        with AckServer() as server:
            on = lit.instrument(endpoint=server.endpoint, frameworks=["langchain", "autogen"],
                                spool_dir=tmp_path / "spool")
            assert [type(i).__name__ for i in on.instrumentors] == ["LangChainInstrumentor"]
            assert len(on.bridges) == 1  # it listens in on the user's AutoGen provider instead
            lit.uninstrument()
        assert user.is_instrumented_by_opentelemetry and not LangChainInstrumentor().is_instrumented_by_opentelemetry
        assert not on.bridges
    finally:
        user.uninstrument()


def test_instrument_and_uninstrument_again_leave_one_bridge_on_the_users_provider(users_langchain_tracing, tmp_path):
    """A provider's span processors cannot be taken out: lit's bridge stays, quiet, and the next lit reuses it."""
    processors = users_langchain_tracing.provider._active_span_processor
    before = len(processors._span_processors)
    with AckServer() as server:
        for _ in range(3):
            lit.instrument(endpoint=server.endpoint, spool_dir=tmp_path / "spool")
            lit.uninstrument()
    assert len(processors._span_processors) == before + 1


def test_a_failure_of_lit_never_reaches_the_users_spans(users_langchain_tracing, tmp_path, monkeypatch):
    """The user's provider calls its span processors on the user's thread and lets their exceptions through:
    the bridge must not."""
    theirs = users_langchain_tracing
    tracer = theirs.provider.get_tracer("the user's")
    with AckServer() as server:
        on = lit.instrument(endpoint=server.endpoint, spool_dir=tmp_path / "spool")
        try:
            for hook in ("on_start", "on_end"):  # lit fails on the user's span, and only there
                monkeypatch.setattr(on.processor, hook, failing_on("their own step", getattr(on.processor, hook)))

            @lit.trace
            def solve(question: str) -> float:
                with tracer.start_as_current_span("their own step"):
                    return 1.0

            assert solve("2+3?") == 1.0
            counts = lit.flush(timeout=10)
            assert counts is not None and counts.pending == 0
        finally:
            lit.uninstrument()
        assert [s["name"] for s in server.spans()] == [sc.ROLLOUT_SPAN]
    assert list(theirs.spans().values()) == ["their own step"]


@pytest.mark.parametrize("name", ["langchain", "autogen", "openai_agents", "openai"])
def test_the_bridge_finds_the_provider_of_each_instrumentor_lit_knows(name):
    """Each openinference instrumentor keeps its tracer in its own place; each leads to its provider's
    processors."""
    import openai

    from lit_sdk.instrument import _INSTRUMENTORS, _span_processors_of

    own_request = {cls: "request" in vars(cls) for cls in (openai.OpenAI, openai.AsyncOpenAI)}
    module_name, class_name = _INSTRUMENTORS[name][1].split(":")
    provider = TracerProvider()
    instrumentor = getattr(importlib.import_module(module_name), class_name)()
    instrumentor.instrument(tracer_provider=provider, **_INSTRUMENTORS[name][2])
    try:
        assert _span_processors_of(name, instrumentor) is provider._active_span_processor
    finally:
        instrumentor.uninstrument()
        for cls, had in own_request.items():  # openinference's openai uninstrument leaves the inherited
            if not had and "request" in vars(cls):  # `request` set on the subclass, which would hide later
                delattr(cls, "request")  # patches of the base client's (tests/sdk/test_fault_injection.py)
