"""@lit.trace and lit.reward with the plain openai client: exceptions, async, nesting, rewards, streaming."""

from __future__ import annotations

import asyncio
import logging

import pytest
from openai import AsyncOpenAI, OpenAI

import lit_sdk as lit
from lit_sdk import _context
from lit_sdk import semconv as sc


class AgentFailed(RuntimeError):
    pass


def by_name(spans: list[dict], name: str) -> list[dict]:
    return sorted((s for s in spans if s["name"] == name), key=lambda s: s["start_ns"])


def test_exception_is_recorded_and_reraised_unchanged(tracing):
    error = AgentFailed("the tool blew up")

    @lit.trace
    def agent(task: str) -> float:
        OpenAI(base_url=tracing.llm.base_url, api_key="x").chat.completions.create(
            model="m", messages=[{"role": "user", "content": task}]
        )
        raise error

    with pytest.raises(AgentFailed) as info:
        agent("q")
    assert info.value is error
    (root,) = by_name(tracing.delivered(), sc.ROLLOUT_SPAN)
    assert root["status"] == 2 and root["status_message"] == "AgentFailed: the tool blew up"
    (event,) = root["events"]
    assert event["name"] == "exception"
    assert event["attributes"]["exception.type"].endswith("AgentFailed")
    assert sc.ROLLOUT_RETURN_REWARD not in root["attributes"] and sc.ROLLOUT_OUTPUT not in root["attributes"]
    (llm,) = by_name(tracing.delivered(), sc.LLM_SPAN)
    assert llm["rollout_id"] == root["rollout_id"]


def test_async_rollout_with_completions_api_and_intermediate_rewards(tracing):
    client = AsyncOpenAI(base_url=tracing.llm.base_url, api_key="x")

    @lit.trace(name="writer", agent="author")
    async def agent(task: str) -> dict:
        await client.completions.create(model="m", prompt=task)
        lit.reward(1, name="step")
        await client.completions.create(model="m", prompt=task)
        lit.reward(-0.5)
        return {"text": "done"}

    assert asyncio.run(agent("q")) == {"text": "done"}
    spans = tracing.delivered()
    (root,) = by_name(spans, sc.ROLLOUT_SPAN)
    assert root["attributes"][sc.ROLLOUT_NAME] == "writer"
    assert sc.ROLLOUT_RETURN_REWARD not in root["attributes"]  # a dict is not a reward
    assert root["attributes"][sc.ROLLOUT_OUTPUT] == '{"text": "done"}'
    llm = by_name(spans, sc.LLM_SPAN)
    assert len(llm) == 2
    for span, request, response in zip(llm, tracing.llm.requests, tracing.llm.responses, strict=True):
        choice = response["choices"][0]
        assert request["return_token_ids"] is True and request["logprobs"] == 0
        attrs = span["attributes"]
        assert attrs[sc.LLM_API] == "completion" and attrs[sc.AGENT_NAME] == "author"
        assert attrs[sc.LLM_PROMPT_TOKEN_IDS] == choice["prompt_token_ids"]
        assert attrs[sc.LLM_RESPONSE_TOKEN_IDS] == choice["token_ids"]
        assert attrs[sc.LLM_RESPONSE_LOGPROBS] == choice["logprobs"]["token_logprobs"]
    rewards = by_name(spans, sc.REWARD_SPAN)
    assert [(r["attributes"][sc.REWARD_VALUE], r["attributes"][sc.REWARD_NAME]) for r in rewards] == [
        (1.0, "step"),
        (-0.5, ""),
    ]
    # Order in time is what places an intermediate reward after the call it follows.
    assert llm[0]["end_ns"] <= rewards[0]["start_ns"] <= llm[1]["start_ns"] <= rewards[1]["start_ns"]


def test_nested_trace_names_its_agent(tracing):
    client = OpenAI(base_url=tracing.llm.base_url, api_key="x")

    def ask() -> None:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])

    @lit.trace(agent="critic")
    def critic() -> None:
        ask()

    @lit.trace(agent="actor")
    def episode(task: str) -> int:
        ask()
        critic()
        ask()
        return 3

    assert episode("t") == 3
    spans = tracing.delivered()
    assert len(by_name(spans, sc.ROLLOUT_SPAN)) == 1
    (root,) = by_name(spans, sc.ROLLOUT_SPAN)
    assert root["attributes"][sc.ROLLOUT_RETURN_REWARD] == 3.0
    assert [s["attributes"][sc.AGENT_NAME] for s in by_name(spans, sc.LLM_SPAN)] == ["actor", "critic", "actor"]
    (nested,) = [s for s in spans if s["name"].endswith("critic")]
    assert nested["parent_id"] == root["span_id"] and nested["attributes"][sc.AGENT_NAME] == "critic"


