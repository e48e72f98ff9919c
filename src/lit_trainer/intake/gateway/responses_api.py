"""OpenAI's Responses API served by a chat-completions call to vLLM, the one API whose answers carry the engine's
token ids: the client's request becomes a chat request (``to_chat_request``), vLLM's chat completion becomes a
``Response`` (``from_chat_response``) and its chat stream the Responses API's events (``StreamTranslator``).

Supported: ``instructions``; ``input`` as a string or a list of messages (text parts only; ``developer`` becomes
``system``), ``function_call`` items (merged into the assistant message before them, as vLLM answered them),
``function_call_output`` items and ``reasoning`` items (skipped); ``function`` tools, ``tool_choice``,
``max_output_tokens``, ``temperature``, ``top_p``, ``parallel_tool_calls``, ``text.format`` (JSON schema or
object), ``stream``. Anything else that changes the answer (images, files, built-in tools, other items,
background responses, stored conversations and prompts) is refused with a ``TranslationError`` naming the field.
``previous_response_id`` is the gateway's: it passes the conversation as ``history``.

Item ids derive from the response id and the item's output index, so a stream and a whole answer of the same
completion give the same ``Response``. The stream reader (``ChatStream``) and the ``TranslationError`` are shared
with ``messages_api``.
"""

from __future__ import annotations

import time
from typing import Any

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
"""The chat role of each Responses API message role."""

TEXT_PARTS = ("input_text", "output_text", "text")
"""Content parts that are plain text."""

REFUSED_FIELDS = {"background": "background responses", "conversation": "stored conversations",
                  "prompt": "stored prompts"}
"""Request fields lit's gateway cannot honour, with what they ask for."""


class TranslationError(ValueError):
    """A request the gateway cannot translate; the message names the field and is said to the client as a 400."""


def unsupported(where: str, what: str) -> TranslationError:
    """The error for a request field of a kind lit's gateway does not translate."""
    return TranslationError(f"{where}: {what} are not supported by lit's gateway")


def text_content(texts: list[str]) -> str | list[dict]:
    """Chat message content for text pieces: one string, or text parts that vLLM joins as the template needs."""
    return texts[0] if len(texts) == 1 else [{"type": "text", "text": text} for text in texts]


def usage_counts(chat: dict) -> tuple[int, int]:
    """(input, output) tokens of a whole chat completion: its usage, else its token ids counted."""
    usage = chat.get("usage") or {}
    choice = (chat.get("choices") or [{}])[0]
    prompt = usage.get("prompt_tokens", len(chat.get("prompt_token_ids") or ()))
    return prompt, usage.get("completion_tokens", len(choice.get("token_ids") or ()))


def to_chat_request(body: dict, history: list[dict] | None = None) -> dict:
    """The client's Responses API request -> the chat-completions request for vLLM (fields the client left out stay
    out; a stream asks for its usage, which the closing event carries)."""
    for key, what in REFUSED_FIELDS.items():
        if body.get(key):
            raise unsupported(key, what)
    chat: dict[str, Any] = {"model": body["model"]} if "model" in body else {}
    chat["messages"] = input_messages(body, history)
    for key in ("temperature", "top_p", "parallel_tool_calls"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(body["tools"])]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    response_format = _response_format((body.get("text") or {}).get("format"))
    if response_format is not None:
        chat["response_format"] = response_format
    if "stream" in body:
        chat["stream"] = body["stream"]
        if body["stream"]:
            chat["stream_options"] = {"include_usage": True}
    return chat


def input_messages(body: dict, history: list[dict] | None = None) -> list[dict]:
    """The chat messages of a request: its instructions, then ``history``, then its input. New instructions
    replace the system messages that open ``history`` (a previous response's instructions do not carry over)."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise TranslationError("instructions: must be a string")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    past = list(history or ())
    while instructions and past and past[0].get("role") == "system":
        past.pop(0)
    messages += past
    items = body.get("input", [])
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    elif not isinstance(items, list):
        raise TranslationError("input: must be a string or a list of items")
    for i, item in enumerate(items):
        _add_item(messages, item, f"input[{i}]")
    return messages


def output_messages(response: dict) -> list[dict]:
    """The chat messages of a response's output (assistant text and tool calls), to continue its conversation."""
    messages: list[dict] = []
    for i, item in enumerate(response.get("output") or ()):
        _add_item(messages, item, f"output[{i}]")
    return messages


