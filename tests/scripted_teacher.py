"""A scripted teacher: a local OpenAI-compatible chat API answering like a hosted one (OpenAI's), standing in for the
stronger model or API a teacher is (``rollouts/teacher.py``), which cannot be reached from the tests. A real aiohttp
server on 127.0.0.1; only the model is scripted.

As a hosted API does, it refuses vLLM's ``return_token_ids`` (400: unrecognized argument), answers 401 without
``Authorization: Bearer <key>`` when ``key`` is set, and returns no token ids or logprobs. ``reply(body)`` gives
the answer to each chat request: a string (text) or ``(tool name, arguments)`` (a tool call). A request with
``"stream": true`` gets the answer as server-sent chunks (content in pieces; a tool call's arguments in two).
Every request body and its headers are kept (``requests``, ``headers``: names in lower case).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

Reply = str | tuple[str, dict[str, Any]]


class ScriptedTeacher:
    def __init__(self, reply: Callable[[dict], Reply], key: str = ""):
        self.reply, self.key = reply, key
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> ScriptedTeacher:
        self._thread.start()
        assert self._ready.wait(30), "the scripted teacher did not start"
        return self

    def __exit__(self, *exc: Any) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if self.key and request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": {"message": "Incorrect API key provided"}}, status=401)
        if "return_token_ids" in body:
            return web.json_response({"error": {"message": "Unrecognized request argument supplied: "
                                                           "return_token_ids"}}, status=400)
        message = _message(self.reply(body), len(self.requests))
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        head = {"id": f"chatcmpl-{len(self.requests)}", "created": int(time.time()), "model": body.get("model")}
        if body.get("stream"):
            return await _stream(request, head, message, finish)
        return web.json_response({**head, "object": "chat.completion", "choices": [
            {"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})


def _message(reply: Reply, n: int) -> dict[str, Any]:
    if isinstance(reply, str):
        return {"role": "assistant", "content": reply}
    name, args = reply
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


async def _stream(request: web.Request, head: dict, message: dict, finish: str) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    if message.get("tool_calls"):
        call = message["tool_calls"][0]
        args = call["function"]["arguments"]
        deltas.append({"tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                                       "function": {"name": call["function"]["name"], "arguments": ""}}]})
        deltas += [{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
                   for piece in (args[:len(args) // 2], args[len(args) // 2:])]
    else:
        text = message["content"]
        deltas += [{"content": text[i:i + 4]} for i in range(0, len(text), 4)]
    for i, delta in enumerate(deltas):
        chunk = {**head, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish if i == len(deltas) - 1 else None}]}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
