"""Anthropic's Messages API served by a chat-completions call to vLLM, the one API whose answers carry the engine's
token ids: the client's request becomes a chat request (``to_chat_request``), vLLM's chat completion becomes a
``Message`` (``from_chat_response``) and its chat stream the Messages API's events (``StreamTranslator``).

Supported: ``system`` (a string or text blocks, joined by newlines), ``messages`` whose content is a string or
``text``, ``tool_use`` and ``tool_result`` blocks (``thinking`` blocks are skipped: the chat template renders its
own), client tools, ``tool_choice`` (``disable_parallel_tool_use`` too), ``max_tokens``, ``temperature``,
``top_p``, ``top_k``, ``stop_sequences``, ``output_config.format`` (a JSON schema), ``stream``; ``thinking``,
``output_config.effort`` and ``metadata`` are ignored. Images,
documents, server tools and other blocks are refused with a ``TranslationError`` naming the field. A tool result
with ``is_error`` reaches the model as ``Error: <text>``.

A tool call whose arguments are not a JSON object (the model is being trained: it can write anything) comes back as
``{"_raw": <the arguments' text>}``, so that the client gets a dict and never fails to parse; sent back as a
``tool_use`` block, that input becomes the raw text again, so the conversation shows the model what it wrote. In a
stream, a tool call's input is sent whole as one ``input_json_delta`` when its block ends, for the same reason (the
client parses every piece as partial JSON).
"""

from __future__ import annotations

import json
from typing import Any

from lit_trainer.intake.gateway.responses_api import (
    ChatStream,
    TranslationError,
    text_content,
    unsupported,
    usage_counts,
)

RAW_INPUT = "_raw"
"""The key of a tool call's input whose arguments were not a JSON object: their text."""

CHAT_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
"""The chat ``tool_choice`` of each Messages API choice type but ``tool``."""

def to_chat_request(body: dict) -> dict:
    """The client's Messages API request -> the chat-completions request for vLLM (fields the client left out stay
    out; a stream asks for its usage, which ``message_delta`` carries)."""
    chat: dict[str, Any] = {"model": body["model"]} if "model" in body else {}
    chat["messages"] = _system(body.get("system"))
    if not isinstance(body.get("messages"), list):
        raise TranslationError("messages: must be a list of messages")
    for i, message in enumerate(body["messages"]):
        chat["messages"] += _chat_messages(message, f"messages[{i}]")
    for key in ("max_tokens", "temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences"):
        chat["stop"] = list(body["stop_sequences"])
    if body.get("tools"):
        chat["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(body["tools"])]
    if body.get("tool_choice"):
        chat.update(_chat_tool_choice(body["tool_choice"]))
    fmt = (body.get("output_config") or {}).get("format")
    if fmt is not None:
        if fmt.get("type") != "json_schema":
            raise unsupported("output_config.format", f"formats of type {fmt.get('type')!r}")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if "stream" in body:
        chat["stream"] = body["stream"]
        if body["stream"]:
            chat["stream_options"] = {"include_usage": True}
    return chat


def _system(system: Any) -> list[dict]:
    if system is None or isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    texts = []
    for j, block in enumerate(system if isinstance(system, list) else [None]):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise TranslationError(f"system[{j}]: must be a text block")
        texts.append(block.get("text", ""))
    return [{"role": "system", "content": "\n".join(texts)}]


def _chat_messages(message: dict, where: str) -> list[dict]:
    """One message's chat messages: an assistant's text and tool calls make one; a user's tool results each make a
    ``tool`` message, its text a user message, in their order."""
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise TranslationError(f"{where}.role: {role!r} is not a message role")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise TranslationError(f"{where}.content: must be a string or a list of blocks")
    if role == "assistant":
        return [_assistant(content, f"{where}.content")]
    messages: list[dict] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "tool_result":
            if texts:
                messages.append({"role": "user", "content": text_content(texts)})
                texts = []
            messages.append(_tool_message(block, f"{where}.content[{j}]"))
        else:
            raise unsupported(f"{where}.content[{j}]", f"blocks of type {kind!r}")
    if texts:
        messages.append({"role": "user", "content": text_content(texts)})
    return messages


def _assistant(blocks: list[dict], where: str) -> dict:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": _arguments(block.get("input"))}})
        elif kind not in ("thinking", "redacted_thinking"):
            raise unsupported(f"{where}[{j}]", f"blocks of type {kind!r}")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_message(block: dict, where: str) -> dict:
    content = block.get("content", "")
    if isinstance(content, list):
        for k, part in enumerate(content):
            if part.get("type") != "text":
                raise unsupported(f"{where}.content[{k}]", f"blocks of type {part.get('type')!r}")
        content = "\n".join(part.get("text", "") for part in content)
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": content}


def _arguments(tool_input: Any) -> str:
    """A ``tool_use`` block's input as the call's arguments: its JSON, or the raw text it was made from."""
    if isinstance(tool_input, dict) and set(tool_input) == {RAW_INPUT} and isinstance(tool_input[RAW_INPUT], str):
        return tool_input[RAW_INPUT]
    return json.dumps(tool_input if tool_input is not None else {}, ensure_ascii=False)


def tool_input(arguments: str) -> dict:
    """A tool call's arguments as a ``tool_use`` input: the JSON object, else ``{"_raw": arguments}``."""
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {RAW_INPUT: arguments}


def _chat_tool(i: int, tool: dict) -> dict:
    if tool.get("type", "custom") != "custom":
        raise unsupported(f"tools[{i}]", f"tools of type {tool.get('type')!r}")
    if not tool.get("name"):
        raise TranslationError(f"tools[{i}].name: required")
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict) -> dict:
    """The chat fields of a ``tool_choice``: ``tool_choice`` and, if asked, ``parallel_tool_calls``."""
    kind = choice.get("type")
    if kind == "tool" and choice.get("name"):
        fields: dict[str, Any] = {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    elif kind in CHAT_TOOL_CHOICES:
        fields = {"tool_choice": CHAT_TOOL_CHOICES[kind]}
    else:
        raise unsupported("tool_choice", f"tool choices {kind!r}")
    if choice.get("disable_parallel_tool_use"):
        fields["parallel_tool_calls"] = False
    return fields


def from_chat_response(chat: dict, body: dict, response_id: str) -> dict:
    """vLLM's whole chat completion -> the ``Message`` object."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content = [_text_block(message["content"])] if message.get("content") else []
    for i, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") or {}
        call_id = call.get("id") or _call_id(response_id, i)
        content.append(_tool_use(call_id, function.get("name", ""), function.get("arguments") or ""))
    stop = _stop(body, choice.get("finish_reason"), choice.get("stop_reason"), bool(message.get("tool_calls")))
    return _message(body, response_id, content, stop, usage_counts(chat))


def _text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def _call_id(response_id: str, index: int) -> str:
    """An id for a tool call vLLM gave none."""
    return f"toolu_{response_id.removeprefix('msg_')}_{index}"


def _tool_use(call_id: str, name: str, arguments: str | None) -> dict:
    """A tool call's block; ``arguments`` None while the call streams (its input comes whole at its end)."""
    return {"type": "tool_use", "id": call_id, "name": name,
            "input": {} if arguments is None else tool_input(arguments)}


def _stop(body: dict, finish_reason: str | None, stop_reason: Any, called: bool) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of vLLM's finish reason and matched stop string."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop_reason, str) and stop_reason in (body.get("stop_sequences") or ()):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _message(body: dict, response_id: str, content: list[dict], stop: tuple[str | None, str | None],
             counts: tuple[int, int]) -> dict:
    return {"id": response_id, "type": "message", "role": "assistant", "model": body.get("model", ""),
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": {"input_tokens": counts[0], "output_tokens": counts[1], "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0}}


