"""The vLLM API key and the admin token from the trainer's side: the key comes from the config or a private file
(``lit keys generate``'s ``api_key``), and ``InferenceServer`` hands the key to agents and both to ``WeightSync``
and the logprob check. End to end against a stand-in for vLLM (a Starlette app under uvicorn, started by
``InferenceServer`` through a fake interpreter, loading ``--middleware`` as vLLM does); no vLLM server starts."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import requests

from lit_sdk.protocol.security import SecurityError, generate_keys, read_api_key
from lit_trainer.engine.config import InferenceConfig, WeightSyncConfig
from lit_trainer.engine.launch import resolve_api_key, vllm_python
from lit_trainer.engine.logprob_check import sample_from_vllm
from lit_trainer.engine.route_guard import HEADER
from lit_trainer.engine.server import InferenceServer
from lit_trainer.engine.weight_sync import WeightSync, WeightSyncError

STAND_IN = textwrap.dedent(
    """
    import argparse, importlib, os
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    parser = argparse.ArgumentParser()
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--middleware", action="append", default=[])
    args, _ = parser.parse_known_args()

    async def completions(request):
        prompts = (await request.json())["prompt"]
        return JSONResponse({"choices": [{"index": i, "token_ids": [7, 8], "logprobs": {"token_logprobs": [-0.5, -1.0]}}
                                         for i in range(len(prompts))]})

    async def ok(request):
        return JSONResponse({"success": True})

    routes = [Route("/health", ok), Route("/v1/completions", completions, methods=["POST"])]
    routes += [Route(r, ok, methods=["POST"]) for r in ("/pause", "/resume", "/collective_rpc", "/reset_prefix_cache",
                                                         "/update_weight_version")]
    app = Starlette(routes=routes)

    class ApiKey:  # vLLM's AuthenticationMiddleware, in short: VLLM_API_KEY guards /v1
        def __init__(self, app):
            self.app, self.key = app, os.environ.get("VLLM_API_KEY")

        async def __call__(self, scope, receive, send):
            headers = dict(scope.get("headers", ()))
            if (scope["type"] == "http" and self.key and scope["path"].startswith("/v1")
                    and headers.get(b"authorization") != f"Bearer {self.key}".encode()):
                return await JSONResponse({"error": "Unauthorized"}, 401)(scope, receive, send)
            await self.app(scope, receive, send)

    app.add_middleware(ApiKey)
    for path in args.middleware:  # as vLLM's init_entrypoints_middleware does
        module, name = path.rsplit(".", 1)
        app.add_middleware(getattr(importlib.import_module(module), name))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    """
)


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    generate_keys(tmp_path / "keys")
    return tmp_path / "keys"


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    """A 'python' that answers lit's import probe with the real one and runs the stand-in as the server."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    python = tmp_path / "fake-python"
    probes = vllm_python(InferenceConfig())  # lit's checks for vLLM (-c) go to the real vLLM's environment
    python.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then exec {probes} "$@"; fi\n'
                      f'exec {sys.executable} {tmp_path / "stand_in.py"} "$@"\n')
    python.chmod(0o755)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return python


def test_the_key_comes_from_the_config_or_a_private_file(keys_dir: Path):
    key = read_api_key(keys_dir / "api_key")
    assert resolve_api_key(InferenceConfig()) is None
    assert resolve_api_key(InferenceConfig(api_key_file=str(keys_dir / "api_key"))) == key
    assert resolve_api_key(InferenceConfig(api_key="inline", api_key_file=str(keys_dir / "api_key"))) == "inline"
    assert InferenceConfig(host="0.0.0.0", api_key_file=str(keys_dir / "api_key")).host == "0.0.0.0"
    (keys_dir / "api_key").chmod(0o644)
    with pytest.raises(SecurityError, match="chmod 600"):
        resolve_api_key(InferenceConfig(api_key_file=str(keys_dir / "api_key")))


def test_a_non_loopback_server_without_a_key_says_how_to_make_one():
    with pytest.raises(ValueError, match=r"inference.api_key .*lit keys generate.*\[security\] keys_dir"):
        InferenceConfig(host="0.0.0.0")


def test_the_key_reaches_agents_weight_sync_and_the_logprob_check_but_the_token_only_the_trainer(
        stand_in: Path, keys_dir: Path, tmp_path: Path):
    config = InferenceConfig(model=str(tmp_path / "model"), python=str(stand_in), log_dir=str(tmp_path),
                             api_key_file=str(keys_dir / "api_key"), startup_timeout_s=60)
    key = read_api_key(keys_dir / "api_key")
    with InferenceServer(config) as server:
        assert server.api_key == key  # what services.llm() puts in the agents' lit.LLM
        agent = {"Authorization": f"Bearer {key}"}
        body = {"model": "policy", "prompt": [[1, 2]]}
        assert requests.post(f"{server.openai_url}/completions", json=body, headers=agent, timeout=10).ok
        for route in ("/collective_rpc", "/pause"):  # an agent holds the API key, never the admin token
            assert requests.post(f"{server.base_url}{route}", json={}, headers=agent, timeout=10).status_code == 403
        assert server.credentials.api_key == key and server.credentials.admin_token not in server.log_path.read_text()

        # The trainer's side: the server's credentials, handed over as arguments (no registry of them).
        samples = sample_from_vllm(server.base_url, "policy", [[1, 2], [3]], api_key=server.api_key)
        assert [s.response_ids for s in samples] == [[7, 8], [7, 8]]
        with WeightSync(server.base_url, WeightSyncConfig(shm_dir=str(tmp_path)),
                        credentials=server.credentials) as sync:
            assert sync.rpc("reload_weights") == {"success": True}
            assert sync.session.headers[HEADER] == server.credentials.admin_token
        with pytest.raises(RuntimeError, match="HTTP 401"):
            sample_from_vllm(server.base_url, "policy", [[1]], api_key="a-wrong-key")
        with pytest.raises(RuntimeError, match="HTTP 401"):
            sample_from_vllm(server.base_url, "policy", [[1]])  # no key given, none sent


def test_weight_sync_without_the_token_is_refused(stand_in: Path, tmp_path: Path):
    config = InferenceConfig(model=str(tmp_path / "model"), python=str(stand_in), log_dir=str(tmp_path),
                             startup_timeout_s=60)
    with InferenceServer(config) as server:
        with WeightSync(server.base_url, WeightSyncConfig(shm_dir=str(tmp_path))) as sync:  # no credentials
            with pytest.raises(WeightSyncError, match="403"):
                sync.rpc("reload_weights")
