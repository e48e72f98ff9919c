"""Capture at the engine, on the real vLLM: every call an agent makes through its rollout's URL is exactly one
transition with the engine's token ids, whatever the API (chat, text completions, the Responses API, Anthropic's
Messages), streamed or not, from a Python process running ``lit.instrument()`` or from a process without lit
(Python with the official clients, Node.js with fetch) run as a program agent (``lit_sdk.command_agent``)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import anthropic
import pytest
from openai import OpenAI

import lit_sdk as lit
from lit_sdk import semconv as sc
from lit_sdk.command_agent import command_agent
from lit_sdk.resources import LLM
from lit_trainer.intake.collector import Collector
from lit_trainer.intake.episodes import Episode, build_episode
from lit_trainer.intake.gateway.server import Gateway
from lit_trainer.intake.rows import RolloutRow, RolloutStatus
from lit_trainer.intake.store import SqliteStore

pytestmark = pytest.mark.vllm

AGENTS = Path(__file__).parent / "capture_agents"
APIS = ("chat", "completions", "responses", "messages")
QUESTION = "Name a colour."
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def capture(vllm_server, tmp_path_factory):
    """A store, a collector and a gateway in front of the session's vLLM, with lit.instrument() in this process."""
    folder = tmp_path_factory.mktemp("capture")
    with SqliteStore(folder / "lit.sqlite") as store, \
            Collector(store, "tcp://127.0.0.1:0", open_to_local_users=True) as collector, \
            Gateway(store, [vllm_server.openai_url]) as gateway:
        lit.instrument(endpoint=collector.endpoint, llm_base_urls=[gateway.url], frameworks=[],
                       spool_dir=str(folder / "spool"))
        try:
            yield store, gateway, vllm_server
        finally:
            lit.uninstrument()


def hand_out(store: SqliteStore, name: str) -> tuple[str, str]:
    rollout_id, secret = f"{name}-{time.monotonic_ns()}-a1", "ef" * 16
    store.add_rollouts([RolloutRow(rollout_id, "t1", 0, secret=secret)])
    store.set_rollout_status(rollout_id, RolloutStatus.RUNNING)
    return rollout_id, secret


def in_process_agent(api: str, stream: bool):
    """Two calls with the official Python clients, lit.instrument() on, a reward between them."""

    @lit.trace(agent="solver")
    def agent(task: dict, llm: LLM) -> float:
        kwargs = dict(model=llm.model, max_tokens=MAX_TOKENS, temperature=llm.temperature)
        if api == "messages":
            kwargs["extra_body"] = {"temperature": kwargs.pop("temperature")}  # not a parameter of this client's
            # lit does not patch Anthropic's client: the gateway alone records these calls, named by the header
            client = anthropic.Anthropic(base_url=llm.base_url.removesuffix("/v1"), api_key=llm.api_key,
                                         default_headers={"X-Lit-Agent": "solver"})
            messages = [{"role": "user", "content": task["question"]}]
            if stream:
                with client.messages.stream(messages=messages, **kwargs) as s:
                    first = s.get_final_message()
            else:
                first = client.messages.create(messages=messages, **kwargs)
            lit.reward(0.5, name="step")
            client.messages.create(messages=[*messages, {"role": "assistant", "content": first.content[0].text or "?"},
                                             {"role": "user", "content": "Again."}], **kwargs)
            return 1.0
        client = OpenAI(base_url=llm.base_url, api_key=llm.api_key)
        if api == "responses":
            kwargs["max_output_tokens"] = kwargs.pop("max_tokens")
            answer = client.responses.create(input=task["question"], stream=stream, **kwargs)
            previous = (list(answer)[-1].response if stream else answer).id  # completed, or incomplete at max tokens
            lit.reward(0.5, name="step")
            client.responses.create(input="Again.", previous_response_id=previous, **kwargs)
            return 1.0
        if api == "chat":
            messages = [{"role": "user", "content": task["question"]}]
            answer = client.chat.completions.create(messages=messages, stream=stream, **kwargs)
            text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices) if stream else \
                answer.choices[0].message.content
            lit.reward(0.5, name="step")
            client.chat.completions.create(messages=[*messages, {"role": "assistant", "content": text},
                                                     {"role": "user", "content": "Again."}], **kwargs)
            return 1.0
        answer = client.completions.create(prompt=task["question"], stream=stream, **kwargs)
        text = "".join(c.choices[0].text for c in answer if c.choices) if stream else answer.choices[0].text
        lit.reward(0.5, name="step")
        client.completions.create(prompt=task["question"] + text + "\nAgain:", **kwargs)
        return 1.0

    return agent