def _add_item(messages: list[dict], item: dict, where: str) -> None:
    """Append one input item's chat message; a function call joins the assistant message before it."""
    kind = item.get("type", "message")
    if kind == "message":
        messages.append(_chat_message(item, where))
    elif kind == "function_call":
        call = {"id": _field(item, "call_id", where), "type": "function",
                "function": {"name": _field(item, "name", where), "arguments": item.get("arguments") or ""}}
        if messages and messages[-1].get("role") == "assistant":
            # a copy: the history's messages belong to the gateway
            messages[-1] = {**messages[-1], "tool_calls": [*(messages[-1].get("tool_calls") or ()), call]}
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output", "")
        content = output if isinstance(output, str) else "".join(_texts(output, f"{where}.output"))
        messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": content})
    elif kind != "reasoning":  # the chat template renders its own reasoning, if any
        raise unsupported(where, f"items of type {kind!r}")


def _chat_message(item: dict, where: str) -> dict:
    role = ROLES.get(item.get("role", ""))
    if role is None:
        raise TranslationError(f"{where}.role: {item.get('role')!r} is not a message role")
    content = item.get("content", "")
    return {"role": role, "content": content if isinstance(content, str) else
            text_content(_texts(content, f"{where}.content"))}


def _texts(parts: Any, where: str) -> list[str]:
    if not isinstance(parts, list):
        raise TranslationError(f"{where}: must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type")
        if kind not in (*TEXT_PARTS, "refusal"):
            raise unsupported(f"{where}[{j}]", f"content parts of type {kind!r}")
        texts.append(part.get("refusal", "") if kind == "refusal" else part.get("text", ""))
    return texts


def _field(item: dict, key: str, where: str) -> Any:
    if not item.get(key):
        raise TranslationError(f"{where}.{key}: required")
    return item[key]


def _chat_tool(i: int, tool: dict) -> dict:
    if tool.get("type") != "function":
        raise unsupported(f"tools[{i}]", f"tools of type {tool.get('type')!r}")
    function = {"name": _field(tool, "name", f"tools[{i}]")}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": _field(choice, "name", "tool_choice")}}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise unsupported("tool_choice", f"tool choices {kind!r}")


def _response_format(fmt: dict | None) -> dict | None:
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        keys = ("name", "schema", "strict", "description")
        return {"type": "json_schema", "json_schema": {key: fmt[key] for key in keys if key in fmt}}
    raise unsupported("text.format", f"formats of type {fmt.get('type')!r}")


def from_chat_response(chat: dict, body: dict, response_id: str) -> dict:
    """vLLM's whole chat completion -> the ``Response`` object; cut by ``max_output_tokens``, the response and its
    last item are ``incomplete``."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    items = [{"kind": "text", "text": message["content"]}] if message.get("content") else []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        items.append({"kind": "tool", "call_id": call.get("id"), "name": function.get("name", ""),
                      "arguments": function.get("arguments") or ""})
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    output = [_item(response_id, n, item, status if n == len(items) - 1 else "completed")
              for n, item in enumerate(items)]
    return _response(body, response_id, chat.get("created"), output, status, usage_counts(chat))


def _item(response_id: str, n: int, item: dict, status: str) -> dict:
    """The output item at output index ``n``, built afresh (events must not share dicts that change later)."""
    if item["kind"] == "tool":
        return {"type": "function_call", "id": _item_id("fc", response_id, n),
                "call_id": item.get("call_id") or _item_id("call", response_id, n), "name": item["name"],
                "arguments": item["arguments"], "status": status}
    content = [] if item.get("text") is None else [_text_part(item["text"])]
    return {"type": "message", "id": _item_id("msg", response_id, n), "role": "assistant", "status": status,
            "content": content}


def _item_id(prefix: str, response_id: str, n: int) -> str:
    return f"{prefix}_{response_id.removeprefix('resp_')}_{n}"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _response(body: dict, response_id: str, created: int | None, output: list[dict], status: str,
              counts: tuple[int, int] | None) -> dict:
    usage = None if counts is None else {
        "input_tokens": counts[0], "output_tokens": counts[1], "total_tokens": counts[0] + counts[1],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0}}
    return {
        "id": response_id, "object": "response", "created_at": created or int(time.time()), "status": status,
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {}, "model": body.get("model", ""), "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"), "reasoning": body.get("reasoning"),
        "temperature": body.get("temperature"), "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "top_p": body.get("top_p"), "truncation": "disabled", "usage": usage,
    }


class ChatStream:
    """Choice 0 of vLLM's chat stream, read chunk by chunk into pieces of text and of tool calls, keeping what the
    closing events need (why it stopped, token counts)."""

    def __init__(self) -> None:
        self.created: int | None = None
        self.finish_reason: str | None = None
        self.stop_reason: Any = None  # vLLM's matched stop string (or token id)
        self.usage: dict | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def read(self, chunk: dict) -> list[tuple]:
        """The chunk's pieces in order: ``("text", text)`` or ``("tool", index, id, name, arguments piece)``."""
        self.created = self.created or chunk.get("created")
        if isinstance(chunk.get("prompt_token_ids"), list):
            self.prompt_tokens = len(chunk["prompt_token_ids"])
        self.usage = chunk.get("usage") or self.usage
        pieces: list[tuple] = []
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            self.completion_tokens += len(choice.get("token_ids") or ())
            delta = choice.get("delta") or {}
            if delta.get("content"):
                pieces.append(("text", delta["content"]))
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                pieces.append(("tool", call.get("index", 0), call.get("id"), function.get("name"),
                               function.get("arguments") or ""))
            if choice.get("finish_reason"):
                self.finish_reason, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")
        return pieces

    def counts(self) -> tuple[int, int]:
        """(input, output) tokens: the stream's usage, else its token ids counted."""
        usage = self.usage or {}
        return (usage.get("prompt_tokens", self.prompt_tokens),
                usage.get("completion_tokens", self.completion_tokens))