class StreamTranslator:
    """vLLM's chat stream -> the Messages API's events. One content block is open at a time: text streams as
    ``text_delta``s, a tool call's block opens when the call starts and gets its input when it ends."""

    def __init__(self, body: dict, response_id: str):
        self.body, self.response_id = body, response_id
        self.chat = ChatStream()
        self.blocks: list[dict] = []  # content index -> {"kind": "text", "text"} | {"kind": "tool", "id", ...}
        self.tools: dict[int, int] = {}  # chat tool call index -> content index
        self.open: int | None = None
        self.started = False
        self.response: dict = {}

    def feed(self, chunk: dict) -> list[tuple[str, dict]]:
        """One chat chunk -> the events to send now."""
        pieces = self.chat.read(chunk)  # first: ``message_start`` tells the prompt's length from the first chunk
        events = self._start()
        for piece in pieces:
            events += self._text(piece[1]) if piece[0] == "text" else self._tool(*piece[1:])
        return events

    def finish(self) -> list[tuple[str, dict]]:
        """The closing events once the chat stream ended; sets ``response``."""
        events = self._start() + self._close()
        content = [_text_block(block["text"]) if block["kind"] == "text" else
                   _tool_use(block["id"], block["name"], block["arguments"]) for block in self.blocks]
        stop = _stop(self.body, self.chat.finish_reason, self.chat.stop_reason, bool(self.tools))
        counts = self.chat.counts()
        self.response = _message(self.body, self.response_id, content, stop, counts)
        return [*events,
                _event("message_delta", delta={"stop_reason": stop[0], "stop_sequence": stop[1]},
                       usage={"input_tokens": counts[0], "output_tokens": counts[1]}),
                _event("message_stop")]

    def _start(self) -> list[tuple[str, dict]]:
        if self.started:
            return []
        self.started = True
        message = _message(self.body, self.response_id, [], (None, None), (self.chat.prompt_tokens, 0))
        return [_event("message_start", message=message)]

    def _open(self, block: dict, wire: dict) -> list[tuple[str, dict]]:
        events = self._close()
        self.blocks.append(block)
        self.open = len(self.blocks) - 1
        return [*events, _event("content_block_start", index=self.open, content_block=wire)]

    def _text(self, text: str) -> list[tuple[str, dict]]:
        events = []
        if self.open is None or self.blocks[self.open]["kind"] != "text":
            events = self._open({"kind": "text", "text": ""}, _text_block(""))
        self.blocks[self.open]["text"] += text
        return [*events, _event("content_block_delta", index=self.open, delta={"type": "text_delta", "text": text})]

    def _tool(self, index: int, call_id: str | None, name: str | None, arguments: str) -> list[tuple[str, dict]]:
        events = []
        if index not in self.tools:
            block = {"kind": "tool", "id": call_id or _call_id(self.response_id, index), "name": name or "",
                     "arguments": ""}
            events = self._open(block, _tool_use(block["id"], block["name"], None))
            self.tools[index] = self.open
        block = self.blocks[self.tools[index]]
        block["name"] = block["name"] or name or ""
        block["arguments"] += arguments  # a late piece of an ended call is kept in ``response`` only
        return events

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        n, block = self.open, self.blocks[self.open]
        self.open = None
        events = []
        if block["kind"] == "tool":
            partial = json.dumps(tool_input(block["arguments"]), ensure_ascii=False)
            events.append(_event("content_block_delta", index=n, delta={"type": "input_json_delta",
                                                                        "partial_json": partial}))
        return [*events, _event("content_block_stop", index=n)]


def _event(kind: str, **data: Any) -> tuple[str, dict]:
    return kind, {"type": kind, **data}
