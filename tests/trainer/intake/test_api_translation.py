"""The gateway's translation of OpenAI's Responses API and Anthropic's Messages API into vLLM's chat completions and
back (intake/gateway/responses_api.py, messages_api.py): hand-written requests and vLLM-shaped answers and streams,
and what the official clients (and the OpenAI Agents SDK) parse from a local server that answers through them."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import anthropic
import openai
import pytest

from lit_trainer.intake.gateway import messages_api, responses_api
from lit_trainer.intake.gateway.responses_api import TranslationError

MODEL = "Qwen/Qwen3-0.6B"
CREATED = 1_700_000_000
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": PARAMETERS,
           "strict": True}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                 "parameters": PARAMETERS, "strict": True}}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "Weather of a city", "input_schema": PARAMETERS}


def tool_call(call_id: str, arguments: str, name: str = "get_weather") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_answer(content: str | None, calls: list[dict] = (), finish: str = "stop", stop_reason: object = None,
                usage: tuple[int, int] = (12, 7)) -> dict:
    """A whole chat completion as vLLM returns it with ``return_token_ids``."""
    message = {"role": "assistant", "content": content, "tool_calls": list(calls), "reasoning_content": None}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason,
              "token_ids": list(range(usage[1]))}
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": CREATED, "model": MODEL, "choices": [choice],
            "prompt_token_ids": list(range(usage[0])),
            "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}}


def chunk(delta: dict, finish: str | None = None, ids: int = 1) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "stop_reason": None,
              "token_ids": list(range(ids))}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": CREATED, "model": MODEL,
            "choices": [choice]}


def chat_chunks(texts: list[str] = (), calls: list[tuple] = (), finish: str = "stop",
                usage: tuple[int, int] | None = (12, 7)) -> list[dict]:
    """vLLM's chat stream: the role chunk with the prompt's ids, a chunk per text piece, a chunk per tool call piece
    ``(index, id, name, arguments)`` (id and name only on a call's first piece), the finish chunk, the usage chunk."""
    out = [{**chunk({"role": "assistant", "content": ""}, ids=0), "prompt_token_ids": list(range(12))}]
    out += [chunk({"content": text}) for text in texts]
    for index, call_id, name, arguments in calls:
        head = {"id": call_id, "type": "function"} if call_id else {}
        function = {"name": name, "arguments": arguments} if name else {"arguments": arguments}
        out.append(chunk({"tool_calls": [{"index": index, **head, "function": function}]}))
    out.append(chunk({"content": ""}, finish=finish, ids=0))
    if usage is not None:
        out.append({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": CREATED, "model": MODEL,
                    "choices": [], "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                                             "total_tokens": sum(usage)}})
    return out


TWO_CALLS = [(0, "call_a", "get_weather", ""), (0, None, None, '{"city": '), (0, None, None, '"Paris"}'),
             (1, "call_b", "get_weather", '{"city"'), (1, None, None, ': "Lyon"}')]
"""Two tool calls streamed in pieces, as vLLM's tool parser streams them."""
TWO_CALLS_WHOLE = [tool_call("call_a", '{"city": "Paris"}'), tool_call("call_b", '{"city": "Lyon"}')]


class Handler(BaseHTTPRequestHandler):
    """A gateway without vLLM: translates each request, answers the next canned chat answer (a dict, or a list of
    chunks for a stream) translated back."""

    def do_POST(self) -> None:
        state = self.server.state
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        api = responses_api if self.path.endswith("/responses") else messages_api
        try:
            chat = api.to_chat_request(body)
        except TranslationError as exc:
            return self._send(400, {"type": "error", "error": {"type": "invalid_request_error", "message": str(exc)}})
        state.requests.append(chat)
        answer = state.answers.pop(0)
        response_id = f"{'resp' if api is responses_api else 'msg'}_{len(state.requests)}"
        if not body.get("stream"):
            return self._send(200, api.from_chat_response(answer, body, response_id))
        translator = api.StreamTranslator(body, response_id)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for events in [*(translator.feed(c) for c in answer), translator.finish()]:
            self.wfile.write(b"".join(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode() for kind, data in events))
        state.streamed.append(translator.response)

    def _send(self, status: int, data: dict) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def gateway() -> Iterator[SimpleNamespace]:
    """The local server's state (``answers`` to give, ``requests`` translated, ``streamed`` responses) and clients."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.state = state = SimpleNamespace(answers=[], requests=[], streamed=[])
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    state.openai = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    state.anthropic = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    yield state
    httpd.shutdown()
    httpd.server_close()
    thread.join()
    assert not state.answers, "a canned answer was not asked for"


# -- Responses API: requests


def test_responses_request_becomes_chat_request() -> None:
    body = {
        "model": MODEL, "instructions": "Be brief.", "input": [
            {"role": "developer", "content": "Answer in French."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris"},
                                                             {"type": "input_text", "text": "and Lyon?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather",
             "arguments": '{"city": "Paris"}', "status": "completed"},
            {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
            {"type": "function_call_output", "call_id": "call_a", "output": "18C"},
            {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "21C"}]},
            {"role": "user", "content": "Thanks"}],
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
        "max_output_tokens": 64, "temperature": 0.7, "top_p": 0.9, "stream": True, "store": False,
        "reasoning": {"effort": "low"},
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": True}}}
    assert responses_api.to_chat_request(body) == {
        "model": MODEL, "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris"},
                                         {"type": "text", "text": "and Lyon?"}]},
            {"role": "assistant", "content": "Checking.", "tool_calls": TWO_CALLS_WHOLE},
            {"role": "tool", "tool_call_id": "call_a", "content": "18C"},
            {"role": "tool", "tool_call_id": "call_b", "content": "21C"},
            {"role": "user", "content": "Thanks"}],
        "temperature": 0.7, "top_p": 0.9, "parallel_tool_calls": False, "max_tokens": 64, "tools": [CHAT_WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True}},
        "stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("extra, chat", [
    ({}, {}),
    ({"tool_choice": "required", "stream": False}, {"tool_choice": "required", "stream": False}),
    ({"tool_choice": "none", "text": {"format": {"type": "text"}}}, {"tool_choice": "none"}),
    ({"text": {"format": {"type": "json_object"}}}, {"response_format": {"type": "json_object"}}),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
     {"messages": [{"role": "assistant", "content": None, "tool_calls": [tool_call("c", "{}", "f")]}]}),
])
def test_responses_request_leaves_out_what_the_client_did_not_set(extra: dict, chat: dict) -> None:
    body = {"model": MODEL, "input": "Hi", **extra}
    assert responses_api.to_chat_request(body) == {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                    **chat}


@pytest.mark.parametrize("extra, message", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content[0]: content parts of type 'input_image' are not supported by lit's gateway"),
    ({"input": [{"role": "user", "content": "draw"}, {"type": "image_generation_call", "id": "ig", "result": None,
                                                      "status": "completed"}]},
     "input[1]: items of type 'image_generation_call' are not supported by lit's gateway"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}]},
     "input[0].output[0]: content parts of type 'input_file' are not supported"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id: required"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role: 'tool' is not a message role"),
    ({"tools": [WEATHER, {"type": "web_search"}]}, "tools[1]: tools of type 'web_search' are not supported"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice: tool choices 'file_search' are not supported"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format: formats of type 'grammar' are not supported"),
    ({"background": True}, "background: background responses are not supported"),
    ({"instructions": [{"role": "system", "content": "x"}]}, "instructions: must be a string"),
])
def test_responses_request_refused_names_the_field(extra: dict, message: str) -> None:
    with pytest.raises(TranslationError, match=re.escape(message)):
        responses_api.to_chat_request({"model": MODEL, "input": "Hi", **extra})


def test_previous_response_conversation_continues_with_new_instructions() -> None:
    first_body = {"model": MODEL, "instructions": "Be brief.", "input": "Weather in Paris?", "tools": [WEATHER]}
    first = responses_api.to_chat_request(first_body)
    answer = chat_answer(None, [tool_call("call_a", '{"city": "Paris"}')], "tool_calls")
    response = responses_api.from_chat_response(answer, first_body, "resp_1")
    assert responses_api.output_messages(response) == [
        {"role": "assistant", "content": None, "tool_calls": [tool_call("call_a", '{"city": "Paris"}')]}]
    history = first["messages"] + responses_api.output_messages(response)
    kept = json.loads(json.dumps(history))
    second = {"model": MODEL, "previous_response_id": "resp_1",
              "input": [{"type": "function_call_output", "call_id": "call_a", "output": "18C"}]}
    tail = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [tool_call("call_a", '{"city": "Paris"}')]},
            {"role": "tool", "tool_call_id": "call_a", "content": "18C"}]
    assert responses_api.input_messages(second, history) == [{"role": "system", "content": "Be brief."}, *tail]
    assert responses_api.to_chat_request({**second, "instructions": "Be very brief."}, history)["messages"] == [
        {"role": "system", "content": "Be very brief."}, *tail]
    # a call joins the history's last assistant message in a copy: the gateway's history is left as it was
    more = responses_api.input_messages({"input": [{"type": "function_call", "call_id": "call_b", "name": "f",
                                                    "arguments": "{}"}]}, history)
    assert more[-1]["tool_calls"] == [tool_call("call_a", '{"city": "Paris"}'), tool_call("call_b", "{}", "f")]
    assert history == kept


# -- Responses API: answers and streams


def test_responses_answer_from_chat_completion() -> None:
    body = {"model": MODEL, "input": "Weather?", "tools": [WEATHER], "temperature": 0.5}
    response = responses_api.from_chat_response(chat_answer("Checking.", TWO_CALLS_WHOLE, "tool_calls"), body,
                                                "resp_7")
    assert response["output"] == [
        {"type": "message", "id": "msg_7_0", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_7_1", "call_id": "call_a", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "id": "fc_7_2", "call_id": "call_b", "name": "get_weather",
         "arguments": '{"city": "Lyon"}', "status": "completed"}]
    assert response["usage"] == {"input_tokens": 12, "output_tokens": 7, "total_tokens": 19,
                                 "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                                 "output_tokens_details": {"reasoning_tokens": 0}}
    assert (response["id"], response["object"], response["status"], response["incomplete_details"]) == (
        "resp_7", "response", "completed", None)
    assert (response["created_at"], response["model"], response["tools"], response["temperature"]) == (
        CREATED, MODEL, [WEATHER], 0.5)
    assert responses_api.output_messages(response) == [
        {"role": "assistant", "content": "Checking.", "tool_calls": TWO_CALLS_WHOLE}]
    cut = responses_api.from_chat_response(chat_answer("Chec", finish="length"), body, "resp_8")
    assert (cut["status"], cut["incomplete_details"], cut["output"][0]["status"]) == (
        "incomplete", {"reason": "max_output_tokens"}, "incomplete")


def test_responses_stream_events() -> None:
    body = {"model": MODEL, "input": "Weather?", "tools": [WEATHER], "stream": True}
    translator = responses_api.StreamTranslator(body, "resp_7")
    sent: list[tuple[str, dict]] = []
    wire = []
    for piece in chat_chunks(["Let me ", "check."], TWO_CALLS, "tool_calls"):
        events = translator.feed(piece)
        sent += events
        wire += [json.dumps(data) for _, data in events]  # as the gateway writes them, at once
    sent += translator.finish()
    assert [kind for kind, _ in sent] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [data["sequence_number"] for _, data in sent] == list(range(len(sent)))
    assert all(data["type"] == kind for kind, data in sent)
    assert [json.dumps(data) for _, data in sent[:len(wire)]] == wire, "an event changed after it was sent"
    assert [d["delta"] for k, d in sent if k == "response.output_text.delta"] == ["Let me ", "check."]
    assert [(d["output_index"], d["delta"]) for k, d in sent if k == "response.function_call_arguments.delta"] == [
        (1, '{"city": '), (1, '"Paris"}'), (2, '{"city"'), (2, ': "Lyon"}')]
    assert sent[2][1]["item"] == {"type": "message", "id": "msg_7_0", "role": "assistant", "status": "in_progress",
                                  "content": []}
    whole = responses_api.from_chat_response(chat_answer("Let me check.", TWO_CALLS_WHOLE, "tool_calls"), body,
                                             "resp_7")
    assert translator.response == whole == sent[-1][1]["response"]


def test_responses_stream_cut_counts_token_ids_without_usage() -> None:
    translator = responses_api.StreamTranslator({"model": MODEL, "input": "Hi"}, "resp_9")
    events = [e for c in chat_chunks(["Bon", "jour"], finish="length", usage=None) for e in translator.feed(c)]
    events += translator.finish()
    assert events[-1][0] == "response.incomplete"
    response = translator.response
    assert (response["status"], response["incomplete_details"], response["output"][0]["status"]) == (
        "incomplete", {"reason": "max_output_tokens"}, "incomplete")
    assert (response["usage"]["input_tokens"], response["usage"]["output_tokens"]) == (12, 2)
    assert response["output"][0]["content"][0]["text"] == "Bonjour"


# -- Responses API: what OpenAI's client and the Agents SDK parse


def test_openai_client_parses_answer(gateway: SimpleNamespace) -> None:
    gateway.answers = [chat_answer("Bonjour.", usage=(12, 3)),
                       chat_answer("Checking.", TWO_CALLS_WHOLE, "tool_calls")]
    response = gateway.openai.responses.create(model=MODEL, instructions="Be brief.", input="Hello",
                                               max_output_tokens=32, temperature=0.5)
    assert gateway.requests[0] == {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                                                {"role": "user", "content": "Hello"}],
                                   "temperature": 0.5, "max_tokens": 32}
    assert (response.id, response.status, response.output_text, response.model) == (
        "resp_1", "completed", "Bonjour.", MODEL)
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (12, 3, 15)
    called = gateway.openai.responses.create(model=MODEL, input="Weather in Paris and Lyon?", tools=[WEATHER])
    assert gateway.requests[1]["tools"] == [CHAT_WEATHER]
    assert called.output_text == "Checking."
    calls = [item for item in called.output if item.type == "function_call"]
    assert [(c.call_id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("call_a", "get_weather", {"city": "Paris"}), ("call_b", "get_weather", {"city": "Lyon"})]


def test_openai_client_streams_tool_calls_split_over_chunks(gateway: SimpleNamespace) -> None:
    gateway.answers = [chat_chunks(["Let me ", "check."], TWO_CALLS, "tool_calls")]
    with gateway.openai.responses.stream(model=MODEL, input="Weather in Paris and Lyon?", tools=[WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert gateway.requests[0]["stream"] is True and gateway.requests[0]["stream_options"] == {"include_usage": True}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Let me check."
    assert (final.status, final.output_text, final.usage.input_tokens, final.usage.output_tokens) == (
        "completed", "Let me check.", 12, 7)
    assert [(item.call_id, json.loads(item.arguments)) for item in final.output if item.type == "function_call"] == [
        ("call_a", {"city": "Paris"}), ("call_b", {"city": "Lyon"})]
    assert [item.id for item in final.output] == [item["id"] for item in gateway.streamed[0]["output"]]


def test_openai_client_streams_a_cut_answer(gateway: SimpleNamespace) -> None:
    gateway.answers = [chat_chunks(["Once upon", " a time"], finish="length", usage=(5, 2))]
    events = list(gateway.openai.responses.create(model=MODEL, input="A story", max_output_tokens=2, stream=True))
    assert gateway.requests[0]["max_tokens"] == 2
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1]
    assert (last.type, last.response.status, last.response.incomplete_details.reason) == (
        "response.incomplete", "incomplete", "max_output_tokens")
    assert (last.response.output_text, last.response.usage.output_tokens) == ("Once upon a time", 2)


def test_openai_client_hears_what_is_refused(gateway: SimpleNamespace) -> None:
    with pytest.raises(openai.BadRequestError, match=re.escape("tools[0]: tools of type 'web_search' are not")):
        gateway.openai.responses.create(model=MODEL, input="Search", tools=[{"type": "web_search"}])
    assert gateway.requests == []


def test_agents_sdk_runs_a_tool_turn_through_the_translation(gateway: SimpleNamespace) -> None:
    agents = pytest.importorskip("agents")
    cities = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        cities.append(city)
        return f"18C in {city}"

    gateway.answers = [chat_answer(None, [tool_call("call_a", '{"city": "Paris"}')], "tool_calls"),
                       chat_answer("It is 18C.")]
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=gateway.openai.base_url, api_key="x", max_retries=0))
    agent = agents.Agent(name="weather", instructions="Be brief.", model=model, tools=[get_weather])
    first = agents.Runner.run_sync(agent, "Weather in Paris?", run_config=agents.RunConfig(tracing_disabled=True))
    assert (cities, first.final_output) == (["Paris"], "It is 18C.")
    second = gateway.requests[1]
    assert second["messages"][:2] == [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Weather in Paris?"}]
    assert second["messages"][2]["tool_calls"][0]["id"] == "call_a"
    assert json.loads(second["messages"][2]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert second["messages"][3] == {"role": "tool", "tool_call_id": "call_a", "content": "18C in Paris"}


# -- Anthropic Messages: requests


def test_messages_request_becomes_chat_request() -> None:
    body = {
        "model": MODEL, "max_tokens": 256,
        "system": [{"type": "text", "text": "You are a helper."},
                   {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris and Lyon?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Two calls.", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_b", "name": "get_weather", "input": {"_raw": "{city: Lyon"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_a", "content": "18C"},
                {"type": "tool_result", "tool_use_id": "toolu_b", "is_error": True,
                 "content": [{"type": "text", "text": "bad"}, {"type": "text", "text": "arguments"}]},
                {"type": "text", "text": "And tomorrow?"}, {"type": "text", "text": "Thanks."}]}],
        "tools": [ANTHROPIC_WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "stop_sequences": ["</answer>"], "stream": True,
        "thinking": {"type": "enabled", "budget_tokens": 1024}, "metadata": {"user_id": "u"}}
    assert messages_api.to_chat_request(body) == {
        "model": MODEL, "messages": [
            {"role": "system", "content": "You are a helper.\nBe brief."},
            {"role": "user", "content": "Weather in Paris and Lyon?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                tool_call("toolu_a", '{"city": "Paris"}'), tool_call("toolu_b", "{city: Lyon")]},
            {"role": "tool", "tool_call_id": "toolu_a", "content": "18C"},
            {"role": "tool", "tool_call_id": "toolu_b", "content": "Error: bad\narguments"},
            {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"},
                                         {"type": "text", "text": "Thanks."}]}],
        "max_tokens": 256, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "stop": ["</answer>"],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS,
                                                    "description": "Weather of a city"}}],
        "tool_choice": "required", "parallel_tool_calls": False, "stream": True,
        "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("choice, chat", [
    ({"type": "auto"}, {"tool_choice": "auto"}),
    ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "tool", "name": "get_weather"},
     {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
])
def test_messages_tool_choice(choice: dict, chat: dict) -> None:
    body = {"model": MODEL, "max_tokens": 8, "system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}],
            "tools": [ANTHROPIC_WEATHER], "tool_choice": choice}
    assert messages_api.to_chat_request(body) == {
        "model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 8, "tools": [{"type": "function", "function": {
            "name": "get_weather", "parameters": PARAMETERS, "description": "Weather of a city"}}], **chat}


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}


@pytest.mark.parametrize("extra, message", [
    ({"messages": [{"role": "user", "content": [IMAGE]}]},
     "messages[0].content[0]: blocks of type 'image' are not supported by lit's gateway"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "text", "text": "x"}, IMAGE]}]}]},
     "messages[0].content[0].content[1]: blocks of type 'image' are not supported"),
    ({"messages": [{"role": "assistant", "content": [{"type": "server_tool_use"}]}]},
     "messages[0].content[0]: blocks of type 'server_tool_use' are not supported"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role: 'system' is not a message role"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0]: tools of type 'web_search_20250305' are not supported"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice: tool choices 'sometimes' are not supported"),
    ({"system": [{"type": "image"}]}, "system[0]: must be a text block"),
    ({"output_config": {"format": {"type": "regex"}}}, "output_config.format: formats of type 'regex' are not"),
])
def test_messages_request_refused_names_the_field(extra: dict, message: str) -> None:
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **extra}
    with pytest.raises(TranslationError, match=re.escape(message)):
        messages_api.to_chat_request(body)


# -- Anthropic Messages: answers and streams


@pytest.mark.parametrize("finish, matched, calls, stop", [
    ("stop", None, [], ("end_turn", None)),
    ("stop", 151645, [], ("end_turn", None)),  # vLLM's stop_reason: a stop token id
    ("stop", "</answer>", [], ("stop_sequence", "</answer>")),
    ("length", None, [], ("max_tokens", None)),
    ("tool_calls", None, [tool_call("call_a", '{"city": "Paris"}')], ("tool_use", None)),
    ("length", None, [tool_call("call_a", '{"city": "Pa')], ("max_tokens", None)),
])
def test_messages_stop_reason(finish: str, matched: object, calls: list[dict], stop: tuple) -> None:
    body = {"model": MODEL, "max_tokens": 8, "messages": [], "stop_sequences": ["</answer>"]}
    message = messages_api.from_chat_response(chat_answer("Hi", calls, finish, matched), body, "msg_1")
    assert (message["stop_reason"], message["stop_sequence"]) == stop


def test_messages_answer_from_chat_completion_keeps_bad_arguments_raw() -> None:
    body = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Weather?"}]}
    calls = [tool_call("call_a", '{"city": "Paris"}'), tool_call("call_b", "{city: Lyon"),
             tool_call("call_c", '["Nice"]'), tool_call("call_d", "")]
    message = messages_api.from_chat_response(chat_answer("Checking.", calls, "tool_calls"), body, "msg_1")
    assert message == {
        "id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "stop_reason": "tool_use",
        "stop_sequence": None, "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "call_b", "name": "get_weather", "input": {"_raw": "{city: Lyon"}},
            {"type": "tool_use", "id": "call_c", "name": "get_weather", "input": {"_raw": '["Nice"]'}},
            {"type": "tool_use", "id": "call_d", "name": "get_weather", "input": {}}],
        "usage": {"input_tokens": 12, "output_tokens": 7, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 0}}
    # sent back, the conversation shows the model what it wrote
    again = messages_api.to_chat_request({**body, "messages": [*body["messages"], {
        "role": "assistant", "content": message["content"]}]})
    assert again["messages"][-1] == {"role": "assistant", "content": "Checking.", "tool_calls": calls[:3] + [
        tool_call("call_d", "{}")]}


def test_messages_stream_events() -> None:
    body = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Weather?"}], "stream": True}
    translator = messages_api.StreamTranslator(body, "msg_1")
    sent = [e for c in chat_chunks(["Let me ", "check."], TWO_CALLS, "tool_calls") for e in translator.feed(c)]
    sent += translator.finish()
    assert [(kind, data.get("index")) for kind, data in sent] == [
        ("message_start", None),
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2),
        ("message_delta", None), ("message_stop", None)]
    assert all(data["type"] == kind for kind, data in sent)
    assert sent[0][1]["message"]["content"] == [] and sent[0][1]["message"]["usage"]["input_tokens"] == 12
    assert sent[5][1]["content_block"] == {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {}}
    assert [data["delta"] for kind, data in sent if kind == "content_block_delta"] == [
        {"type": "text_delta", "text": "Let me "}, {"type": "text_delta", "text": "check."},
        {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'},
        {"type": "input_json_delta", "partial_json": '{"city": "Lyon"}'}]
    assert sent[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                           "usage": {"input_tokens": 12, "output_tokens": 7}}
    whole = messages_api.from_chat_response(chat_answer("Let me check.", TWO_CALLS_WHOLE, "tool_calls"), body,
                                            "msg_1")
    assert translator.response == whole


# -- Anthropic Messages: what Anthropic's client parses


def test_anthropic_client_parses_answer(gateway: SimpleNamespace) -> None:
    gateway.answers = [chat_answer("Bonjour.", stop_reason="</answer>", usage=(12, 3)),
                       chat_answer("Checking.", TWO_CALLS_WHOLE, "tool_calls")]
    message = gateway.anthropic.messages.create(
        model=MODEL, max_tokens=32, system="Be brief.", stop_sequences=["</answer>"],
        messages=[{"role": "user", "content": "Hello"}], extra_body={"temperature": 0.5, "top_k": 20},
        output_config={"effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}})
    assert gateway.requests[0] == {
        "model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        "max_tokens": 32, "temperature": 0.5, "top_k": 20, "stop": ["</answer>"],
        "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": {"type": "object"}}}}
    assert (message.id, message.content[0].text) == ("msg_1", "Bonjour.")
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "</answer>")
    assert (message.usage.input_tokens, message.usage.output_tokens) == (12, 3)
    called = gateway.anthropic.messages.create(model=MODEL, max_tokens=32, tools=[ANTHROPIC_WEATHER],
                                               messages=[{"role": "user", "content": "Weather?"}])
    assert called.stop_reason == "tool_use"
    assert [(b.type, b.id, b.name, b.input) for b in called.content[1:]] == [
        ("tool_use", "call_a", "get_weather", {"city": "Paris"}),
        ("tool_use", "call_b", "get_weather", {"city": "Lyon"})]


def test_anthropic_client_streams_tool_calls_split_over_chunks(gateway: SimpleNamespace) -> None:
    gateway.answers = [chat_chunks(["Let me ", "check."], TWO_CALLS, "tool_calls")]
    with gateway.anthropic.messages.stream(model=MODEL, max_tokens=64, tools=[ANTHROPIC_WEATHER],
                                           messages=[{"role": "user", "content": "Weather?"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert gateway.requests[0]["stream"] is True and gateway.requests[0]["stream_options"] == {"include_usage": True}
    assert (text, final.content[0].text, final.stop_reason) == ("Let me check.", "Let me check.", "tool_use")
    assert [(b.id, b.input) for b in final.content[1:]] == [("call_a", {"city": "Paris"}), ("call_b", {"city": "Lyon"})]
    assert (final.usage.input_tokens, final.usage.output_tokens) == (12, 7)
    assert final.to_dict()["content"] == gateway.streamed[0]["content"]


def test_anthropic_client_streams_a_call_cut_mid_arguments(gateway: SimpleNamespace) -> None:
    gateway.answers = [chat_chunks(["Checking."], [(0, "call_a", "get_weather", '{"city": '),
                                                   (0, None, None, '"Par')], "length", usage=None)]
    with gateway.anthropic.messages.stream(model=MODEL, max_tokens=3, tools=[ANTHROPIC_WEATHER],
                                           messages=[{"role": "user", "content": "Weather?"}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert final.content[1].input == {"_raw": '{"city": "Par'}
    assert (final.usage.input_tokens, final.usage.output_tokens) == (12, 3)  # counted from the stream's token ids


def test_anthropic_client_hears_what_is_refused(gateway: SimpleNamespace) -> None:
    with pytest.raises(anthropic.BadRequestError, match=re.escape("messages[0].content[1]: blocks of type 'image'")):
        gateway.anthropic.messages.create(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is it?"}, IMAGE]}])
    assert gateway.requests == []
