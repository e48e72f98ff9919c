"""An ASGI middleware that vLLM loads (``--middleware lit_route_guard.RouteGuard``) so that only the trainer reaches
the routes that change the server: weight sync (``/pause``, ``/resume``, ``/collective_rpc``,
``/reset_prefix_cache``, ``/update_weight_version``, ...), LoRA loading, sleep, profiling, everything of vLLM's
dev mode.

vLLM's API key (``VLLM_API_KEY``) guards only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``, and agents hold it
(they need it for ``/v1``), so it cannot protect those routes. Here the rule is deny by default: agents may reach
the OpenAI routes under ``/v1/`` (except ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``) and the
read-only ``AGENT_ROUTES``; every other request must carry the run's admin token in the ``X-Lit-Admin-Token``
header. The token is drawn afresh for every server start, reaches vLLM through the
environment (``LIT_ADMIN_TOKEN``, never its command line) and the trainer's ``WeightSync``, never an agent. With no
token in the environment, every admin request is refused. A refused request gets 403 and is counted and logged
once per route (in vLLM's log).

Standard library only: the server copies this file into a private folder on vLLM's ``PYTHONPATH`` (as
``lit_route_guard``), so it also loads when vLLM runs from another environment (``InferenceConfig.python``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os

TOKEN_ENV = "LIT_ADMIN_TOKEN"
HEADER = "x-lit-admin-token"
AGENT_PREFIX = "/v1/"
AGENT_ROUTES = frozenset({"/health", "/ping", "/version", "/tokenize", "/detokenize"})
"""Read-only routes outside ``/v1/`` (``/tokenize``, ``/detokenize``: the chat template's tokens, no state)."""
ADMIN_UNDER_V1 = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})

log = logging.getLogger("lit.route_guard")


def is_agent_route(path: str) -> bool:
    """True for the routes an agent may call without the admin token."""
    if "//" in path or any(part in (".", "..") for part in path.split("/")):
        return False  # no route of an agent looks like that: keep tricks with the router away from it
    if path in AGENT_ROUTES:
        return True
    return path.startswith(AGENT_PREFIX) and path.rstrip("/") not in ADMIN_UNDER_V1


class RouteGuard:
    """Pure ASGI middleware (as vLLM's own ``AuthenticationMiddleware``); see the module docstring."""

    def __init__(self, app, token: str | None = None) -> None:
        self.app = app
        token = os.environ.get(TOKEN_ENV, "") if token is None else token
        self._digest = hashlib.sha256(token.encode()).digest() if token else None
        self.refused = 0
        self._logged: set[str] = set()

    def _admin(self, scope) -> bool:
        if self._digest is None:
            return False
        for name, value in scope.get("headers", ()):
            if name.lower() == HEADER.encode():
                return hmac.compare_digest(hashlib.sha256(value).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if is_agent_route(path) or self._admin(scope):
            await self.app(scope, receive, send)
            return
        self.refused += 1
        if path not in self._logged and len(self._logged) < 100:
            self._logged.add(path)
            log.warning("lit: refused %s %s without the admin token (%d refused so far; logged once per route)",
                        scope.get("method", "WEBSOCKET"), path, self.refused)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": f"{path} is reserved for the lit trainer"}).encode()
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
