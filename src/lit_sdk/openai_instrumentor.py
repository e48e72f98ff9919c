"""lit's OpenTelemetry instrumentor of the ``openai`` client: the one place every framework's LLM calls pass through.

For calls to a lit-managed engine (a base URL given to ``lit.instrument(llm_base_urls=...)``), it asks the engine
for token ids (``return_token_ids``) and logprobs, and records on a ``lit.llm`` span what RL needs: the engine's
prompt token ids, response token ids, response logprobs, response id, model, weight version (from the engine's
``lit_weight_version`` field) and agent name.
Chat and text completions and the Responses API, sync and async, streamed or not. Every recorded call carries its
span's id to the engine in the ``X-Lit-Call`` header: lit's gateway, in front of a lit-managed vLLM, records the
engine's token ids of every call under a rollout's URL, and the trainer makes the two records one transition. A
streamed answer and the Responses API carry no token ids, so their spans hold none of their own (the span ends when
``create`` returns, the stream still open); calls to other endpoints pass through untouched and unrecorded.

The user's call is never changed beyond the two request fields, its exceptions pass through unchanged, and a
failure of lit's own recording is logged and swallowed.

``LitOpenAIInstrumentor`` is an OpenTelemetry ``BaseInstrumentor`` that wraps the ``create`` functions with wrapt;
``uninstrument()`` puts the original functions back. It is distinct from openinference's ``OpenAIInstrumentor``
(message text, no token ids), which ``lit.instrument(frameworks=[..., "openai"])`` may turn on beside it.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection
from typing import Any

import wrapt
from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from lit_sdk import _agents, _context, semconv
from lit_sdk._spans import close_span, mark_failed, quietly

INSTRUMENTS = ("openai >= 1.60",)
"""The package this instrumentor patches (as in pyproject's ``frameworks`` extra)."""

_TARGETS = (
    ("openai.resources.chat.completions.completions", "Completions", "chat"),
    ("openai.resources.chat.completions.completions", "AsyncCompletions", "chat"),
    ("openai.resources.completions", "Completions", "completion"),
    ("openai.resources.completions", "AsyncCompletions", "completion"),
    ("openai.resources.responses.responses", "Responses", "responses"),
    ("openai.resources.responses.responses", "AsyncResponses", "responses"),
)
CALL_HEADER = "X-Lit-Call"
"""The header that carries the ``lit.llm`` span's id with the call, so that lit's gateway, which records the call at
the engine, names the same call (``semconv.LLM_CALL_ID``; ``lit_trainer.intake.gateway.server.CALL_HEADER``)."""
AGENT_HEADER = "X-Lit-Agent"
"""The header that names the calling agent to lit's gateway, which serves the call by that agent's adapter when the
run has a ``[roles]`` table (``lit_trainer.intake.gateway.server.AGENT_HEADER``)."""


ENGINE_VERSION_FIELD = "lit_weight_version"
"""The field of a lit-managed vLLM's answer that holds its weight version when the request arrived (added by the
trainer's route guard, ``lit_trainer.engine.route_guard.VERSION_FIELD``), recorded as ``LLM_WEIGHT_VERSION``."""


class LitOpenAIInstrumentor(BaseInstrumentor):
    """Wraps the openai client's chat and text ``create`` functions (sync and async) to record engine token ids.

    ``instrument(llm_base_urls=..., processor=..., tracer=...)``: the base URLs of the lit-managed engines (others
    pass through unrecorded; ``"*"`` manages all), the ``LitSpanProcessor`` that takes the token ids, and the
    tracer the ``lit.llm`` spans start on (``lit.instrument()`` passes all three). Like every ``BaseInstrumentor``
    it is one instance per process and a second ``instrument()`` while on is a no-op: to change the settings,
    ``uninstrument()`` first.
    """

    _originals: tuple[tuple[type, Any], ...] = ()

    def instrumentation_dependencies(self) -> Collection[str]:
        return INSTRUMENTS

    def _instrument(self, **kwargs: Any) -> None:
        patch = _Patch(kwargs.get("llm_base_urls") or (), kwargs.get("processor"), kwargs.get("tracer"))
        originals: list[tuple[type, Any]] = []
        try:
            for module_name, class_name, api in _TARGETS:
                cls = getattr(importlib.import_module(module_name), class_name)
                original = cls.__dict__["create"]
                is_async = class_name.startswith("Async")
                wrapper = patch.async_wrapper(api) if is_async else patch.sync_wrapper(api)
                wrapt.wrap_function_wrapper(cls, "create", wrapper)
                originals.append((cls, original))
        except BaseException:
            _restore(originals)  # all or nothing: BaseInstrumentor stays "off" when this raises
            raise
        self._originals = tuple(originals)

    def _uninstrument(self, **kwargs: Any) -> None:
        _restore(self._originals)
        self._originals = ()


def _restore(originals: Collection[tuple[type, Any]]) -> None:
    """Put the saved functions back, so that each patched attribute is its original again (identity)."""
    for cls, original in reversed(list(originals)):
        setattr(cls, "create", original)


class _Patch:
    """One ``instrument()``'s settings and the wrappers that use them: which base URLs are managed, and where the
    recorded calls go."""

    def __init__(self, llm_base_urls: str | Collection[str], processor: Any, tracer: Any):
        urls = (llm_base_urls,) if isinstance(llm_base_urls, str) else tuple(llm_base_urls)
        if urls and (processor is None or tracer is None):
            raise TypeError("LitOpenAIInstrumentor.instrument(llm_base_urls=...) also needs processor= and tracer=")
        self.llm_base_urls = tuple(u.rstrip("/") for u in urls)
        self.processor = processor
        self.tracer = tracer

    def sync_wrapper(self, api: str):
        def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            call = self._begin(instance, kwargs, api)
            if call is None:
                return wrapped(*args, **kwargs)
            try:
                result = wrapped(*args, **call.kwargs)
            except BaseException as exc:
                call.fail(exc)
                raise
            call.finish(result)
            return result

        return wrapper

    def async_wrapper(self, api: str):
        async def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            call = self._begin(instance, kwargs, api)
            if call is None:
                return await wrapped(*args, **kwargs)
            try:
                result = await wrapped(*args, **call.kwargs)
            except BaseException as exc:
                call.fail(exc)
                raise
            call.finish(result)
            return result

        return wrapper

    def _begin(self, instance: Any, kwargs: dict, api: str) -> _Call | None:
        # Only calls inside a rollout to a managed engine are recorded; everything else passes through as is.
        recorded = False
        with quietly("tell whether to record an LLM call") as deciding:
            recorded = _context.current_rollout() is not None and self._is_managed(instance)
        if deciding.failed or not recorded:
            return None
        call = _Call(self.processor, api)
        with quietly("start recording an LLM call") as starting:
            call.start(self.tracer, kwargs)
        if starting.failed:
            call.close()  # the request goes out as the user made it, unrecorded
            return None
        return call

    def _is_managed(self, instance: Any) -> bool:
        if not self.llm_base_urls:
            return False
        try:
            base = str(instance._client.base_url).rstrip("/")
        except AttributeError:
            return False
        # a managed URL, or a rollout's own URL under lit's gateway (its root is among the managed ones)
        return "*" in self.llm_base_urls or any(base == u or base.startswith(u + "/") for u in self.llm_base_urls)


class _Call:
    """One recorded LLM call: the request fields lit adds, and the span that records the answer. Each of lit's
    steps runs ``quietly``."""

    __slots__ = ("api", "kwargs", "processor", "span", "streamed", "token")

    def __init__(self, processor: Any, api: str):
        self.api = api
        self.processor = processor
        self.kwargs: dict = {}
        self.span: Any = None
        self.token: Any = None
        self.streamed = False

    def start(self, tracer: Any, kwargs: dict) -> None:
        # A streamed answer and the Responses API carry no token ids: the engine's come from lit's gateway, which
        # records the call under the same id (CALL_HEADER).
        self.streamed = kwargs.get("stream") is True
        self.kwargs = dict(kwargs) if self.streamed or self.api == "responses" else _with_token_ids(kwargs, self.api)
        parent = otel_trace.get_current_span()
        agent = _agents.resolve_agent(self.processor, parent)
        attrs: dict[str, Any] = {semconv.LLM_API: self.api, semconv.AGENT_NAME: agent}
        attrs.update(sampling_attributes(kwargs))
        rollout = _context.current_rollout()
        if rollout is not None and rollout.weight_version is not None:
            attrs[semconv.LLM_WEIGHT_VERSION] = rollout.weight_version
        if self.streamed:
            attrs[semconv.LLM_STREAMED] = True
        self.span = tracer.start_span(semconv.LLM_SPAN, attributes=attrs, kind=otel_trace.SpanKind.CLIENT)
        self.token = otel_context.attach(otel_trace.set_span_in_context(self.span))
        headers = self.kwargs.get("extra_headers")
        self.kwargs["extra_headers"] = {**(headers if isinstance(headers, dict) else {}),
                                        CALL_HEADER: format(self.span.get_span_context().span_id, "016x")}
        if agent and agent.isascii() and agent.isprintable():  # HTTP headers are ASCII
            self.kwargs["extra_headers"][AGENT_HEADER] = agent

    def finish(self, result: Any) -> None:
        with quietly("record an LLM response"):
            if self.streamed or self.api == "responses":  # the gateway records what the engine sampled
                self.span.set_attribute(semconv.LLM_TOKEN_IDS_MISSING, True)
            else:
                bulk = record_response(self.span, _parsed(result), self.api)
                if bulk:
                    self.processor.attach_bulk(self.span, bulk)
            self.span.set_status(otel_trace.Status(otel_trace.StatusCode.OK))
        self.close()

    def fail(self, exc: BaseException) -> None:
        with quietly("record an LLM call's exception"):
            mark_failed(self.span, exc)
        self.close()

    def close(self) -> None:
        close_span(self.span, self.token)
        self.span = self.token = None


def _with_token_ids(kwargs: dict, api: str) -> dict:
    """The request with ``return_token_ids`` (vLLM) and response logprobs asked for; the caller's dict is kept."""
    out = dict(kwargs)
    extra = out.get("extra_body")
    out["extra_body"] = {**(extra if isinstance(extra, dict) else {}), "return_token_ids": True}
    if api == "chat":
        if not out.get("logprobs"):
            out["logprobs"] = True
    elif not isinstance(out.get("logprobs"), int) or isinstance(out.get("logprobs"), bool):
        out["logprobs"] = 0  # completions: 0 = the sampled token's logprob only
    return out


# Sampling settings that reshape the distribution beyond temperature, with the value that leaves it as it is.
_NEUTRAL_SAMPLING = {"top_p": 1.0, "top_k": (0, -1), "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                     "repetition_penalty": 1.0, "logit_bias": ({}, None)}


def sampling_attributes(kwargs: dict) -> dict[str, Any]:
    """The span attributes of a request's sampling settings (top level or in ``extra_body``): its temperature, and
    the settings beyond temperature that reshape the distribution (``semconv.LLM_SAMPLING_UNSUPPORTED``)."""
    extra = kwargs.get("extra_body")
    settings = {**(extra if isinstance(extra, dict) else {}), **{k: v for k, v in kwargs.items() if v is not None}}
    attrs: dict[str, Any] = {}
    temperature = settings.get("temperature")
    if _is_number(temperature):
        attrs[semconv.LLM_TEMPERATURE] = float(temperature)
    unsupported = []
    for name, neutral in _NEUTRAL_SAMPLING.items():
        value = settings.get(name)
        # Only real values count: frameworks pass the client's NOT_GIVEN / Omit sentinels for unset fields.
        given = isinstance(value, dict) if name == "logit_bias" else _is_number(value)
        if not given or value in (neutral if isinstance(neutral, tuple) else (neutral,)):
            continue
        unsupported.append(f"{name}={value!r}" if isinstance(value, dict) else f"{name}={value}")
    if unsupported:
        attrs[semconv.LLM_SAMPLING_UNSUPPORTED] = ",".join(unsupported)
    return attrs


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parsed(result: Any) -> Any:
    # ``with_raw_response.create`` returns a raw response wrapper; its parse() is cached, so calling it is free.
    # ``parse`` is looked up on the class first: a missing attribute of a pydantic model instance (the usual
    # result) goes through its slow __getattr__. ``http_response`` is an instance attribute of the wrapper.
    if hasattr(type(result), "parse") and hasattr(result, "http_response"):
        return result.parse()
    return result


def record_response(span: Any, response: Any, api: str) -> dict[str, list]:
    """Set the call's scalar attributes on the span and return the engine's ids and logprobs of choice 0 (only
    when they are consistent) for the span processor to add to the record."""
    choices = getattr(response, "choices", None) or []
    attrs: dict[str, Any] = {semconv.LLM_CHOICES: len(choices)}  # set at once: each set_attribute takes a lock
    if getattr(response, "model", None):
        attrs[semconv.LLM_MODEL] = response.model
    if getattr(response, "id", None):
        attrs[semconv.LLM_RESPONSE_ID] = response.id
    extra = getattr(response, "model_extra", None)  # pydantic's fields beyond OpenAI's (a dict, or None)
    version = extra.get(ENGINE_VERSION_FIELD) if extra else None
    if isinstance(version, str):
        attrs[semconv.LLM_WEIGHT_VERSION] = version  # the engine's own: it outranks the one given at dispatch
    choice = choices[0] if choices else None
    if getattr(choice, "finish_reason", None):
        attrs[semconv.LLM_FINISH_REASON] = str(choice.finish_reason)
    bulk = _engine_ids(response, choice, api) if choice is not None else {}
    if not bulk:
        attrs[semconv.LLM_TOKEN_IDS_MISSING] = True
    span.set_attributes(attrs)
    return bulk


def _engine_ids(response: Any, choice: Any, api: str) -> dict[str, list]:
    """The prompt and response token ids of ``choice`` (and its logprobs when there is one per token), or {}."""
    if api == "chat":
        prompt_ids = getattr(response, "prompt_token_ids", None)
        logprobs = getattr(choice, "logprobs", None)
        content = getattr(logprobs, "content", None) if logprobs is not None else None
        response_logprobs = [t.logprob for t in content] if content else None
    else:
        prompt_ids = getattr(choice, "prompt_token_ids", None)
        logprobs = getattr(choice, "logprobs", None)
        response_logprobs = getattr(logprobs, "token_logprobs", None) if logprobs is not None else None
    response_ids = getattr(choice, "token_ids", None)
    if not isinstance(prompt_ids, list) or not isinstance(response_ids, list):
        return {}
    bulk = {semconv.LLM_PROMPT_TOKEN_IDS: prompt_ids, semconv.LLM_RESPONSE_TOKEN_IDS: response_ids}
    if response_logprobs is not None and len(response_logprobs) == len(response_ids):
        bulk[semconv.LLM_RESPONSE_LOGPROBS] = [float(x) for x in response_logprobs]
    return bulk
