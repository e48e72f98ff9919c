"""One LLM call as the gateway sees it: what it asks vLLM for beyond the client's request, what it gathers from
vLLM's answer or stream (the engine's token ids of choice 0, their logprobs, why it stopped), and the
``lit.engine.call`` span it becomes in the store.

vLLM's chat and text completions return the engine's ids when asked (``return_token_ids``): the whole answer has
``prompt_token_ids`` (chat: at the top; text: on the choice) and ``choices[i].token_ids``; a stream has the
prompt's ids in its first chunk and each chunk the ids of its piece. Logprobs come as ``logprobs.content[].logprob``
(chat) or ``logprobs.token_logprobs`` (text).

A call to a teacher (an OpenAI-compatible API lit does not train: ``teacher=True``) is sent as the client asked,
without lit's additions, and returns no ids; its record carries the chat request and the answer's assistant message
instead, from which the trainer tokenizes a demonstration (``rollouts/teacher.py``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from lit_sdk import semconv as sc
from lit_sdk.openai_instrumentor import sampling_attributes
from lit_sdk.protocol import STATUS_ERROR, STATUS_OK, SpanRecord

LIT_ADDITIONS = ("return_token_ids", "logprobs", "top_logprobs")
"""What lit (the gateway, or the SDK in the agent's process) adds to a request for vLLM, left out of a request to a
teacher: a real API refuses the first, and lit has no use for the others there."""
VERSION_HEADER = "x-lit-weight-version"
"""The header lit's route guard adds to vLLM's answers: the engine's weight version when the request arrived."""


class Call:
    """One call being served; ``take_answer`` or ``take_chunk`` as vLLM answers, then ``record()``."""

    def __init__(self, api: str, rollout_id: str, body: dict, agent: str | None, call_id: str | None,
                 teacher: bool = False):
        self.api, self.rollout_id, self.body, self.agent, self.call_id = api, rollout_id, body, agent, call_id
        self.teacher = teacher
        self.chat_request: dict = {}
        """A teacher's call: the chat request it was sent (the client's, or its translation)."""
        self.message: dict[str, Any] = {"content": None, "tool_calls": []}
        """A teacher's call: the answer's assistant message, streamed pieces put together."""
        self.streamed = body.get("stream") is True
        self.start_ns = time.time_ns()
        self.prompt_ids: list[int] | None = None
        self.response_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason = ""
        self.model = ""
        self.response_id = ""
        self.choices = 0
        self.weight_version: str | None = None
        self.cut = False
        self.stored = False
        self.sampling: dict[str, Any] = {}

    def engine_body(self, request: dict) -> dict:
        """The chat or text request sent to vLLM: the client's (or its translation) asking for the engine's ids
        and the sampled tokens' logprobs."""
        self.sampling = sampling_attributes(request)
        if self.teacher:
            self.chat_request = request
            return {k: v for k, v in request.items() if k not in LIT_ADDITIONS}
        out = {**request, "return_token_ids": True}
        if "messages" in out:
            out["logprobs"] = True
        elif not isinstance(out.get("logprobs"), int) or isinstance(out.get("logprobs"), bool):
            out["logprobs"] = 0  # text completions: the sampled token's logprob only
        return out

    def take_answer(self, answer: dict) -> None:
        """A whole (non-streamed) chat or text completion."""
        self._take_meta(answer)
        choices = answer.get("choices") or []
        self.choices = len(choices)
        if isinstance(answer.get("prompt_token_ids"), list):
            self.prompt_ids = answer["prompt_token_ids"]
        if choices:
            self._take_choice(choices[0])

    def take_chunk(self, chunk: dict) -> None:
        """One chunk of a stream: its piece of choice 0."""
        self._take_meta(chunk)
        if isinstance(chunk.get("prompt_token_ids"), list):
            self.prompt_ids = chunk["prompt_token_ids"]
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            self.choices = max(self.choices, index + 1)
            if index == 0:
                self._take_choice(choice)

    def _take_meta(self, answer: dict) -> None:
        self.model = self.model or str(answer.get("model") or "")
        self.response_id = self.response_id or str(answer.get("id") or "")
        version = answer.get("lit_weight_version")
        if isinstance(version, str):
            self.weight_version = version

    def _take_choice(self, choice: dict) -> None:
        if isinstance(choice.get("prompt_token_ids"), list):
            self.prompt_ids = choice["prompt_token_ids"]
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.response_ids.extend(ids)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            if isinstance(logprobs.get("content"), list):
                self.logprobs.extend(t.get("logprob") for t in logprobs["content"])
            elif isinstance(logprobs.get("token_logprobs"), list):
                self.logprobs.extend(logprobs["token_logprobs"])
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
        if self.teacher:
            self._take_message(choice)

    def _take_message(self, choice: dict) -> None:
        """A teacher's assistant message: whole (``message``), or a stream's piece of it (``delta``: content to
        append, tool calls by ``index`` whose arguments come in pieces)."""
        message = choice.get("message")
        if isinstance(message, dict):
            self.message = {"content": message.get("content"), "tool_calls": list(message.get("tool_calls") or [])}
            return
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        if isinstance(delta.get("content"), str):
            self.message["content"] = (self.message["content"] or "") + delta["content"]
        calls = self.message["tool_calls"]
        for piece in delta.get("tool_calls") or ():
            index = piece.get("index", len(calls)) if isinstance(piece, dict) else None
            if not isinstance(index, int) or not 0 <= index <= len(calls):
                continue
            if index == len(calls):
                calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            call, function = calls[index], piece.get("function") or {}
            call["id"] = piece.get("id") or call["id"]
            call["function"]["name"] += function.get("name") or ""
            call["function"]["arguments"] += function.get("arguments") or ""

    def record(self) -> SpanRecord:
        """The call as a ``lit.engine.call`` span of its rollout attempt."""
        attrs: dict[str, Any] = {sc.LLM_API: self.api, sc.LLM_CHOICES: self.choices, sc.LLM_STREAMED: self.streamed,
                                 **self.sampling}
        for key, value in ((sc.AGENT_NAME, self.agent), (sc.LLM_CALL_ID, self.call_id), (sc.LLM_MODEL, self.model),
                           (sc.LLM_RESPONSE_ID, self.response_id), (sc.LLM_WEIGHT_VERSION, self.weight_version),
                           (sc.LLM_FINISH_REASON, self.finish_reason)):
            if value:
                attrs[key] = value
        if self.prompt_ids is not None and self.response_ids:
            attrs[sc.LLM_PROMPT_TOKEN_IDS] = self.prompt_ids
            attrs[sc.LLM_RESPONSE_TOKEN_IDS] = self.response_ids
            if len(self.logprobs) == len(self.response_ids) and all(_is_number(x) for x in self.logprobs):
                attrs[sc.LLM_RESPONSE_LOGPROBS] = [float(x) for x in self.logprobs]
        else:
            attrs[sc.LLM_TOKEN_IDS_MISSING] = True
        if self.teacher:
            attrs[sc.LLM_REQUEST_MESSAGES] = json.dumps(self.chat_request.get("messages"))
            if self.chat_request.get("tools"):
                attrs[sc.LLM_REQUEST_TOOLS] = json.dumps(self.chat_request["tools"])
            attrs[sc.LLM_RESPONSE_MESSAGE] = json.dumps(self.message)
        return SpanRecord(os.urandom(16).hex(), os.urandom(8).hex(), None, sc.ENGINE_CALL_SPAN, self.start_ns,
                          time.time_ns(), STATUS_ERROR if self.cut else STATUS_OK,
                          "the client left before the answer ended: the call is cut" if self.cut else "",
                          self.rollout_id, attrs)


def reward_record(rollout_id: str, body: object) -> SpanRecord:
    """A reward posted to the gateway (``{"value": <number>, "name": <text, optional>}``) as a ``lit.engine.reward``
    span of the attempt; ValueError in words for anything else. Whether the value is finite and within bounds is
    the episode builder's to check, as for every reward."""
    if not isinstance(body, dict) or not _is_number(body.get("value")):
        raise ValueError('a reward is a JSON object {"value": <number>, "name": <text, optional>}')
    name = body.get("name", "")
    if not isinstance(name, str) or len(name) > 200:
        raise ValueError("a reward's name is a text of at most 200 characters")
    now = time.time_ns()
    return SpanRecord(os.urandom(16).hex(), os.urandom(8).hex(), None, sc.ENGINE_REWARD_SPAN, now, now, STATUS_OK,
                      "", rollout_id, {sc.REWARD_VALUE: float(body["value"]), sc.REWARD_NAME: name})


def size_of(record: SpanRecord) -> int:
    """About how many bytes a record takes in the store (its token ids dominate; a teacher's call: its messages)."""
    attrs = record.attributes
    return 64 + 5 * sum(len(attrs.get(k, ())) for k in (sc.LLM_PROMPT_TOKEN_IDS, sc.LLM_RESPONSE_TOKEN_IDS)) + \
        9 * len(attrs.get(sc.LLM_RESPONSE_LOGPROBS, ())) + \
        sum(len(attrs.get(k, "")) for k in (sc.LLM_REQUEST_MESSAGES, sc.LLM_REQUEST_TOOLS, sc.LLM_RESPONSE_MESSAGE))


def sse_data(line: bytes) -> str | None:
    """The data of one line of a server-sent event stream (``data: ...``), or None for any other line."""
    if not line.startswith(b"data:"):
        return None
    return line[5:].strip().decode()


def sse_event(kind: str, data: dict) -> bytes:
    """One server-sent event, as the Responses API and Anthropic's Messages stream them."""
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
