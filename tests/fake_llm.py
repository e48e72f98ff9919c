"""A local OpenAI-compatible HTTP server on 127.0.0.1 that answers like vLLM with ``return_token_ids``.

It stands in for the vLLM engine in SDK tests (a real HTTP server, real sockets; only the model is scripted):
when the request offers tools and no tool result has come back yet, it calls the first tool with
``tool_args``; otherwise it answers ``final_text``. Every response carries vLLM's fields: ``prompt_token_ids``
(chat: top level; completions: per choice), ``choices[].token_ids`` and per-token logprobs. Each call gets
distinct ids, and the server keeps every request and response so that tests can compare exact ids.

``script`` replaces that rule with a fixed sequence of replies, one per chat call in arrival order: a string is
a text answer, a ``(tool_name, arguments)`` pair a tool call (for agents of several calls: a SQL writer, checker
and rewriter; several searches before an answer). A call beyond the script gets ``final_text``.

``weight_version``: when set, every answer also carries it as ``lit_weight_version``, as lit's vLLM (its route
guard) adds it; it may be changed between calls.

``streams``: when set, a chat call with ``"stream": true`` gets the same reply as server-sent events, shaped as
vLLM streams with ``return_token_ids``: ``prompt_token_ids`` on the first chunk, then one chunk per token, each
with its ``token_ids`` and logprobs (a tool call as a first delta with its id and name, then its arguments in
pieces), the ``finish_reason`` on the last, a usage chunk when ``stream_options.include_usage`` asks for it, and
``[DONE]``; ``responses`` holds the whole reply, as for an unstreamed call. Otherwise (and for text completions)
a streamed call is refused with HTTP 400, for tests of a call that fails.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeLLM:
    def __init__(self, tool_args: dict[str, Any] | None = None, final_text: str = "The answer is 5.",
                 script: list[str | tuple[str, dict[str, Any]]] | None = None, weight_version: str | None = None,
                 streams: bool = False):
        self.tool_args = tool_args or {}
        self.streams = streams
        self.weight_version = weight_version
        self.final_text = final_text
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        """The HTTP headers of each request, in the order of ``requests`` (names in lower case)."""
        self.before_answer: Any = None
        """Called (without arguments) after a request has arrived and before it is answered, when set."""
        self.responses: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"llm": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> FakeLLM:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()

    def answer(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            n = len(self.responses)
            self.requests.append(body)
            response = _chat(self, body, n) if path.endswith("/chat/completions") else _completion(self, body, n)
            if self.weight_version is not None:
                response["lit_weight_version"] = self.weight_version
            self.responses.append(response)
            return response


def _ids(n: int, length: int, base: int) -> list[int]:
    return [base + 1000 * n + i for i in range(length)]


def _chat(llm: FakeLLM, body: dict[str, Any], n: int) -> dict[str, Any]:
    messages = body.get("messages", [])
    tools = body.get("tools") or []
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    tool_done = any(m.get("role") == "tool" for m in messages[last_user + 1 :])
    message: dict[str, Any] = {"role": "assistant", "content": None}
    if llm.script is not None:
        reply = llm.script[n] if n < len(llm.script) else llm.final_text
        name, args = (None, None) if isinstance(reply, str) else reply
    elif tools and not tool_done:
        name, args = tools[0]["function"]["name"], llm.tool_args
    else:
        name, args = None, None
    if name is not None:
        function = {"name": name, "arguments": json.dumps(args)}
        call = {"id": f"call_{n}", "type": "function", "function": function}
        message["tool_calls"] = [call]
        finish, n_out = "tool_calls", 7
    else:
        message["content"] = reply if llm.script is not None and isinstance(reply, str) else llm.final_text
        finish, n_out = "stop", 5
    response_ids = _ids(n, n_out, 50_000)
    logprobs = [-0.125 * (i + 1) for i in range(n_out)]
    return {
        "id": f"chatcmpl-{n}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", "fake"),
        "prompt_token_ids": _ids(n, 3 + len(messages), 10_000),
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish,
                "token_ids": response_ids,
                "logprobs": {
                    "content": [
                        {"token": f"t{t}", "logprob": lp, "bytes": [], "top_logprobs": []}
                        for t, lp in zip(response_ids, logprobs, strict=True)
                    ]
                },
            }
        ],
        "usage": {"prompt_tokens": 3 + len(messages), "completion_tokens": n_out, "total_tokens": 8 + len(messages)},
    }


def _chunks(response: dict[str, Any], body: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat reply as the chunks vLLM streams it (see the module's doc)."""
    choice = response["choices"][0]
    message, ids, logprobs = choice["message"], choice["token_ids"], choice["logprobs"]["content"]
    head = {key: response[key] for key in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    if "lit_weight_version" in response:
        head["lit_weight_version"] = response["lit_weight_version"]

    def chunk(delta: dict[str, Any], at: slice, finish: str | None = None, **extra: Any) -> dict[str, Any]:
        part = {"index": 0, "delta": delta, "logprobs": {"content": logprobs[at]}, "finish_reason": finish,
                "token_ids": ids[at]}
        return {**head, **extra, "choices": [part]}

    chunks = [chunk({"role": "assistant", "content": ""}, slice(0, 0), prompt_token_ids=response["prompt_token_ids"])]
    if message.get("tool_calls"):
        call = message["tool_calls"][0]
        args = call["function"]["arguments"]
        first = {"index": 0, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"],
                                                                               "arguments": ""}}
        chunks.append(chunk({"tool_calls": [first]}, slice(0, 1)))
        pieces = [args[: len(args) // 2], args[len(args) // 2 :]]
        for i, piece in enumerate(pieces):
            at = slice(1, len(ids) // 2) if i == 0 else slice(len(ids) // 2, len(ids))
            chunks.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}, at))
    else:
        text = message["content"]
        cuts = [len(text) * i // len(ids) for i in range(len(ids) + 1)]
        chunks += [chunk({"content": text[cuts[i] : cuts[i + 1]]}, slice(i, i + 1)) for i in range(len(ids))]
    chunks.append(chunk({}, slice(0, 0), choice["finish_reason"]))
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**head, "choices": [], "usage": response["usage"]})
    return chunks


