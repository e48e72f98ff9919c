"""lit's gateway without vLLM: who it serves and records (trust and bounds), on a real SQLite store and a real HTTP
server, with the OpenAI-shaped test server (tests/fake_llm.py) as the engine. The calls on the real vLLM, streamed
and in every API, are in tests/e2e/test_capture.py."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from fake_llm import FakeLLM
from openai import OpenAI

from lit_sdk import semconv as sc
from lit_sdk.protocol import STATUS_ERROR, STATUS_OK
from lit_trainer.intake.gateway import calls
from lit_trainer.intake.gateway import server as gateway_module
from lit_trainer.intake.gateway.server import Gateway
from lit_trainer.intake.rows import RolloutRow, RolloutStatus
from lit_trainer.intake.store import SqliteStore

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture
def served(tmp_path):
    """(gateway, store, engine): a gateway in front of the test server, on a fresh store."""
    with FakeLLM() as engine, SqliteStore(tmp_path / "lit.sqlite") as store, Gateway(store, [engine.base_url]) as gw:
        yield gw, store, engine


def hand_out(store: SqliteStore, rollout_id: str = "s1-t1-g0-a1", secret: str = "ab" * 16,
             status: RolloutStatus = RolloutStatus.RUNNING) -> tuple[str, str]:
    store.add_rollouts([RolloutRow(rollout_id, "t1", 0, secret=secret)])
    if status is not RolloutStatus.QUEUED:
        store.set_rollout_status(rollout_id, status)
    return rollout_id, secret


def engine_calls(gw: Gateway, store: SqliteStore, rollout_id: str) -> list:
    gw.settle()
    return [s for s in store.spans_of_rollout(rollout_id) if s.name == sc.ENGINE_CALL_SPAN]


def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                      **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_call_under_its_rollout_url_is_served_and_recorded_with_the_engines_ids(served):
    gw, store, engine = served
    rid, secret = hand_out(store)
    client = OpenAI(base_url=gw.rollout_url(engine.base_url, rid, secret), api_key="x")
    answer = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0.5,
                                            extra_headers={"X-Lit-Agent": "solver", "X-Lit-Call": "0123456789abcdef"})
    assert engine.requests[-1]["return_token_ids"] is True and engine.requests[-1]["logprobs"] is True
    [call] = engine_calls(gw, store, rid)
    attrs = dict(call.attributes)
    sent = engine.responses[-1]
    assert attrs.pop(sc.LLM_PROMPT_TOKEN_IDS) == sent["prompt_token_ids"]
    assert attrs.pop(sc.LLM_RESPONSE_TOKEN_IDS) == sent["choices"][0]["token_ids"]
    assert attrs.pop(sc.LLM_RESPONSE_LOGPROBS) == [t["logprob"] for t in sent["choices"][0]["logprobs"]["content"]]
    assert attrs == {sc.LLM_API: "chat", sc.LLM_CHOICES: 1, sc.LLM_STREAMED: False, sc.LLM_TEMPERATURE: 0.5,
                     sc.AGENT_NAME: "solver", sc.LLM_CALL_ID: "0123456789abcdef", sc.LLM_MODEL: sent["model"],
                     sc.LLM_RESPONSE_ID: sent["id"], sc.LLM_FINISH_REASON: answer.choices[0].finish_reason}
    assert answer.id == sent["id"]  # the client got vLLM's own answer
    assert gw.recorded == 1 and gw.refused == {}


@pytest.mark.parametrize(("change", "status", "kind"), [
    ("unknown", 403, "unknown_rollout"),
    ("secret", 403, "wrong_secret"),
    ("ended", 410, "ended_rollout"),
])
def test_a_call_under_a_url_the_trainer_did_not_hand_out_is_refused_and_recorded_nowhere(served, change, status,
                                                                                       kind):
    gw, store, engine = served
    rid, secret = hand_out(store, status=RolloutStatus.SUCCEEDED if change == "ended" else RolloutStatus.RUNNING)
    asked = "s9-t9-g0-a1" if change == "unknown" else rid
    url = gw.rollout_url(engine.base_url, asked, "cd" * 16 if change == "secret" else secret)
    code, body = post(url + "/chat/completions", {"model": "m", "messages": MESSAGES})
    assert code == status and body["error"]["type"] == "lit_gateway" and repr(asked) in body["error"]["message"]
    assert engine.requests == []  # never reached the engine
    assert engine_calls(gw, store, rid) == [] and gw.refused == {kind: 1} and gw.recorded == 0


def test_an_attempt_that_ends_while_its_call_runs_keeps_that_call_and_no_later_one(served):
    """The dispatcher may store an attempt's end (its agent done) before the gateway's thread writes its last
    call: that call is still the attempt's. Once ended, the attempt's URL takes no more calls."""
    gw, store, engine = served
    rid, secret = hand_out(store)
    url = gw.rollout_url(engine.base_url, rid, secret) + "/chat/completions"
    assert post(url, {"model": "m", "messages": MESSAGES})[0] == 200  # the gateway knows the attempt now

    def end_it() -> None:
        store.set_rollout_status(rid, RolloutStatus.SUCCEEDED)
        gw.end(rid)

    engine.before_answer = end_it
    assert post(url, {"model": "m", "messages": MESSAGES})[0] == 200
    assert len(engine_calls(gw, store, rid)) == 2 and gw.refused == {}
    code, body = post(url, {"model": "m", "messages": MESSAGES})
    assert code == 410 and "has ended (succeeded)" in body["error"]["message"]
    assert len(engine_calls(gw, store, rid)) == 2 and gw.refused == {"ended_rollout": 1}


def test_an_attempts_calls_stop_at_its_share_of_the_store(served, monkeypatch):
    gw, store, engine = served
    monkeypatch.setattr(gateway_module.admission, "MAX_ROLLOUT_SPANS", 2)
    rid, secret = hand_out(store)
    url = gw.rollout_url(engine.base_url, rid, secret) + "/chat/completions"
    codes = [post(url, {"model": "m", "messages": MESSAGES})[0] for _ in range(3)]
    assert codes == [200, 200, 429]
    assert len(engine_calls(gw, store, rid)) == 2 and gw.refused == {"too_many_calls": 1}


def test_a_body_that_is_not_a_json_object_is_refused_in_words(served):
    gw, store, engine = served
    rid, secret = hand_out(store)
    code, body = post(gw.rollout_url(engine.base_url, rid, secret) + "/chat/completions", ["not", "an", "object"])
    assert code == 400 and "JSON object" in body["error"]["message"]
    assert gw.refused == {"bad_request": 1} and engine.requests == []


def test_other_routes_are_forwarded_unrecorded(served):
    gw, store, engine = served
    rid, secret = hand_out(store)
    with urllib.request.urlopen(gw.rollout_url(engine.base_url, rid, secret) + "/models", timeout=30) as response:
        assert json.loads(response.read())["data"][0]["id"] == "fake"
    assert engine_calls(gw, store, rid) == [] and gw.recorded == 0


def test_a_gateway_that_cannot_listen_says_where(served):
    gw, store, engine = served
    with pytest.raises(gateway_module.GatewayError, match=f"cannot listen on 127.0.0.1:{gw.port}"):
        Gateway(store, [engine.base_url], port=gw.port).start()


def test_a_program_posts_rewards_to_its_rollouts_url(served):
    gw, store, engine = served
    rid, secret = hand_out(store)
    base = gw.rollout_url(engine.base_url, rid, secret).removesuffix("/v1")
    assert post(base + "/reward", {"value": 0.5, "name": "tests"}) == (200, {"recorded": True})
    code, body = post(base + "/reward", {"value": "high"})
    assert code == 400 and '{"value": <number>' in body["error"]["message"]
    forged = gw.rollout_url(engine.base_url, rid, "cd" * 16).removesuffix("/v1")
    assert post(forged + "/reward", {"value": 1e6})[0] == 403
    gw.settle()
    [reward] = [s for s in store.spans_of_rollout(rid) if s.name == sc.ENGINE_REWARD_SPAN]
    assert reward.attributes == {sc.REWARD_VALUE: 0.5, sc.REWARD_NAME: "tests"}
    assert gw.refused == {"bad_request": 1, "wrong_secret": 1}


def test_a_stream_its_client_left_is_recorded_cut_with_what_was_sampled():
    call = calls.Call("chat", "s1-t1-g0-a1", {"stream": True, "messages": MESSAGES}, None, None)
    call.take_chunk({"id": "c1", "model": "m", "prompt_token_ids": [1, 2, 3], "choices": [
        {"index": 0, "delta": {"content": "Fi"}, "token_ids": [40], "logprobs": {"content": [{"logprob": -0.5}]}}]})
    whole = call.record()
    assert whole.status == STATUS_OK and whole.attributes[sc.LLM_RESPONSE_TOKEN_IDS] == [40]
    call.cut = True
    cut = call.record()
    assert cut.status == STATUS_ERROR and "cut" in cut.status_message
    assert cut.attributes[sc.LLM_PROMPT_TOKEN_IDS] == [1, 2, 3] and cut.attributes[sc.LLM_STREAMED] is True


def test_streams_in_every_api_are_relayed_and_recorded(served):
    """Chat passed through, the Responses API and Anthropic's Messages translated: each streamed answer reaches the
    official client whole, and its call is recorded with the engine's ids (the test server streams as vLLM does)."""
    import anthropic

    gw, store, engine = served
    engine.streams = True
    rid, secret = hand_out(store)
    url = gw.rollout_url(engine.base_url, rid, secret)
    client = OpenAI(base_url=url, api_key="x")
    chat = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == engine.final_text
    events = list(client.responses.create(model="m", input="What is 2 + 3?", stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == engine.final_text
    with anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="x").messages.stream(
            model="m", max_tokens=16, messages=MESSAGES) as stream:
        assert stream.get_final_message().content[0].text == engine.final_text
    recorded = sorted(engine_calls(gw, store, rid), key=lambda s: s.start_ns)
    assert [c.attributes[sc.LLM_API] for c in recorded] == ["chat", "responses", "messages"]
    for call, sent in zip(recorded, engine.responses, strict=True):
        assert call.status == STATUS_OK and call.attributes[sc.LLM_STREAMED] is True
        assert call.attributes[sc.LLM_PROMPT_TOKEN_IDS] == sent["prompt_token_ids"]
        assert call.attributes[sc.LLM_RESPONSE_TOKEN_IDS] == sent["choices"][0]["token_ids"]
        assert len(call.attributes[sc.LLM_RESPONSE_LOGPROBS]) == len(sent["choices"][0]["token_ids"])


def test_a_rollout_id_with_any_characters_travels_in_its_url(served):
    """Rollout ids carry the user's task ids, which may hold a slash, a space, a question mark..."""
    gw, store, engine = served
    rid, secret = hand_out(store, rollout_id="s1-calc/12 ü?x#%-g0-a1")
    client = OpenAI(base_url=gw.rollout_url(engine.base_url, rid, secret), api_key="x")
    client.chat.completions.create(model="m", messages=MESSAGES)
    [call] = engine_calls(gw, store, rid)
    assert call.rollout_id == rid and gw.refused == {}


def test_a_store_that_cannot_write_stops_the_gateway_loudly(served, monkeypatch: pytest.MonkeyPatch):
    """The disk fault is simulated (a full disk cannot be made here): settle() raises it, and no later call is
    served as if it were recorded."""
    import sqlite3

    gw, store, engine = served
    rid, secret = hand_out(store)

    def full_disk(records):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(store, "add_spans", full_disk)
    client = OpenAI(base_url=gw.rollout_url(engine.base_url, rid, secret), api_key="x", max_retries=0)
    client.chat.completions.create(model="m", messages=MESSAGES)
    with pytest.raises(gateway_module.GatewayError, match="disk is full"):
        gw.settle()
    assert gw.recorded == 0


def test_with_a_role_table_each_agents_calls_go_to_its_adapter_whatever_model_it_asked(tmp_path):
    routes = {"writer": "policy-writer", "checker": "policy"}
    with FakeLLM() as engine, SqliteStore(tmp_path / "lit.sqlite") as store, \
            Gateway(store, [engine.base_url], routes=routes, base_model="policy") as gw:
        rid, secret = hand_out(store)
        client = OpenAI(base_url=gw.rollout_url(engine.base_url, rid, secret), api_key="x")
        for agent, asked in (("writer", "policy"), ("checker", "policy-writer"), ("unnamed", "policy-writer"),
                             (None, "policy-writer")):
            headers = {"X-Lit-Agent": agent} if agent else {}
            client.chat.completions.create(model=asked, messages=MESSAGES, extra_headers=headers)
        assert [r["model"] for r in engine.requests] == ["policy-writer", "policy", "policy", "policy"]
        models = [dict(s.attributes)[sc.LLM_MODEL] for s in engine_calls(gw, store, rid)]
        assert sorted(models) == ["policy", "policy", "policy", "policy-writer"]  # the engine's answers say so
