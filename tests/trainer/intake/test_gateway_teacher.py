"""lit's gateway in front of a teacher (``Gateway(..., teachers=...)``): a real gateway, a real SQLite store, real
OpenAI clients, and as the teacher a scripted OpenAI-compatible API (tests/scripted_teacher.py): a hosted teacher
cannot be reached from the tests, so it is the one part stood in."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI
from scripted_teacher import ScriptedTeacher

from lit_sdk import semconv as sc
from lit_sdk.protocol import STATUS_OK
from lit_trainer.intake.gateway import calls
from lit_trainer.intake.gateway.server import Gateway, GatewayError
from lit_trainer.intake.rows import RolloutRow, RolloutStatus
from lit_trainer.intake.store import SqliteStore

MESSAGES = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 2 + 3?"}]
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
KEY_ENV = "LIT_TEST_TEACHER_KEY"


def hand_out(store: SqliteStore, rollout_id: str = "s1-t1-g0-a1", secret: str = "ab" * 16) -> tuple[str, str]:
    store.add_rollouts([RolloutRow(rollout_id, "t1", 0, secret=secret)])
    store.set_rollout_status(rollout_id, RolloutStatus.RUNNING)
    return rollout_id, secret


@pytest.fixture
def teacher_served(tmp_path, monkeypatch):
    """(gateway, store, teacher): a gateway whose only upstream is a teacher taking its key from KEY_ENV."""
    monkeypatch.setenv(KEY_ENV, "sk-teacher")
    def script(body: dict):
        return ("calculator", {"expression": "2+3"}) if body.get("tools") else "2 + 3 = 5."

    with ScriptedTeacher(script, key="sk-teacher") as teacher, SqliteStore(tmp_path / "lit.sqlite") as store, \
            Gateway(store, [], teachers=[(teacher.base_url, KEY_ENV)]) as gw:
        yield gw, store, teacher


def the_call(gw: Gateway, store: SqliteStore, rollout_id: str):
    gw.settle()
    records = [s for s in store.spans_of_rollout(rollout_id) if s.name == sc.ENGINE_CALL_SPAN]
    assert len(records) == 1, records
    return records[0]


def test_a_call_to_a_teacher_goes_without_lits_additions_with_its_key_and_is_recorded_with_its_messages(
        teacher_served):
    gw, store, teacher = teacher_served
    rid, secret = hand_out(store)
    # the agent holds vLLM's key and the SDK adds return_token_ids and logprobs: neither may reach the teacher
    client = OpenAI(base_url=gw.rollout_url(teacher.base_url, rid, secret), api_key="vllm-key")
    answer = client.chat.completions.create(model="big", messages=MESSAGES, tools=TOOLS, temperature=0.5,
                                            logprobs=True, extra_body={"return_token_ids": True},
                                            extra_headers={"X-Lit-Agent": "calc"})
    assert answer.choices[0].message.tool_calls[0].function.arguments == '{"expression": "2+3"}'
    [sent] = teacher.requests
    assert sent == {"model": "big", "messages": MESSAGES, "tools": TOOLS, "temperature": 0.5}
    assert teacher.headers[0]["authorization"] == "Bearer sk-teacher"
    record = the_call(gw, store, rid)
    assert record.status == STATUS_OK and record.rollout_id == rid
    attrs = dict(record.attributes)
    assert json.loads(attrs.pop(sc.LLM_REQUEST_MESSAGES)) == MESSAGES
    assert json.loads(attrs.pop(sc.LLM_REQUEST_TOOLS)) == TOOLS
    assert json.loads(attrs.pop(sc.LLM_RESPONSE_MESSAGE)) == {"content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}]}
    assert attrs == {sc.LLM_API: "chat", sc.LLM_CHOICES: 1, sc.LLM_STREAMED: False, sc.LLM_TEMPERATURE: 0.5,
                     sc.AGENT_NAME: "calc", sc.LLM_MODEL: "big", sc.LLM_RESPONSE_ID: "chatcmpl-1",
                     sc.LLM_FINISH_REASON: "tool_calls", sc.LLM_TOKEN_IDS_MISSING: True}


def test_a_streamed_answer_of_a_teacher_is_put_together(teacher_served):
    gw, store, teacher = teacher_served
    rid, secret = hand_out(store)
    client = OpenAI(base_url=gw.rollout_url(teacher.base_url, rid, secret), api_key="vllm-key")
    text = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="big", messages=MESSAGES, stream=True) if chunk.choices)
    assert text == "2 + 3 = 5."
    attrs = the_call(gw, store, rid).attributes
    assert json.loads(attrs[sc.LLM_RESPONSE_MESSAGE]) == {"content": "2 + 3 = 5.", "tool_calls": []}
    assert attrs[sc.LLM_STREAMED] is True and attrs[sc.LLM_FINISH_REASON] == "stop"
    assert sc.LLM_REQUEST_TOOLS not in attrs and teacher.headers[0]["authorization"] == "Bearer sk-teacher"

    rid, secret = hand_out(store, "s1-t2-g0-a1")
    client = OpenAI(base_url=gw.rollout_url(teacher.base_url, rid, secret), api_key="vllm-key")
    for _ in client.chat.completions.create(model="big", messages=MESSAGES, tools=TOOLS, stream=True):
        pass
    answer = json.loads(the_call(gw, store, rid).attributes[sc.LLM_RESPONSE_MESSAGE])
    assert answer["tool_calls"] == [{"id": "call_2", "type": "function", "function": {
        "name": "calculator", "arguments": '{"expression": "2+3"}'}}]


def test_a_responses_api_call_to_a_teacher_records_its_translated_chat_request(teacher_served):
    gw, store, teacher = teacher_served
    rid, secret = hand_out(store)
    client = OpenAI(base_url=gw.rollout_url(teacher.base_url, rid, secret), api_key="vllm-key")
    response = client.responses.create(model="big", instructions="Be brief.", input="What is 2 + 3?")
    assert response.output_text == "2 + 3 = 5."
    [sent] = teacher.requests
    attrs = the_call(gw, store, rid).attributes
    assert json.loads(attrs[sc.LLM_REQUEST_MESSAGES]) == sent["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    assert attrs[sc.LLM_API] == "responses" and json.loads(attrs[sc.LLM_RESPONSE_MESSAGE])["content"] == "2 + 3 = 5."


def test_a_teachers_calls_count_their_messages_in_the_attempts_share_of_the_store(teacher_served):
    gw, store, teacher = teacher_served
    rid, secret = hand_out(store)
    client = OpenAI(base_url=gw.rollout_url(teacher.base_url, rid, secret), api_key="x")
    long = [{"role": "user", "content": "x" * 5000}]
    client.chat.completions.create(model="big", messages=long)
    assert calls.size_of(the_call(gw, store, rid)) > 5000


def test_a_teacher_without_its_key_in_the_environment_stops_the_gateway_at_start(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with SqliteStore(tmp_path / "lit.sqlite") as store:
        gateway = Gateway(store, [], teachers=[("http://127.0.0.1:9/v1", KEY_ENV)])
        with pytest.raises(GatewayError, match=f"environment variable {KEY_ENV}, which is not set"):
            gateway.start()
        gateway.stop()


def test_a_teacher_without_a_key_gets_no_authorization_not_even_the_clients(tmp_path):
    with ScriptedTeacher(lambda body: "5") as teacher, SqliteStore(tmp_path / "lit.sqlite") as store, \
            Gateway(store, [], teachers=[(teacher.base_url, "")]) as gw:
        rid, secret = hand_out(store)
        client = OpenAI(base_url=gw.rollout_url(teacher.base_url, rid, secret), api_key="vllm-key")
        assert client.chat.completions.create(model="big", messages=MESSAGES).choices[0].message.content == "5"
        assert "authorization" not in teacher.headers[0]