def test_rollout_is_its_own_trace_inside_a_user_span(tracing):
    from opentelemetry.sdk.trace import TracerProvider

    user_tracer = TracerProvider().get_tracer("user")

    @lit.trace
    def agent() -> float:
        return 0.0

    with user_tracer.start_as_current_span("user work") as outer:
        agent()
    (root,) = by_name(tracing.delivered(), sc.ROLLOUT_SPAN)
    assert root["parent_id"] is None
    assert root["trace_id"] != format(outer.get_span_context().trace_id, "032x")


def test_assigned_rollout_ids_and_weight_version_are_used(tracing):
    client = OpenAI(base_url=tracing.llm.base_url, api_key="x")

    @lit.trace
    def agent() -> float:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        return 1.0

    with _context.assign("r-42", task_id="task-7", attempt=2, weight_version="v3"):
        agent()
    spans = tracing.delivered()
    assert {s["rollout_id"] for s in spans} == {"r-42"}
    (llm,) = by_name(spans, sc.LLM_SPAN)
    assert llm["attributes"][sc.TASK_ID] == "task-7" and llm["attributes"][sc.ATTEMPT] == 2
    assert llm["attributes"][sc.LLM_WEIGHT_VERSION] == "v3"


def test_reward_rejects_non_numbers_and_is_ignored_outside_a_rollout(tracing, caplog):
    with pytest.raises(TypeError, match="real number"):
        lit.reward("1.0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="finite"):
        lit.reward(float("nan"))
    with caplog.at_level(logging.WARNING, logger="lit"):
        lit.reward(1.0)
    assert tracing.delivered() == []


def test_a_streamed_call_is_recorded_without_ids_and_names_itself_to_the_engine(tracing):
    """A streamed answer carries no token ids: the span holds none, and its id goes with the call (X-Lit-Call), so
    that lit's gateway, which records the engine's, makes the two one call."""
    tracing.llm.streams = True
    client = OpenAI(base_url=tracing.llm.base_url, api_key="x")

    @lit.trace
    def agent() -> str:
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    assert agent() == tracing.llm.final_text  # the user's stream, untouched
    [llm] = [s for s in tracing.delivered() if s["name"] == sc.LLM_SPAN]
    attrs = llm["attributes"]
    assert attrs[sc.LLM_STREAMED] is True and attrs[sc.LLM_TOKEN_IDS_MISSING] is True
    assert sc.LLM_PROMPT_TOKEN_IDS not in attrs and "return_token_ids" not in tracing.llm.requests[-1]
    assert tracing.llm.headers[-1]["x-lit-call"] == llm["span_id"]


def test_every_recorded_call_names_its_agent_to_the_engine(tracing):
    """The agent name lit records goes with the call too (X-Lit-Agent): with a [roles] table, lit's gateway serves
    the call by that agent's adapter. A name HTTP cannot carry (not ASCII) is left out, the call made as ever."""
    client = OpenAI(base_url=tracing.llm.base_url, api_key="x")

    @lit.trace(agent="writer")
    def write() -> None:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])

    @lit.trace(agent="rédacteur")
    def rédiger() -> None:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])

    write()
    rédiger()
    assert tracing.llm.headers[0]["x-lit-agent"] == "writer" and "x-lit-agent" not in tracing.llm.headers[1]
    assert [s["attributes"][sc.AGENT_NAME] for s in by_name(tracing.delivered(), sc.LLM_SPAN)] == ["writer",
                                                                                                  "rédacteur"]


def test_calls_to_other_endpoints_pass_through_unrecorded(tracing):
    from fake_llm import FakeLLM

    with FakeLLM() as other:
        client = OpenAI(base_url=other.base_url, api_key="x")

        @lit.trace
        def agent() -> None:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])

        agent()
        assert "return_token_ids" not in other.requests[0] and "logprobs" not in other.requests[0]
    assert by_name(tracing.delivered(), sc.LLM_SPAN) == []


def test_calls_outside_a_rollout_are_not_recorded(tracing):
    OpenAI(base_url=tracing.llm.base_url, api_key="x").chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}]
    )
    assert "return_token_ids" not in tracing.llm.requests[0]
    assert by_name(tracing.delivered(), sc.LLM_SPAN) == []


def test_the_llm_a_rollout_gets_is_recorded_without_its_api_key():
    """The rollout's input is recorded by ``repr``: the engine's API key must not reach the spans (the store, or an
    OTLP backend beside lit)."""
    from lit_sdk._spans import to_json

    llm = lit.LLM("http://127.0.0.1:8000/v1", "policy", api_key="sk-very-secret", temperature=0.7)
    recorded = to_json({"args": [{"id": "t1"}, llm]})
    assert "sk-very-secret" not in recorded and "sk-very-secret" not in repr(llm)
    assert "temperature=0.7" in recorded and llm.to_dict()["api_key"] == "sk-very-secret"  # still sent to workers
