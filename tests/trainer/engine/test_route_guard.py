"""The route guard vLLM loads: agents (who hold the API key) reach the OpenAI routes and nothing that changes the
server; the trainer's admin token opens the rest. Checked as a plain ASGI app, and stacked into a FastAPI app by
vLLM's own middleware set-up (``init_entrypoints_middleware``, as ``--middleware`` and ``VLLM_API_KEY`` do), with
the module imported from the folder ``write_guard`` fills, as vLLM's process imports it. And the weight version it
keeps from the trainer's updates and adds to the completions' JSON answers. No vLLM server starts."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lit_trainer.engine import route_guard
from lit_trainer.engine.config import InferenceConfig
from lit_trainer.engine.launch import GUARD_MODULE, build_command, build_env, write_guard
from lit_trainer.engine.route_guard import HEADER, RouteGuard, is_agent_route

TOKEN = "admin-token-of-this-run"
ADMIN_ROUTES = ["/pause", "/resume", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version",
                "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/sleep", "/wake_up", "/start_profile",
                "/init_weight_transfer_engine", "/update_weights", "/metrics", "/docs", "/",
                "/v1/../collective_rpc", "//pause", "/v1//../pause", "/inference/v1/generate"]
AGENT_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/responses", "/health", "/ping",
                "/version", "/tokenize", "/detokenize"]


def _call(app, path: str, headers: dict[str, str] | None = None) -> tuple[int, bool]:
    """One HTTP request through ``RouteGuard(app)``: the status and whether the inner app saw it."""
    reached = []

    async def inner(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    asyncio.run(app(inner)(scope, receive, send))
    return sent[0]["status"], bool(reached)


def _guard(token: str | None):
    return lambda inner: RouteGuard(inner, token=token)


@pytest.mark.parametrize("path", AGENT_ROUTES)
def test_agents_reach_the_openai_routes_without_the_admin_token(path: str):
    assert is_agent_route(path)
    assert _call(_guard(TOKEN), path) == (200, True)


@pytest.mark.parametrize("path", ADMIN_ROUTES)
def test_routes_that_change_the_server_need_the_admin_token(path: str):
    assert not is_agent_route(path)
    assert _call(_guard(TOKEN), path) == (403, False)
    assert _call(_guard(TOKEN), path, {HEADER: "a-guess"}) == (403, False)
    assert _call(_guard(TOKEN), path, {"Authorization": f"Bearer {TOKEN}"}) == (403, False)  # not the API key
    assert _call(_guard(TOKEN), path, {HEADER: TOKEN}) == (200, True)


def test_without_a_token_every_admin_route_is_refused_and_counted():
    guard = RouteGuard(lambda *a: None, token="")
    for header in ({}, {HEADER: ""}, {HEADER: "anything"}):
        assert _call(lambda inner: guard, "/collective_rpc", header)[0] == 403
    assert guard.refused == 3


def test_the_guard_reads_its_token_from_the_environment_only(monkeypatch):
    monkeypatch.setenv(route_guard.TOKEN_ENV, TOKEN)
    assert _call(RouteGuard, "/pause", {HEADER: TOKEN}) == (200, True)
    monkeypatch.delenv(route_guard.TOKEN_ENV)
    assert _call(RouteGuard, "/pause", {HEADER: TOKEN}) == (403, False)


def test_the_command_loads_the_guard_and_the_secrets_stay_off_it(tmp_path: Path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    config = InferenceConfig(host="0.0.0.0", api_key="the-api-key", device="cpu", tool_call_parser="",
                             chat_template="model")
    cmd = build_command(config, tmp_path / "m", 8000, "python")
    assert cmd[cmd.index("--middleware") + 1] == f"{GUARD_MODULE}.RouteGuard"
    env = build_env(config, base={"PYTHONPATH": "/theirs", route_guard.TOKEN_ENV: "stale"}, admin_token=TOKEN,
                    private_dir=tmp_path / "guard")
    assert env[route_guard.TOKEN_ENV] == TOKEN and env["VLLM_API_KEY"] == "the-api-key"
    assert env["PYTHONPATH"] == f"{tmp_path / 'guard'}:/theirs"
    assert TOKEN not in " ".join(cmd) and "the-api-key" not in " ".join(cmd)
    # A token left in the trainer's environment never reaches a server started without one.
    assert route_guard.TOKEN_ENV not in build_env(config, base={route_guard.TOKEN_ENV: "stale"})


def test_the_guard_imports_from_its_folder_with_the_standard_library_only(tmp_path: Path):
    """What vLLM's process does with ``--middleware lit_route_guard.RouteGuard``, in a bare interpreter (-S: no
    site-packages, so neither lit nor starlette can be imported from there)."""
    write_guard(tmp_path)
    env = build_env(InferenceConfig(device="cpu"), base={}, admin_token=TOKEN, private_dir=tmp_path)
    code = ("import importlib, sys; m = importlib.import_module('lit_route_guard'); g = m.RouteGuard(None); "
            "print(m.__file__, g._digest is not None, 'lit_trainer' in sys.modules)")
    out = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(tmp_path / "lit_route_guard.py"), "True", "False"]


def _through_vllms_middleware(app):
    """A ``TestClient`` of ``app`` behind vLLM's own middleware stack: its API key (``the-api-key``) and lit's
    guard."""
    from starlette.testclient import TestClient
    from vllm.entrypoints.serve.middleware import register

    args = argparse.Namespace(allowed_origins=["*"], allow_credentials=False, allowed_methods=["*"],
                              allowed_headers=["*"], api_key=["the-api-key"], enable_request_id_headers=False,
                              middleware=[f"{GUARD_MODULE}.RouteGuard"])
    register.init_entrypoints_middleware(args, app, ())
    return TestClient(app)


def test_vllm_stacks_the_guard_with_its_api_key_so_agents_never_reach_weight_sync(vllm_modules, tmp_path: Path,
                                                                               monkeypatch):
    """vLLM's own middleware set-up, with the options lit's command line and environment give it."""
    from fastapi import FastAPI

    write_guard(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(route_guard.TOKEN_ENV, TOKEN)
    app = FastAPI()
    for route in ("/v1/completions", "/collective_rpc", "/pause", "/v1/load_lora_adapter"):
        app.post(route)(lambda: {"ok": True})
    app.get("/health")(lambda: {"ok": True})
    client = _through_vllms_middleware(app)
    agent = {"Authorization": "Bearer the-api-key"}
    trainer = {**agent, HEADER: TOKEN}
    assert client.post("/v1/completions", headers=agent).status_code == 200
    assert client.post("/v1/completions").status_code == 401  # vLLM's API key still guards /v1
    assert client.get("/health").status_code == 200
    for route in ("/collective_rpc", "/pause", "/v1/load_lora_adapter"):
        assert client.post(route, headers=agent).status_code == 403, route
        assert client.post(route, headers=trainer).status_code == 200, route
    assert client.post("/v1/load_lora_adapter", headers={HEADER: TOKEN}).status_code == 401  # needs both


# The weight version: kept from the trainer's updates, added to the JSON answers of the completion routes.

COMPLETION = b'{"id":"chatcmpl-1","choices":[{"index":0,"token_ids":[5,6]}],"usage":{"total_tokens":9}}'
JSON = [(b"content-type", b"application/json"), (b"x-request-id", b"r1")]


class _App:
    """A fake of vLLM behind the guard: it reads each request's body whole, then (once ``gate`` opens, when
    given) sends the scripted ``messages`` for that path, or a JSON completion."""

    def __init__(self, scripted: dict[str, list[dict]] | None = None, gate: asyncio.Event | None = None):
        self.scripted = scripted or {}
        self.gate = gate
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send):
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        self.bodies.append(body)
        if self.gate is not None:
            await self.gate.wait()
        for message in self.scripted.get(scope["path"], _answer(200, JSON, COMPLETION)):
            await send(message)


def _answer(status: int, headers: list, *chunks: bytes) -> list[dict]:
    """A response's messages: the start, then one body message per chunk (the last one ends it)."""
    length = (b"content-length", str(sum(map(len, chunks))).encode())
    body = [{"type": "http.response.body", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    return [{"type": "http.response.start", "status": status, "headers": [*headers, length]}, *body]


async def _request(guard: RouteGuard, path: str, *chunks: bytes, token: str | None = None) -> list[dict]:
    """One POST through the guard, its body sent in ``chunks``: every message the client got."""
    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    incoming = incoming or [{"type": "http.request", "body": b"", "more_body": False}]
    sent: list[dict] = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    headers = [(HEADER.encode(), token.encode())] if token else []
    await guard({"type": "http", "method": "POST", "path": path, "root_path": "", "headers": headers}, receive, send)
    return sent


def _post(guard: RouteGuard, path: str, *chunks: bytes, token: str | None = None) -> list[dict]:
    return asyncio.run(_request(guard, path, *chunks, token=token))


def _json(sent: list[dict]) -> dict:
    """The client's view of an answer: one start, then the body; its length matches its content-length."""
    start, *bodies = sent
    body = b"".join(m["body"] for m in bodies)
    assert dict(start["headers"])[b"content-length"] == str(len(body)).encode()
    return json.loads(body)


def test_the_version_starts_at_0_and_follows_the_admin_updates_that_succeed():
    update_refused = _answer(500, JSON, b'{"error":"no"}')
    app = _App({"/update_weight_version": _answer(200, JSON, b'{"success":true}')})
    guard = RouteGuard(app, token=TOKEN)
    assert guard.weight_version == "0"
    assert _json(_post(guard, "/v1/chat/completions"))[route_guard.VERSION_FIELD] == "0"

    sent = _post(guard, "/update_weight_version", b'{"new_ver', b'sion": "7"}', token=TOKEN)
    assert sent[0]["status"] == 200 and guard.weight_version == "7"
    assert app.bodies[-1] == b'{"new_version": "7"}', "the app gets the body the trainer sent, whole"

    assert _post(guard, "/update_weight_version", b'{"new_version": "8"}')[0]["status"] == 403  # no token
    assert app.bodies[-1] == b'{"new_version": "7"}' and guard.weight_version == "7"
    for body in (b'{"new_version": 8}', b'{"version": "8"}', b"not json", b'["8"]', b""):
        _post(guard, "/update_weight_version", body, token=TOKEN)
        assert guard.weight_version == "7", body
    app.scripted["/update_weight_version"] = update_refused  # vLLM could not set it
    _post(guard, "/update_weight_version", b'{"new_version": "8"}', token=TOKEN)
    assert guard.weight_version == "7"
    _post(guard, "/finish_weight_update", b'{"weight_version": "9"}', token=TOKEN)  # vLLM's other way to set it
    assert guard.weight_version == "9"
    assert _json(_post(guard, "/v1/completions"))[route_guard.VERSION_FIELD] == "9"


def test_a_completion_carries_the_version_it_arrived_under():
    """A request that arrives before an update and is answered after it may have been sampled (partly) with the
    old weights: it carries the old version."""

    async def scenario() -> tuple[list[dict], list[dict]]:
        gate = asyncio.Event()
        guard = RouteGuard(_App(gate=gate), token=TOKEN)
        slow = asyncio.create_task(_request(guard, "/v1/chat/completions", b'{"messages": []}'))
        await asyncio.sleep(0)  # it arrives and waits for the engine
        update = asyncio.create_task(_request(guard, "/update_weight_version", b'{"new_version": "3"}', token=TOKEN))
        await asyncio.sleep(0)
        gate.set()
        await update
        assert guard.weight_version == "3"
        return await slow, await _request(guard, "/v1/chat/completions")

    old, new = asyncio.run(scenario())
    assert _json(old)[route_guard.VERSION_FIELD] == "0"
    assert _json(new)[route_guard.VERSION_FIELD] == "3"


def test_the_field_is_added_to_the_body_as_it_was_and_the_length_fixed():
    chunks = (b'{"id":"cmpl-1",', b'"choices":[{"text":"\xc3\xa9"}]}', b"\n")
    guard = RouteGuard(_App({"/v1/completions": _answer(200, [(b"Content-Type", b"application/json")], *chunks)}))
    start, body = _post(guard, "/v1/completions", b'{"prompt": "x"}')
    tagged = b'{"id":"cmpl-1","choices":[{"text":"\xc3\xa9"}],"lit_weight_version":"0"}'
    assert body == {"type": "http.response.body", "body": tagged}
    assert start["headers"] == [(b"Content-Type", b"application/json"), (b"content-length", str(len(tagged)).encode()),
                                (route_guard.VERSION_HEADER.encode(), b"0")]
    empty = RouteGuard(_App({"/v1/completions": _answer(200, JSON, b"{ }")}))
    assert _json(_post(empty, "/v1/completions")) == {"lit_weight_version": "0"}


STREAM = [(b"content-type", b"text/event-stream; charset=utf-8")]


@pytest.mark.parametrize(("path", "answer"), [
    ("/v1/chat/completions", _answer(200, STREAM, b'data: {"id":"c"}\n\n', b"data: [DONE]\n\n")),
    ("/v1/completions", _answer(200, STREAM, b'data: {"id":"c"}\n\n', b"data: [DONE]\n\n")),
    ("/v1/chat/completions", _answer(400, JSON, b'{"error":{"message":"bad request"}}')),
    ("/v1/chat/completions", _answer(200, [(b"content-type", b"text/plain")], b'{"id":"c"}')),
    ("/v1/chat/completions", _answer(200, [*JSON, (b"content-encoding", b"gzip")], b"\x1f\x8b\x08")),
    ("/v1/chat/completions", _answer(200, JSON, b'{"id": "c", ')),  # malformed
    ("/v1/chat/completions", _answer(200, JSON, b"not json at all")),
    ("/v1/chat/completions", _answer(200, JSON, b'[{"id": "c"}]')),  # JSON, not an object
    ("/v1/chat/completions", _answer(200, JSON, b'{"lit_weight_version": "engine"}')),  # already there
    ("/v1/chat/completions", _answer(200, JSON, b'{"id":', b'"c"}')[:2]),  # the app stops before its last chunk
    ("/v1/models", _answer(200, JSON, b'{"object":"list","data":[]}')),
    ("/v1/responses", _answer(200, JSON, b'{"id":"resp-1"}')),
    ("/tokenize", _answer(200, JSON, b'{"tokens":[1,2]}')),
])
def test_other_answers_pass_through_unchanged(path: str, answer: list[dict]):
    """Their bodies are the app's own messages; a completion route's answer (streamed, an error...) only gets the
    version header (lit's gateway reads it off streamed answers)."""
    sent = _post(RouteGuard(_App({path: answer})), path, b'{"stream": true}')
    if path in route_guard.TAGGED_ROUTES:
        start, *rest = answer
        version = (route_guard.VERSION_HEADER.encode(), b"0")
        assert sent[0] == {**start, "headers": [*start["headers"], version]}
        sent, answer = sent[1:], rest
    assert sent == answer
    assert all(a is b for a, b in zip(sent, answer, strict=True)), "the app's own messages, not copies"


def test_an_answer_the_app_breaks_off_reaches_the_client_as_far_as_it_got():
    start, first = _answer(200, JSON, b'{"id":', b'"c"}')[:2]

    async def app(scope, receive, send):
        await send(start)
        await send(first)
        raise RuntimeError("the engine died")

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "root_path": "", "headers": []}
    with pytest.raises(RuntimeError, match="the engine died"):
        asyncio.run(RouteGuard(app)(scope, receive, send))
    assert sent == [{**start, "headers": [*start["headers"], (route_guard.VERSION_HEADER.encode(), b"0")]}, first]


def test_vllm_answers_through_its_middleware_stack_carry_the_version(vllm_modules, tmp_path: Path, monkeypatch):
    """vLLM's JSONResponse and its API-key middleware around the guard, through a real HTTP client (which checks
    the content-length): the field arrives, and the openai client keeps it among its extra fields."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from openai import OpenAI

    from lit_sdk.openai_instrumentor import ENGINE_VERSION_FIELD

    assert ENGINE_VERSION_FIELD == route_guard.VERSION_FIELD
    write_guard(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(route_guard.TOKEN_ENV, TOKEN)
    app = FastAPI()
    answer = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "é"}, "finish_reason": "stop"}]}
    app.post("/v1/chat/completions")(lambda: JSONResponse(answer))
    app.post("/update_weight_version")(lambda: JSONResponse({"success": True}))
    client = _through_vllms_middleware(app)
    agent = {"Authorization": "Bearer the-api-key"}
    assert client.post("/v1/chat/completions", headers=agent).json() == {**answer, "lit_weight_version": "0"}
    assert client.post("/v1/chat/completions").status_code == 401  # refused by the API key: untouched
    client.post("/update_weight_version", json={"new_version": "12"}, headers={**agent, HEADER: TOKEN})
    openai = OpenAI(base_url="http://testserver/v1", api_key="the-api-key", http_client=client)
    response = openai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert response.model_extra == {"lit_weight_version": "12"}
