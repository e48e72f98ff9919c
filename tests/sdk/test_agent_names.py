"""Agent names must not depend on the user's tracing settings: an OpenAI Agents SDK program (a triage agent handing
off to a math agent) names its LLM calls ``triage`` then ``math`` with the SDK's tracing on or off (users turn it
off to silence "OPENAI_API_KEY is not set, skipping trace export"): globally with ``set_tracing_disabled``, by the
``OPENAI_AGENTS_DISABLE_TRACING`` environment variable, or for one run with ``RunConfig(tracing_disabled=True)``;
in plain, sync and streamed runs. Before, with tracing off every call was named after the rollout, and selective
training of ``math`` silently trained nothing.

(LangChain/LangGraph and AutoGen names do not depend on their tracing settings: lit reads the runnable config, and
openinference's AutoGen agent spans are on lit's own tracer provider.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest
from ack_server import AckServer
from fake_llm import FakeLLM

import lit_sdk as lit
from lit_sdk import semconv as sc
from lit_sdk.protocol import SpanRecord
from lit_trainer.intake.episodes import Episode, build_episode

SETTINGS = ["on", "set_tracing_disabled", "env", "run_config"]


@pytest.fixture(autouse=True)
def sdk_tracing_restored():
    """Leave the SDK's tracing switch as found: ``set_tracing_disabled(False)`` would not, as it overrides the
    environment variable for good."""
    from agents.tracing import get_trace_provider

    provider = get_trace_provider()
    saved = {key: getattr(provider, key) for key in ("_env_disabled", "_manual_disabled", "_disabled")}
    yield
    for key, value in saved.items():
        setattr(provider, key, value)


def switch_tracing(setting: str, monkeypatch) -> Any:
    """Apply one tracing setting; the run config to pass (None but for ``run_config``)."""
    import agents
    from agents.tracing import get_trace_provider

    agents.set_tracing_disabled(setting == "set_tracing_disabled")
    if setting == "env":
        monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
        provider = get_trace_provider()  # as in a process started with it: the SDK reads it once, at first use
        provider._env_disabled = provider._manual_disabled = None
    return agents.RunConfig(tracing_disabled=True) if setting == "run_config" else None


def streaming_model_class() -> type:
    from agents import OpenAIChatCompletionsModel
    from openai.types.responses import Response, ResponseCompletedEvent

    class StreamedFromOneCall(OpenAIChatCompletionsModel):
        """Streams a run's events from one non-streamed engine call (lit records token ids only for those)."""

        async def stream_response(self, *args: Any, **kwargs: Any):
            result = await self.get_response(*args, **kwargs)
            response = Response(id="resp", created_at=0, model="policy", object="response", output=result.output,
                                parallel_tool_calls=False, tool_choice="auto", tools=[])
            yield ResponseCompletedEvent(type="response.completed", response=response, sequence_number=0)

    return StreamedFromOneCall


def rollout(runner: str, agent: Any, run_config: Any, answer: str) -> Callable[[str], float]:
    """The rollout function that runs ``agent`` with ``Runner.<runner>``, traced by lit as agent ``helpdesk``; its
    reward is 1 for ``answer``."""
    from agents import Runner

    if runner == "run_sync":

        @lit.trace(agent="helpdesk")
        def solve_sync(question: str) -> float:
            return float(Runner.run_sync(agent, question, run_config=run_config).final_output == answer)

        return solve_sync

    @lit.trace(agent="helpdesk")
    async def solve(question: str) -> float:
        if runner == "run":
            output = (await Runner.run(agent, question, run_config=run_config)).final_output
        else:
            result = Runner.run_streamed(agent, question, run_config=run_config)
            async for _ in result.stream_events():
                pass
            output = result.final_output
        return float(output == answer)

    return lambda question: asyncio.run(solve(question))


def delivered(server: AckServer) -> list[dict]:
    counts = lit.flush(timeout=10)
    assert counts is not None and counts.pending == 0 and counts.dropped == 0, counts
    return server.spans()


def call_agents(spans: list[dict]) -> list[str]:
    calls = sorted((s for s in spans if s["name"] == sc.LLM_SPAN), key=lambda s: s["start_ns"])
    return [s["attributes"][sc.AGENT_NAME] for s in calls]


