"""The route guard vLLM loads: agents (who hold the API key) reach the OpenAI routes and nothing that changes the
server; the trainer's admin token opens the rest. Checked as a plain ASGI app, and stacked into a FastAPI app by
vLLM's own middleware set-up (``init_entrypoints_middleware``, as ``--middleware`` and ``VLLM_API_KEY`` do), with
the module imported from the folder ``write_guard`` fills, as vLLM's process imports it. No vLLM server starts."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from lit_trainer.engine import route_guard
from lit_trainer.engine.config import InferenceConfig
from lit_trainer.engine.route_guard import HEADER, RouteGuard, is_agent_route
from lit_trainer.engine.server import GUARD_MODULE, build_command, build_env, write_guard

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
                    guard_dir=tmp_path / "guard")
    assert env[route_guard.TOKEN_ENV] == TOKEN and env["VLLM_API_KEY"] == "the-api-key"
    assert env["PYTHONPATH"] == f"{tmp_path / 'guard'}:/theirs"
    assert TOKEN not in " ".join(cmd) and "the-api-key" not in " ".join(cmd)
    # A token left in the trainer's environment never reaches a server started without one.
    assert route_guard.TOKEN_ENV not in build_env(config, base={route_guard.TOKEN_ENV: "stale"})


def test_the_guard_imports_from_its_folder_with_the_standard_library_only(tmp_path: Path):
    """What vLLM's process does with ``--middleware lit_route_guard.RouteGuard``, in a bare interpreter (-S: no
    site-packages, so neither lit nor starlette can be imported from there)."""
    write_guard(tmp_path)
    env = build_env(InferenceConfig(device="cpu"), base={}, admin_token=TOKEN, guard_dir=tmp_path)
    code = ("import importlib, sys; m = importlib.import_module('lit_route_guard'); g = m.RouteGuard(None); "
            "print(m.__file__, g._digest is not None, 'lit_trainer' in sys.modules)")
    out = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(tmp_path / "lit_route_guard.py"), "True", "False"]


def test_vllm_stacks_the_guard_with_its_api_key_so_agents_never_reach_weight_sync(tmp_path: Path, monkeypatch):
    """vLLM's own middleware set-up, with the options lit's command line and environment give it."""
    register = pytest.importorskip("vllm.entrypoints.serve.middleware.register")
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    write_guard(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(route_guard.TOKEN_ENV, TOKEN)
    app = FastAPI()
    for route in ("/v1/completions", "/collective_rpc", "/pause", "/v1/load_lora_adapter"):
        app.post(route)(lambda: {"ok": True})
    app.get("/health")(lambda: {"ok": True})
    args = argparse.Namespace(allowed_origins=["*"], allow_credentials=False, allowed_methods=["*"],
                              allowed_headers=["*"], api_key=["the-api-key"], enable_request_id_headers=False,
                              middleware=[f"{GUARD_MODULE}.RouteGuard"])
    register.init_entrypoints_middleware(args, app, ())
    client = TestClient(app)
    agent = {"Authorization": "Bearer the-api-key"}
    trainer = {**agent, HEADER: TOKEN}
    assert client.post("/v1/completions", headers=agent).status_code == 200
    assert client.post("/v1/completions").status_code == 401  # vLLM's API key still guards /v1
    assert client.get("/health").status_code == 200
    for route in ("/collective_rpc", "/pause", "/v1/load_lora_adapter"):
        assert client.post(route, headers=agent).status_code == 403, route
        assert client.post(route, headers=trainer).status_code == 200, route
    assert client.post("/v1/load_lora_adapter", headers={HEADER: TOKEN}).status_code == 401  # needs both
