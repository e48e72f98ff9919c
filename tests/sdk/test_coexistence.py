"""lit beside the user's own tracing: a framework the user instrumented for their backend stays theirs (both get the
spans, lit's ``uninstrument()`` leaves it on), with a real LangChain agent against the local engine."""

from __future__ import annotations

import pytest
from ack_server import AckServer
from fake_llm import FakeLLM
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import lit_sdk as lit
from lit_sdk import semconv as sc
from lit_sdk.instrument import _span_processors_of


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture
def users_langchain_tracing():
    """The user's own tracing, set up before lit: a provider of theirs, LangChain instrumented onto it."""
    from openinference.instrumentation.langchain import LangChainInstrumentor

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = LangChainInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        yield exporter
    finally:
        instrumentor.uninstrument()


def test_a_framework_the_user_instrumented_reaches_both_and_stays_on_after_lit(users_langchain_tracing, tmp_path):
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
            counts = lit.flush(timeout=10)
            assert counts is not None and counts.pending == 0
        finally:
            lit.uninstrument()
        lits = server.spans()
        users = {format(s.context.span_id, "016x"): s.name for s in theirs.get_finished_spans()}
        assert {"calc", "model", "tools", "add", "ChatOpenAI"} <= set(users.values())
        # Every LangChain span reached lit as well (same span ids), inside the rollout; lit's own spans too.
        langchain_in_lit = {s["span_id"]: s["name"] for s in lits if s["name"] not in (sc.LLM_SPAN, sc.ROLLOUT_SPAN)}
        assert langchain_in_lit == users
        calls = [s for s in lits if s["name"] == sc.LLM_SPAN]
        assert len(calls) == 2 and {c["attributes"][sc.AGENT_NAME] for c in calls} == {"calc"}  # named through them
        assert len({s["rollout_id"] for s in lits}) == 1

        # After lit: the user's instrumentation is still on and still theirs alone.
        assert LangChainInstrumentor().is_instrumented_by_opentelemetry
        theirs.clear()
        agent.invoke({"messages": [{"role": "user", "content": "2+3?"}]})
        assert {"calc", "ChatOpenAI"} <= {s.name for s in theirs.get_finished_spans()}
        assert len(server.spans()) == len(lits)  # nothing more reached lit


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


def test_the_bridge_finds_the_provider_of_each_instrumentor_lit_knows(tmp_path):
    """LangChain's and AutoGen's instrumentors keep their tracer differently; both lead to the provider's
    processors."""
    from openinference.instrumentation.autogen_agentchat import AutogenAgentChatInstrumentor
    from openinference.instrumentation.langchain import LangChainInstrumentor

    for cls in (LangChainInstrumentor, AutogenAgentChatInstrumentor):
        provider = TracerProvider()
        instrumentor = cls()
        instrumentor.instrument(tracer_provider=provider)
        try:
            assert _span_processors_of(instrumentor) is provider._active_span_processor, cls
        finally:
            instrumentor.uninstrument()