class StreamTranslator:
    """vLLM's chat stream -> the Responses API's events. One output item is open at a time: text streams into a
    message item, each tool call into a function call item whose arguments stream as they come."""

    def __init__(self, body: dict, response_id: str):
        self.body, self.response_id = body, response_id
        self.chat = ChatStream()
        self.items: list[dict] = []  # output index -> {"kind", "text" | "call_id", "name", "arguments", "status"}
        self.tools: dict[int, int] = {}  # chat tool call index -> output index
        self.open: int | None = None
        self.sequence = 0
        self.response: dict = {}

    def feed(self, chunk: dict) -> list[tuple[str, dict]]:
        """One chat chunk -> the events to send now."""
        events = self._start()
        for piece in self.chat.read(chunk):
            events += self._text(piece[1]) if piece[0] == "text" else self._tool(*piece[1:])
        return events

    def finish(self) -> list[tuple[str, dict]]:
        """The closing events once the chat stream ended; sets ``response``."""
        status = "incomplete" if self.chat.finish_reason == "length" else "completed"
        events = self._start() + self._close(status)
        output = [_item(self.response_id, n, item, item["status"]) for n, item in enumerate(self.items)]
        self.response = _response(self.body, self.response_id, self.chat.created, output, status,
                                  self.chat.counts())
        return [*events, self._event(f"response.{status}", response=self.response)]

    def _event(self, kind: str, **data: Any) -> tuple[str, dict]:
        self.sequence += 1
        return kind, {"type": kind, "sequence_number": self.sequence - 1, **data}

    def _start(self) -> list[tuple[str, dict]]:
        if self.sequence:
            return []
        return [self._event(kind, response=_response(self.body, self.response_id, self.chat.created, [],
                                                     "in_progress", None))
                for kind in ("response.created", "response.in_progress")]

    def _open(self, item: dict) -> list[tuple[str, dict]]:
        events = self._close("completed")
        self.items.append({**item, "status": "in_progress"})
        self.open = n = len(self.items) - 1
        added = {**item, "text": None} if item["kind"] == "text" else item
        return [*events, self._event("response.output_item.added", output_index=n,
                                     item=_item(self.response_id, n, added, "in_progress"))]

    def _text(self, text: str) -> list[tuple[str, dict]]:
        events = []
        if self.open is None or self.items[self.open]["kind"] != "text":
            events = self._open({"kind": "text", "text": ""})
            events.append(self._event("response.content_part.added", **self._where(), part=_text_part("")))
        self.items[self.open]["text"] += text
        return [*events, self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[])]

    def _tool(self, index: int, call_id: str | None, name: str | None, arguments: str) -> list[tuple[str, dict]]:
        events = []
        if index not in self.tools:
            events = self._open({"kind": "tool", "call_id": call_id, "name": name or "", "arguments": ""})
            self.tools[index] = self.open
        item = self.items[self.tools[index]]
        item["name"] = item["name"] or name or ""
        item["arguments"] += arguments
        if arguments and self.tools[index] == self.open:  # vLLM ends a call before the next; a late piece is kept
            events.append(self._event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return events

    def _where(self) -> dict:
        """Where the open item's events point."""
        n = self.open
        assert n is not None
        if self.items[n]["kind"] == "tool":
            return {"item_id": _item_id("fc", self.response_id, n), "output_index": n}
        return {"item_id": _item_id("msg", self.response_id, n), "output_index": n, "content_index": 0}

    def _close(self, status: str) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        where, item = self._where(), self.items[self.open]
        item["status"] = status
        if item["kind"] == "text":
            events = [self._event("response.output_text.done", **where, text=item["text"], logprobs=[]),
                      self._event("response.content_part.done", **where, part=_text_part(item["text"]))]
        else:
            events = [self._event("response.function_call_arguments.done", **where, arguments=item["arguments"])]
        events.append(self._event("response.output_item.done", output_index=self.open,
                                  item=_item(self.response_id, self.open, item, status)))
        self.open = None
        return events