def _completion(llm: FakeLLM, body: dict[str, Any], n: int) -> dict[str, Any]:
    response_ids = _ids(n, 4, 50_000)
    return {
        "id": f"cmpl-{n}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.get("model", "fake"),
        "choices": [
            {
                "index": 0,
                "text": llm.final_text,
                "finish_reason": "stop",
                "prompt_token_ids": _ids(n, 6, 10_000),
                "token_ids": response_ids,
                "logprobs": {
                    "tokens": [f"t{t}" for t in response_ids],
                    "token_logprobs": [-0.5] * len(response_ids),
                    "text_offset": list(range(len(response_ids))),
                    "top_logprobs": None,
                },
            }
        ],
        "usage": {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10},
    }


class _Handler(BaseHTTPRequestHandler):
    llm: FakeLLM

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", 0))
        body = json.loads(self.rfile.read(length) or b"{}")
        if body.get("stream") and not (self.llm.streams and self.path.endswith("/chat/completions")):
            self._send(400, {"error": {"message": "the fake engine does not stream"}})
            return
        with self.llm._lock:
            self.llm.headers.append({k.lower(): v for k, v in self.headers.items()})
        if self.llm.before_answer is not None:
            self.llm.before_answer()
        response = self.llm.answer(self.path, body)
        if body.get("stream"):
            self._stream(_chunks(response, body))
        else:
            self._send(200, response)

    def do_GET(self) -> None:
        self._send(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, chunks: list[dict[str, Any]]) -> None:
        """Server-sent events, then the connection closes (HTTP/1.0: no length to send)."""
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: Any) -> None:
        pass
