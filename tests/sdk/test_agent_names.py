"""Agent names must not depend on the user's tracing settings: an OpenAI Agents SDK program (a triage agent handing
off to a math agent) names its LLM calls ``triage`` then ``math`` with the SDK's tracing on, off globally
(``set_tracing_disabled``, which users call to silence "OPENAI_API_KEY is not set, skipping trace export"), or off
for one run (``RunConfig(tracing_disabled=True)``). Before, with tracing off every call
was named after the rollout, and selective training of ``math`` silently trained nothing."""

from __future__ import annotations

import asyncio

import pytest
from ack_server import AckServer
from fake_llm import FakeLLM

import lit_sdk as lit
from lit_sdk import semconv as sc
from lit_sdk.protocol import SpanRecord
from lit_trainer.intake.episodes import Episode, build_episode


@pytest.fixture
def sdk_tracing_off():
    import agents

    agents.set_tracing_disabled(True)
    yield
    agents.set_tracing_disabled(False)


def run_triage(tmp_path, run_config=None) -> list[dict]:
    """The triage → math program once under lit; the delivered spans."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner
    from openai import AsyncOpenAI

    with FakeLLM(script=[("transfer_to_math", {}), "5"]) as llm, AckServer() as server:
        lit.instrument(endpoint=server.endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path / "spool")
        try:
            model = OpenAIChatCompletionsModel(
                model="policy", openai_client=AsyncOpenAI(base_url=llm.base_url, api_key="unused"))
            math = Agent(name="math", instructions="Solve it.", model=model)
            triage = Agent(name="triage", instructions="Hand math to the math agent.", handoffs=[math], model=model)

            @lit.trace(agent="helpdesk")
            async def solve(question: str) -> float:
                result = await Runner.run(triage, question, run_config=run_config)
                assert result.final_output == "5"
                return 1.0

            assert asyncio.run(solve("2+3?")) == 1.0
            counts = lit.flush(timeout=10)
            assert counts is not None and counts.pending == 0 and counts.dropped == 0, counts
            return server.spans()
        finally:
            lit.uninstrument()


def check_names(spans: list[dict]) -> None:
    calls = sorted((s for s in spans if s["name"] == sc.LLM_SPAN), key=lambda s: s["start_ns"])
    assert [s["attributes"][sc.AGENT_NAME] for s in calls] == ["triage", "math"]
    episode = build_episode([SpanRecord(**s) for s in spans], agents={"math"})
    assert isinstance(episode, Episode) and [t.agent for t in episode.transitions] == ["math"]


def test_names_with_sdk_tracing_on(tmp_path):
    check_names(run_triage(tmp_path))


def test_names_with_sdk_tracing_disabled_globally(tmp_path, sdk_tracing_off):
    check_names(run_triage(tmp_path))


def test_names_with_sdk_tracing_disabled_for_one_run(tmp_path):
    from agents import RunConfig

    check_names(run_triage(tmp_path, run_config=RunConfig(tracing_disabled=True)))


def test_a_call_after_the_sdk_run_is_the_rollouts_again(tmp_path, sdk_tracing_off):
    """The SDK agent of the last run does not stick to later calls of the same rollout made outside the SDK."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner
    from openai import AsyncOpenAI

    with FakeLLM(script=["4", "done"]) as llm, AckServer() as server:
        lit.instrument(endpoint=server.endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path / "spool")
        try:
            client = AsyncOpenAI(base_url=llm.base_url, api_key="unused")
            math = Agent(name="math", instructions="Solve it.",
                         model=OpenAIChatCompletionsModel(model="policy", openai_client=client))

            @lit.trace(agent="helpdesk")
            async def solve(question: str) -> float:
                await Runner.run(math, question)
                await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "ok?"}])
                return 1.0

            asyncio.run(solve("2+2?"))
            lit.flush(timeout=10)
            calls = sorted((s for s in server.spans() if s["name"] == sc.LLM_SPAN), key=lambda s: s["start_ns"])
            assert [s["attributes"][sc.AGENT_NAME] for s in calls] == ["math", "helpdesk"]
        finally:
            lit.uninstrument()
