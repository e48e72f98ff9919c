"""lit's gateway: the HTTP front of the vLLM servers that agents call during a rollout, where lit records every LLM
call itself, whatever the client, its language or the API (docs/tracing.md, docs/protocol.md "The rollout URL").

The dispatcher hands each attempt its own base URL (``Gateway.rollout_url``)::

    http://HOST:PORT/rollouts/<rollout id>/<attempt secret>/<server>/v1

Under it, ``POST chat/completions`` and ``completions`` go to vLLM with ``return_token_ids`` and logprobs added,
and come back as vLLM answered; ``POST responses`` (OpenAI's Responses API) and ``messages`` (Anthropic's) are
translated into a chat call and back (``responses_api``, ``messages_api``); streamed or not. Any other route
(``GET models``...) is forwarded and not recorded. Each call becomes a ``lit.engine.call`` span of the attempt
(``calls.Call.record``), queued for the store's thread *before* the answer's last bytes go out and written in
order, so that ``settle()``, called once the agents are done, finds every call of theirs stored (the write is off
the answer's path: an fsync per call would double the gateway's cost). A role name may come with a call in the
``X-Lit-Agent`` header, and the SDK sends its own span's id in ``X-Lit-Call`` (the episode builder then merges
the two into one transition).

A rollout URL may name a teacher instead of a vLLM server (``teachers``: an OpenAI-compatible API lit does not
train, a stronger model whose rollouts become demonstrations, ``rollouts/teacher.py``): its calls go there as the
client asked, without lit's additions (``calls.LIT_ADDITIONS``), with the teacher's own API key from the trainer's
environment in place of whatever key the client sent (the key never reaches a worker), streamed or not, and are
recorded with their chat request and answer (no ids come back).

A program may also post rewards to ``<its base URL without /v1>/reward`` (``{"value": 1.0, "name": "tests"}``),
recorded as ``lit.engine.reward`` spans: the rollout's rewards, at the time they arrived.

Trust (the trainer trusts nothing it did not hand out): a call under a rollout the store does not hold, with a
wrong secret, or under an attempt that has ended (``end``) is refused (403, 410) and recorded nowhere (a call under
way when its attempt ends is its attempt's, and recorded as such); an attempt's calls
share its part of the store (``admission.MAX_ROLLOUT_SPANS`` calls, ``MAX_ROLLOUT_BYTES`` bytes: 429 past it); a
client that leaves mid-stream leaves a call marked cut (error status), never trained as complete. Refusals are
counted by kind (``Gateway.refused``) and logged once per kind.

One background thread runs the asyncio loop (aiohttp's server and client); the store is written from one thread of
its own. ``check()`` re-raises, in the caller, an error that stopped the thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import quote

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

from lit_trainer.intake import admission
from lit_trainer.intake.gateway import calls, messages_api, responses_api
from lit_trainer.intake.gateway.responses_api import TranslationError
from lit_trainer.intake.rows import RolloutStatus, Store

log = logging.getLogger("lit")

PREFIX = "/rollouts"
RECORDED = {"chat/completions": "chat", "completions": "completion", "responses": "responses", "messages": "messages"}
"""The routes under ``/v1/`` whose calls are recorded, with the API each is."""
TRANSLATED = {"responses": responses_api, "messages": messages_api}
AGENT_HEADER = "X-Lit-Agent"
CALL_HEADER = "X-Lit-Call"
_FORWARDED = ("authorization", "content-type", "accept")
_HISTORY = 4096
"""Responses kept for ``previous_response_id`` (all rollouts together; the oldest go first)."""
_USAGE = 100_000
"""Attempts whose share of the store is tracked in memory (the oldest go first)."""
_JOIN_S = 10.0

EXPLAINED = {
    "unknown_rollout": "a call under a rollout this trainer did not hand out",
    "wrong_secret": "a call under a rollout's URL with a secret other than its attempt's",
    "ended_rollout": "a call under an attempt that had already ended (timed out, retried, or done)",
    "too_many_calls": "a call past the attempt's share of the store",
    "bad_request": "a request body that is not a JSON object, or that the gateway cannot translate",
}
"""The kinds of refused call, in ``Gateway.refused``, in words."""


class GatewayError(RuntimeError):
    """The gateway cannot listen, or its thread stopped on an error."""


class Refused(Exception):
    def __init__(self, kind: str, status: int, message: str):
        super().__init__(message)
        self.kind, self.status = kind, status


class Gateway:
    """``with Gateway(store, [server.openai_url, ...], host) as gateway: ...``; see the module docstring.
    ``teachers``: ``(base URL, name of the environment variable holding its API key, or "")`` of each teacher a
    rollout URL may name (``rollout_url``) beside the vLLM servers ``upstreams``. ``routes``: with a ``[roles]``
    table, the served model of each agent's calls (agent name -> model, from ``AGENT_HEADER``); a call of an agent
    it does not name goes to ``base_model``. The request's own ``model`` is replaced: an agent cannot pick an adapter
    lit did not give it."""

    def __init__(self, store: Store, upstreams: Sequence[str], host: str = "127.0.0.1", port: int = 0, *,
                 teachers: Sequence[tuple[str, str]] = (), routes: Mapping[str, str] | None = None,
                 base_model: str = ""):
        self.store = store
        self.routes, self.base_model = routes, base_model
        self.upstreams = [u.rstrip("/") for u in upstreams] + [url.rstrip("/") for url, _ in teachers]
        self._teacher_env = {url.rstrip("/"): env for url, env in teachers}
        self._teacher_headers: dict[str, dict[str, str]] = {}
        """Each teacher's headers besides the request's content type: its key, read from the environment at start."""
        self.host, self.port = host, port
        self.refused: dict[str, int] = {}
        self.recorded = 0
        self._history: OrderedDict[tuple[str, str], list[dict]] = OrderedDict()
        self._usage: OrderedDict[str, list[int]] = OrderedDict()
        self._admitted: OrderedDict[str, str] = OrderedDict()
        """The running attempts seen so far, with their secrets; ``end`` takes one out, and its next call finds in
        the store that it ended."""
        self._db = ThreadPoolExecutor(1, thread_name_prefix="lit-gateway-store")
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    # -- life -----------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def rollout_url(self, upstream: str, rollout_id: str, secret: str) -> str:
        """The base URL an attempt's agent calls (``/v1`` at its end, as OpenAI clients expect): its calls go to
        ``upstream`` (one of this gateway's vLLM servers, or teachers) and are recorded under the attempt."""
        server = self.upstreams.index(upstream.rstrip("/"))
        return f"{self.url}{PREFIX}/{quote(rollout_id, safe='')}/{quote(secret, safe='')}/{server}/v1"

    def start(self) -> Gateway:
        """Listen; GatewayError naming the variable when a teacher's API key is not in the environment."""
        for url, env in self._teacher_env.items():
            if env and not os.environ.get(env):
                raise GatewayError(f"the teacher at {url} takes its API key from the environment variable {env}, "
                                   f"which is not set: export {env}=<its key> before the run starts")
            # identity: the answer is read as JSON here, and the session does not decompress (auto_decompress)
            self._teacher_headers[url] = {"Accept-Encoding": "identity",
                                          **({"Authorization": f"Bearer {os.environ[env]}"} if env else {})}
        self._thread = threading.Thread(target=self._serve, name="lit-gateway", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise GatewayError(f"lit's gateway cannot listen on {self.host}:{self.port}: {self._error}")
        return self

    def stop(self) -> None:
        """Idempotent; also after the thread stopped on an error (its loop is closed then)."""
        self._wake()
        if self._thread is not None:
            self._thread.join(_JOIN_S)
        self._db.shutdown(wait=True)

    def check(self) -> None:
        """Raise ``GatewayError`` when the gateway's thread stopped on an error."""
        if self._error is not None or (self._thread is not None and not self._thread.is_alive()):
            raise GatewayError(f"lit's gateway stopped: {self._error or 'its thread ended'}")

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _serve(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # carried to the caller by start() or check()
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        app = web.Application(client_max_size=admission.MAX_ROLLOUT_BYTES)
        app.router.add_route("*", PREFIX + "/{rollout}/{secret}/{server}/v1/{route:.*}", self._handle)
        app.router.add_post(PREFIX + "/{rollout}/{secret}/{server}/reward", self._reward)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        self.session = ClientSession(connector=TCPConnector(limit=0), timeout=ClientTimeout(total=None),
                                     auto_decompress=False)
        try:
            site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self._ready.set()
            await self._stopping.wait()
        finally:
            await runner.cleanup()
            await self.session.close()

    # -- one call -------------------------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        info = request.match_info
        route = info["route"].rstrip("/")
        try:
            upstream = self.upstreams[int(info["server"])]
        except (ValueError, IndexError):
            return _error(404, f"no server {info['server']!r} behind lit's gateway")
        try:
            await self._admit(info["rollout"], info["secret"])
            if request.method != "POST" or route not in RECORDED:
                return await self._forward(request, f"{upstream}/{route}", upstream)
            body = await request.json(loads=json.loads)
            if not isinstance(body, dict):
                raise Refused("bad_request", 400, "the request body must be a JSON object")
            if self.routes is not None and upstream not in self._teacher_env:
                body["model"] = self.routes.get(_agent_of(request) or "", self.base_model)
            call = calls.Call(RECORDED[route], info["rollout"], body, _agent_of(request),
                              _call_id_of(request.headers.get(CALL_HEADER)), upstream in self._teacher_env)
            headers = self._headers(request, upstream)
            if call.api in TRANSLATED:
                return await self._translated(request, call, f"{upstream}/chat/completions", headers)
            return await self._recorded(request, call, f"{upstream}/{route}", headers)
        except Refused as refused:
            self._count(refused.kind)
            return _error(refused.status, str(refused))
        except json.JSONDecodeError as exc:
            self._count("bad_request")
            return _error(400, f"the request body is not JSON: {exc}")

    async def _reward(self, request: web.Request) -> web.Response:
        """``POST <rollout URL without /v1>/reward {"value": 1.0, "name": "tests"}``: a reward of the rollout, for
        a program that gives one before its last line (``calls.reward_record``)."""
        info = request.match_info
        try:
            await self._admit(info["rollout"], info["secret"])
            body = await request.json(loads=json.loads)
            record = calls.reward_record(info["rollout"], body)
        except Refused as refused:
            self._count(refused.kind)
            return _error(refused.status, str(refused))
        except (ValueError, TypeError) as exc:  # not JSON, or not a reward
            self._count("bad_request")
            return _error(400, f"lit's gateway: {exc}")
        self._queue(record)
        return web.json_response({"recorded": True})

    async def _admit(self, rollout_id: str, secret: str) -> None:
        known = self._admitted.get(rollout_id)
        if known is None:  # the first call of an attempt: the store says whether it was handed out, and is running
            row = await asyncio.get_running_loop().run_in_executor(self._db, self.store.get_rollout, rollout_id)
            if row is None:
                raise Refused("unknown_rollout", 403, f"lit's gateway: no rollout {rollout_id!r} was handed out")
            if row.status in (RolloutStatus.QUEUED, RolloutStatus.RUNNING) and row.secret is not None:
                self._admitted[rollout_id] = known = row.secret
                while len(self._admitted) > _USAGE:
                    self._admitted.popitem(last=False)
            elif row.secret is not None and hmac.compare_digest(row.secret.encode(), secret.encode()):
                raise Refused("ended_rollout", 410, f"lit's gateway: rollout {rollout_id!r} has ended "
                                                    f"({row.status.value}); its agent should stop")
        if known is None or not hmac.compare_digest(known.encode(), secret.encode()):
            raise Refused("wrong_secret", 403, f"lit's gateway: wrong secret for rollout {rollout_id!r}")
        used = self._usage.get(rollout_id, (0, 0))
        if used[0] >= admission.MAX_ROLLOUT_SPANS or used[1] >= admission.MAX_ROLLOUT_BYTES:
            raise Refused("too_many_calls", 429, f"lit's gateway: rollout {rollout_id!r} made more calls than one "
                                                 "episode can hold")

    def _headers(self, request: web.Request, upstream: str) -> dict[str, str]:
        """The headers a call takes to ``upstream``: the client's for vLLM; for a teacher, its own key in place of
        the client's (which is vLLM's, not to be sent out)."""
        if upstream not in self._teacher_env:
            return _upstream_headers(request)
        return {**{k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")},
                **self._teacher_headers[upstream]}

    async def _forward(self, request: web.Request, url: str, upstream_url: str) -> web.StreamResponse:
        """A route lit does not record: passed to the upstream and back as it is."""
        data = await request.read()
        async with self.session.request(request.method, url, data=data, headers=self._headers(request, upstream_url),
                                        params=request.query) as upstream:
            body = await upstream.read()
            return web.Response(status=upstream.status, body=body,
                                content_type=upstream.content_type or "application/json")

    async def _recorded(self, request: web.Request, call: calls.Call, url: str, headers: dict[str, str]
                        ) -> web.StreamResponse:
        """Chat and text completions: vLLM's own answer, with the token ids recorded on the way."""
        async with self.session.post(url, json=call.engine_body(call.body), headers=headers) as upstream:
            call.weight_version = upstream.headers.get(calls.VERSION_HEADER)
            if upstream.status != 200 or not call.streamed:
                body = await upstream.read()
                if upstream.status == 200:
                    call.take_answer(json.loads(body))
                    self._store(call)
                return web.Response(status=upstream.status, body=body,
                                    content_type=upstream.content_type or "application/json")
            return await self._relay(request, upstream, call, lambda line, chunk: line)

    async def _translated(self, request: web.Request, call: calls.Call, url: str, headers: dict[str, str]
                          ) -> web.StreamResponse:
        """The Responses API and Anthropic's Messages: a chat call to vLLM, answered in the client's API."""
        api = TRANSLATED[call.api]
        history = self._history.get((call.rollout_id, call.body.get("previous_response_id") or ""))
        if call.api == "responses" and call.body.get("previous_response_id") and history is None:
            raise Refused("bad_request", 404, f"lit's gateway: no response {call.body['previous_response_id']!r} "
                                              "in this rollout")
        try:
            chat = api.to_chat_request(call.body, history) if call.api == "responses" else \
                api.to_chat_request(call.body)
        except TranslationError as exc:
            raise Refused("bad_request", 400, f"lit's gateway: {exc}") from None
        response_id = ("resp_" if call.api == "responses" else "msg_") + uuid.uuid4().hex
        async with self.session.post(url, json=call.engine_body(chat), headers=headers) as upstream:
            call.weight_version = upstream.headers.get(calls.VERSION_HEADER)
            if upstream.status != 200:
                return web.Response(status=upstream.status, body=await upstream.read(),
                                    content_type=upstream.content_type or "application/json")
            if not call.streamed:
                answer = json.loads(await upstream.read())
                call.take_answer(answer)
                out = api.from_chat_response(answer, call.body, response_id)
                self._remember(call, chat, out)
                self._store(call)
                return web.json_response(out)
            translator = api.StreamTranslator(call.body, response_id)

            def relay(line: bytes, chunk: dict | str | None) -> bytes:
                if chunk is None:
                    return b""
                if chunk == "[DONE]":
                    events = translator.finish()
                    self._remember(call, chat, translator.response)
                else:
                    events = translator.feed(chunk)
                return b"".join(calls.sse_event(kind, event) for kind, event in events)

            return await self._relay(request, upstream, call, relay)

    async def _relay(self, request: web.Request, upstream: Any, call: calls.Call,
                     relay: Callable[[bytes, dict | str | None], bytes]) -> web.StreamResponse:
        """vLLM's stream to the client as it comes: each chunk taken into the call, then ``relay(line, chunk)``
        says what the client gets of it (``chunk``: the line's JSON, ``"[DONE]"``, or None for any other line).
        The call is queued for the store before the end of the stream goes out; a stream that breaks off is cut."""
        response = await _start_stream(request)
        try:
            async for line in upstream.content:
                data = calls.sse_data(line)
                chunk = data if data in (None, "[DONE]") else json.loads(data)
                if not isinstance(chunk, dict) and chunk != "[DONE]":
                    chunk = None
                elif isinstance(chunk, dict):
                    call.take_chunk(chunk)
                payload = relay(line, chunk)
                if chunk == "[DONE]":
                    self._store(call)
                if payload:
                    await response.write(payload)
        except (ConnectionError, asyncio.CancelledError):
            self._store_cut(call)
            raise
        self._store_unended(call)
        await response.write_eof()
        return response

    def _remember(self, call: calls.Call, chat: dict, response: dict) -> None:
        """Keep a Responses API answer's conversation for a later ``previous_response_id`` of the same rollout."""
        if call.api != "responses":
            return
        self._history[(call.rollout_id, response["id"])] = chat["messages"] + responses_api.output_messages(response)
        while len(self._history) > _HISTORY:
            self._history.popitem(last=False)

    # -- the store ------------------------------------------------------------------------------------------------

    def _store(self, call: calls.Call) -> None:
        """Queue the call's record for the store's thread, before the answer's last bytes go out: ``settle()``
        then finds it written once the agent is done."""
        if call.stored:
            return
        call.stored = True
        self._queue(call.record())

    def _queue(self, record: Any) -> None:
        used = self._usage.setdefault(record.rollout_id, [0, 0])
        self._usage.move_to_end(record.rollout_id)
        used[0] += 1
        used[1] += calls.size_of(record)
        while len(self._usage) > _USAGE:
            self._usage.popitem(last=False)
        self._db.submit(self._write, record)

    def _store_cut(self, call: calls.Call) -> None:
        call.cut = True
        self._store(call)

    def _store_unended(self, call: calls.Call) -> None:
        """A stream that ended without its ``[DONE]`` (vLLM stopped mid-answer) is a cut call."""
        if not call.stored:
            self._store_cut(call)

    def _write(self, record: Any) -> None:
        """In the store's thread, in order. A call admitted while its attempt ran is its attempt's, and is written
        even when the attempt ended meanwhile (its answer reached the agent before the agent was done): checking
        again here lost the last call of an attempt whose end the dispatcher stored first. The store's error stops
        the gateway (``check`` raises it), and what is queued after it is not written."""
        if self._error is not None:
            return
        try:
            self.store.add_spans([record])
        except Exception as error:  # the trainer raises it from check()
            self._error = error
            self._wake()
            return
        self.recorded += 1

    def _wake(self) -> None:
        """From any thread: let the server's loop stop, unless it has already."""
        if self._loop is not None and self._stopping is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed between the check and the call
                self._loop.call_soon_threadsafe(self._stopping.set)

    def end(self, rollout_id: str) -> None:
        """The attempt has ended (the dispatcher says so, from its thread): its later calls are refused (410)."""
        self._admitted.pop(rollout_id, None)

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait until every call answered so far is written (the store's thread takes them in order); raise
        ``GatewayError`` when the gateway stopped on an error. The trainer calls it before it builds episodes."""
        self._db.submit(lambda: None).result(timeout_s)
        self.check()

    def _count(self, kind: str) -> None:
        if kind not in self.refused:
            log.warning("lit: the gateway refused %s (%s); counted in the run's refused calls, logged once",
                        EXPLAINED.get(kind, kind), kind)
        self.refused[kind] = self.refused.get(kind, 0) + 1


def _agent_of(request: web.Request) -> str | None:
    name = request.headers.get(AGENT_HEADER)
    return name[:200] if name else None


def _call_id_of(value: str | None) -> str | None:
    """The SDK's span id (16 lowercase hex digits), or None for anything else."""
    if value and len(value) == 16 and all(c in "0123456789abcdef" for c in value):
        return value
    return None


def _upstream_headers(request: web.Request) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED}
    if "authorization" not in {k.lower() for k in headers} and request.headers.get("x-api-key"):
        headers["Authorization"] = f"Bearer {request.headers['x-api-key']}"  # Anthropic's clients send their key so
    return headers


async def _start_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "lit_gateway", "code": status}}, status=status)