def run_rollout(capture, agent, name: str) -> tuple[str, Episode]:
    store, gateway, server = capture
    rollout_id, secret = hand_out(store, name)
    llm = LLM(gateway.rollout_url(server.openai_url, rollout_id, secret), server.model_name,
              api_key=server.api_key or "EMPTY", temperature=0.7, max_tokens=MAX_TOKENS)
    with lit.assign_rollout(rollout_id, "t1", secret=secret):
        result = agent({"id": "t1", "question": QUESTION}, llm)
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
    assert result == 1.0
    gateway.settle()
    lit.flush(30)
    deadline = time.monotonic() + 30
    while (missing := store.missing_spans(rollout_id)) is not None:
        assert time.monotonic() < deadline, missing
        time.sleep(0.05)
    episode = build_episode(store.spans_of_rollout(rollout_id))
    assert isinstance(episode, Episode), episode
    return rollout_id, episode


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("where", ["instrumented", "python", "node"])
def test_every_call_is_one_transition_with_the_engines_ids(capture, where, api, stream):
    mode = "stream" if stream else "plain"
    if where == "instrumented":
        agent = in_process_agent(api, stream)
    else:
        program = [sys.executable, str(AGENTS / "agent.py")] if where == "python" else \
            ["node", str(AGENTS / "agent.mjs")]
        agent = command_agent([*program, api, mode])
    rollout_id, episode = run_rollout(capture, agent, f"{where}-{api}-{mode}")
    store = capture[0]
    engine = sorted((s for s in store.spans_of_rollout(rollout_id) if s.name == sc.ENGINE_CALL_SPAN),
                    key=lambda s: s.start_ns)
    assert len(engine) == 2 and len(episode.transitions) == 2
    streamed = [stream, stream and where != "instrumented"]  # the in-process agent streams its first call only
    for transition, call, was_streamed in zip(episode.transitions, engine, streamed, strict=True):
        assert call.attributes[sc.LLM_API] == {"completions": "completion"}.get(api, api)
        assert call.attributes[sc.LLM_STREAMED] is was_streamed
        assert transition.prompt_ids == call.attributes[sc.LLM_PROMPT_TOKEN_IDS]
        assert transition.response_ids == call.attributes[sc.LLM_RESPONSE_TOKEN_IDS]
        assert 0 < len(transition.response_ids) <= MAX_TOKENS
        assert transition.logprobs is not None and len(transition.logprobs) == len(transition.response_ids)
        assert all(lp <= 0 for lp in transition.logprobs)
        assert transition.agent == "solver" and transition.weight_version == 0
    # the second call's prompt holds the first exchange: the same conversation went on
    assert len(episode.transitions[1].prompt_ids) > len(episode.transitions[0].prompt_ids)
    assert episode.final_reward == 1.0 and episode.skipped_calls == 0
    if where == "instrumented":  # one call seen both ways is one transition, in the SDK's place
        assert [t.reward for t in episode.transitions] == [0.5, None]
        assert all(call.attributes.get(sc.LLM_CALL_ID) for call in engine) or api == "messages"


def test_greedy_streamed_and_plain_calls_record_the_same_ids(capture):
    store, gateway, server = capture
    rollout_id, secret = hand_out(store, "greedy")
    client = OpenAI(base_url=gateway.rollout_url(server.openai_url, rollout_id, secret), api_key="x")
    ask = dict(model=server.model_name, messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
               temperature=0)
    plain = client.chat.completions.create(**ask).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **ask)
                       if c.choices)
    gateway.settle()
    first, second = sorted((s for s in store.spans_of_rollout(rollout_id)), key=lambda s: s.start_ns)
    assert streamed == plain
    for key in (sc.LLM_PROMPT_TOKEN_IDS, sc.LLM_RESPONSE_TOKEN_IDS):
        assert first.attributes[key] == second.attributes[key]
    assert first.attributes[sc.LLM_RESPONSE_LOGPROBS] == pytest.approx(second.attributes[sc.LLM_RESPONSE_LOGPROBS],
                                                                       abs=1e-4)


def test_a_client_that_leaves_mid_stream_leaves_a_cut_call(capture):
    store, gateway, server = capture
    rollout_id, secret = hand_out(store, "cut")
    client = OpenAI(base_url=gateway.rollout_url(server.openai_url, rollout_id, secret), api_key="x")
    stream = client.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=200, temperature=1.0, stream=True,
                                            extra_body={"min_tokens": 200})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 60
    while not (calls := store.spans_of_rollout(rollout_id)):
        assert time.monotonic() < deadline, "the cut call was never recorded"
        time.sleep(0.05)
    [call] = calls
    assert call.status == 2 and "cut" in call.status_message
    assert len(call.attributes.get(sc.LLM_RESPONSE_TOKEN_IDS, [])) < 200
