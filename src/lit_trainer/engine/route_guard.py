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

The guard also keeps the server's weight version, since vLLM's OpenAI responses do not carry it. It starts at
``"0"`` (the weights vLLM loaded) and takes the version of every ``POST /update_weight_version`` (``new_version``)
or ``/finish_weight_update`` (``weight_version``) it lets through that succeeds (a 2xx answer). Each non-streamed
``POST /v1/chat/completions`` or ``/v1/completions`` that succeeds as JSON gets a top-level field
``"lit_weight_version"``: the version when the request *arrived*; every answer of those routes, streamed ones
too, carries it in the ``X-Lit-Weight-Version`` header. That is the oldest weights any token of the call
can have been sampled with: a sync with ``in_flight = "keep"`` lets a running request go on with newer weights,
never older ones, so it is the conservative value for a staleness bound (and vLLM tags a version after loading its
weights, so the guard never sees it early). The bodies of streamed responses (``text/event-stream``) and errors,
and every other route, pass through untouched, and a response that cannot be tagged (not a JSON object,
compressed, cut short) goes out as the app wrote it. vLLM starts its engine at version ``"default"`` and has no
option to start elsewhere; the guard exists before the first request, so in vLLM's single API server process
(how lit starts it) it sees every update. With several API server processes (``--api-server-count``), each would
see only the updates sent to it.

Standard library only: the server copies this file into a private folder on vLLM's ``PYTHONPATH`` (as
``lit_route_guard``), so it also loads when vLLM runs from another environment (``InferenceConfig.python``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
from collections import deque

TOKEN_ENV = "LIT_ADMIN_TOKEN"
HEADER = "x-lit-admin-token"
AGENT_PREFIX = "/v1/"
AGENT_ROUTES = frozenset({"/health", "/ping", "/version", "/tokenize", "/detokenize"})
"""Read-only routes outside ``/v1/`` (``/tokenize``, ``/detokenize``: the chat template's tokens, no state)."""
ADMIN_UNDER_V1 = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
INITIAL_VERSION = "0"
"""The version of the weights vLLM loaded at start, to lit."""
VERSION_FIELD = "lit_weight_version"
"""The field the guard adds to the JSON of a completion: the server's weight version when the request arrived."""
VERSION_HEADER = "x-lit-weight-version"
"""The header with the same version, on every answer of a completion route, streamed ones included (lit's gateway
reads it: ``lit_trainer.intake.gateway.calls.VERSION_HEADER``)."""
TAGGED_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
VERSION_ROUTES = {"/update_weight_version": "new_version", "/finish_weight_update": "weight_version"}
"""vLLM's admin routes that set the engine's weight version, with the field of their JSON body that holds it."""

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
        self.weight_version = INITIAL_VERSION

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
            if scope["type"] == "http" and scope.get("method") == "POST":
                if path in TAGGED_ROUTES:
                    await self._tag_version(scope, receive, send)
                    return
                if path in VERSION_ROUTES:  # not an agent route: the admin token let it through
                    await self._track_version(scope, receive, send, VERSION_ROUTES[path])
                    return
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

    async def _track_version(self, scope, receive, send, field: str) -> None:
        """Pass an admin request that sets the weight version to the app, and take its version once it succeeds.
        The request body is read whole first (a few bytes, from the trainer) and replayed to the app as it came."""
        messages: deque = deque()
        body = b""
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client left: the app hears it too
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        version = _requested_version(body, field)

        async def replay():
            return messages.popleft() if messages else await receive()

        async def tracking_send(message) -> None:
            if (version is not None and message["type"] == "http.response.start"
                    and 200 <= message.get("status", 0) < 300):
                self.weight_version = version
            await send(message)

        await self.app(scope, replay, tracking_send)

    async def _tag_version(self, scope, receive, send) -> None:
        """Pass a completion request to the app and add ``VERSION_FIELD`` (the version now, at arrival) to its
        answer when that is a whole JSON object with status 200; anything else goes out as the app sent it."""
        version = self.weight_version
        held: list = []  # the response start and body messages, held back while they may be tagged
        passing = False

        async def tagging_send(message) -> None:
            nonlocal passing
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (VERSION_HEADER.encode(), version.encode())]}
            if passing:
                await send(message)
            elif not held:
                if message["type"] == "http.response.start" and _taggable(message):
                    held.append(message)
                else:
                    passing = True
                    await send(message)
            elif message["type"] == "http.response.body":
                held.append(message)
                if not message.get("more_body", False):
                    passing = True
                    tagged = _tagged(held, version)
                    await _send_all(send, held if tagged is None else tagged)
            else:  # something beyond start and body (trailers...): send it all as it came
                passing = True
                held.append(message)
                await _send_all(send, held)

        try:
            await self.app(scope, receive, tagging_send)
        except BaseException:
            if held and not passing:
                with contextlib.suppress(Exception):
                    await _send_all(send, held)  # what the client would have had without the guard
            raise
        if held and not passing:  # the app returned before its last body message
            await _send_all(send, held)


async def _send_all(send, messages: list) -> None:
    for message in messages:
        await send(message)


def _header(message, name: bytes) -> bytes | None:
    for key, value in message.get("headers", ()):
        if key.lower() == name:
            return value
    return None


def _taggable(start) -> bool:
    """A response start whose body may get the version: 200, JSON, not compressed."""
    content_type = _header(start, b"content-type") or b""
    return (start.get("status") == 200 and content_type.split(b";")[0].strip().lower() == b"application/json"
            and _header(start, b"content-encoding") is None)


def _tagged(held: list, version: str) -> tuple[dict, dict] | None:
    """The response start and one body message with ``VERSION_FIELD`` added to the body's JSON object, its other
    bytes as they were; None when the body is no JSON object or already has the field."""
    start, body = held[0], b"".join(m.get("body", b"") for m in held[1:])
    try:
        data = json.loads(body)
        if not isinstance(data, dict) or VERSION_FIELD in data:
            return None
        # A JSON object's text ends with "}": the field goes in before it, after a comma unless the object is empty.
        body = body.rstrip()[:-1] + f'{"," if data else ""}"{VERSION_FIELD}":{json.dumps(version)}}}'.encode()
        headers = [(k, str(len(body)).encode()) if k.lower() == b"content-length" else (k, v)
                   for k, v in start.get("headers", ())]
    except Exception:  # never break a response over a tag
        return None
    return {**start, "headers": headers}, {"type": "http.response.body", "body": body}


def _requested_version(body: bytes, field: str) -> str | None:
    """The version string in an admin request's JSON body, or None."""
    try:
        value = json.loads(body).get(field)
    except Exception:
        return None
    return value if isinstance(value, str) else None