@pytest.mark.parametrize("runner", ["run", "run_sync", "run_streamed"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_handoff_calls_are_named_after_their_agents(tmp_path, monkeypatch, setting, runner):
    from agents import Agent, OpenAIChatCompletionsModel
    from openai import AsyncOpenAI

    run_config = switch_tracing(setting, monkeypatch)
    model_class = streaming_model_class() if runner == "run_streamed" else OpenAIChatCompletionsModel
    with FakeLLM(script=[("transfer_to_math", {}), "5"]) as llm, AckServer() as server:
        lit.instrument(endpoint=server.endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path / "spool")
        try:
            model = model_class(model="policy", openai_client=AsyncOpenAI(base_url=llm.base_url, api_key="unused"))
            math = Agent(name="math", instructions="Solve it.", model=model)
            triage = Agent(name="triage", instructions="Hand math to the math agent.", handoffs=[math], model=model)
            assert rollout(runner, triage, run_config, "5")("2+3?") == 1.0
            spans = delivered(server)
        finally:
            lit.uninstrument()
    sdk_spans = {s["name"] for s in spans} & {"triage", "math", "generation"}
    assert bool(sdk_spans) == (setting == "on"), "the setting took effect: the SDK made real spans only when on"
    assert call_agents(spans) == ["triage", "math"]
    episode = build_episode([SpanRecord(**s) for s in spans], agents={"math"})
    assert isinstance(episode, Episode) and [t.agent for t in episode.transitions] == ["math"]


@pytest.mark.parametrize("where", ["after_the_run", "in_a_custom_span", "in_the_runs_trace"])
@pytest.mark.parametrize("setting", ["on", "set_tracing_disabled"])
def test_a_call_after_the_sdk_run_is_the_rollouts_again(tmp_path, monkeypatch, setting, where):
    """The SDK fetches the model of a run's later turns in the caller's task; its last agent must not stick to a
    later call of the same rollout made outside the SDK (a judge), in an SDK span or trace of the user's or not."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, custom_span, function_tool, trace
    from openai import AsyncOpenAI

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    switch_tracing(setting, monkeypatch)
    with FakeLLM(script=[("add", {"a": 2, "b": 2}), "4", "good"]) as llm, AckServer() as server:
        lit.instrument(endpoint=server.endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path / "spool")
        try:
            client = AsyncOpenAI(base_url=llm.base_url, api_key="unused")
            math = Agent(name="math", instructions="Solve it.", tools=[function_tool(add)],
                         model=OpenAIChatCompletionsModel(model="policy", openai_client=client))

            async def run_and_judge(question: str) -> None:
                assert (await Runner.run(math, question)).final_output == "4"
                with custom_span("judge") if where == "in_a_custom_span" else contextlib.nullcontext():
                    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "ok?"}])

            @lit.trace(agent="helpdesk")
            async def solve(question: str) -> float:
                with trace("workflow") if where == "in_the_runs_trace" else contextlib.nullcontext():
                    await run_and_judge(question)
                return 1.0

            asyncio.run(solve("2+2?"))
            assert call_agents(delivered(server)) == ["math", "math", "helpdesk"]
        finally:
            lit.uninstrument()


def test_a_failing_sdk_lookup_falls_back_to_the_rollout(tmp_path, monkeypatch):
    """Naming never breaks the user's call: with the SDK's accessor failing, the calls go through, named after the
    rollout."""
    import agents.tracing
    from agents import Agent, OpenAIChatCompletionsModel
    from openai import AsyncOpenAI

    def broken() -> None:
        raise RuntimeError("an SDK that changed")

    switch_tracing("set_tracing_disabled", monkeypatch)
    monkeypatch.setattr(agents.tracing, "get_current_span", broken)
    with FakeLLM(script=[("transfer_to_math", {}), "5"]) as llm, AckServer() as server:
        lit.instrument(endpoint=server.endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path / "spool")
        try:
            model = OpenAIChatCompletionsModel(model="policy",
                                               openai_client=AsyncOpenAI(base_url=llm.base_url, api_key="unused"))
            math = Agent(name="math", instructions="Solve it.", model=model)
            triage = Agent(name="triage", instructions="Hand math to the math agent.", handoffs=[math], model=model)
            assert rollout("run", triage, None, "5")("2+3?") == 1.0
            assert call_agents(delivered(server)) == ["helpdesk", "helpdesk"]
        finally:
            lit.uninstrument()


def test_uninstrument_restores_the_sdk_run_loop(tmp_path):
    from agents.run_internal import run_loop

    before = run_loop.get_model
    lit.instrument(endpoint="tcp://127.0.0.1:9", frameworks=["openai_agents"], spool_dir=tmp_path)
    try:
        assert run_loop.get_model is not before and run_loop.get_model.__wrapped__ is before
        lit.instrument(endpoint="tcp://127.0.0.1:10", frameworks=["openai_agents"], spool_dir=tmp_path)
        assert run_loop.get_model.__wrapped__ is before, "reconfiguring adds no second wrapper"
    finally:
        lit.uninstrument()
    assert run_loop.get_model is before
