"""``lit.instrument()``: one line that makes an agent process send its rollouts to the trainer.

It builds an OpenTelemetry TracerProvider of lit's own (the global provider is left alone), whose span processor
hands finished spans to the ZeroMQ sender; turns on lit's openai instrumentor, which records engine token ids; and
turns on the openinference instrumentors of the frameworks that are installed (missing ones are skipped quietly, one
that fails to turn on with a warning). Calling it twice with the same settings does nothing; with other settings it
reconfigures. ``uninstrument()`` restores every patched function and delivers (or spools) what is left.

Beside the user's own tracing (docs/tracing.md):
- An openinference instrumentor the user already turned on for their own backend (Phoenix, Jaeger, any OTLP
  endpoint) stays theirs: lit does not instrument it again (OpenTelemetry instrumentors are one per process) and never
  turns it off. lit listens in instead: it adds a bridge to the span processors of the tracer provider that
  instrumentor writes to, which hands lit the spans that belong to a lit rollout (others it ignores), and goes quiet
  on ``uninstrument()``. Their backend keeps every span; lit's LLM spans (``lit.llm``) and rollout roots come from
  lit's own provider as always. An instrumentor the user turns on *after* ``lit.instrument()`` finds it on already:
  set up your own tracing first.
- ``otlp_endpoint`` (``LIT_OTLP_ENDPOINT``) sends lit's spans to an OTLP/HTTP endpoint as well, with OpenTelemetry's
  own exporter in a batch processor on lit's provider (never on the agent's thread). The token ids and logprobs that
  lit attaches in bulk are not in that copy: they go to the trainer only.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import logging
import threading
from typing import Any, cast

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from lit_sdk import _agents, _state, config, security
from lit_sdk._processor import LitSpanProcessor
from lit_sdk.openai_instrumentor import LitOpenAIInstrumentor
from lit_sdk.sender import DeliveryCounts, SpanSender

log = logging.getLogger("lit")
_lock = threading.Lock()

# name -> (package that must be importable, instrumentor "module:Class", extra instrument() kwargs)
_INSTRUMENTORS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "langchain": ("langchain_core", "openinference.instrumentation.langchain:LangChainInstrumentor", {}),
    "autogen": (
        "autogen_agentchat",
        "openinference.instrumentation.autogen_agentchat:AutogenAgentChatInstrumentor",
        {},
    ),
    "openai_agents": (
        "agents",
        "openinference.instrumentation.openai_agents:OpenAIAgentsInstrumentor",
        # Additive: keep the processors the user registered with the Agents SDK.
        {"exclusive_processor": False},
    ),
    "openai": ("openai", "openinference.instrumentation.openai:OpenAIInstrumentor", {}),
}


class Instrumentation:
    """Everything ``instrument()`` turned on, so that ``uninstrument()`` can turn it off again."""

    def __init__(self, settings: config.SdkSettings):
        self.settings = settings
        self.provider = _own_provider(settings.service_name)
        self.sender = SpanSender(settings.endpoint, spool_dir=settings.spool_dir,
                                 keys=security.client_keys(settings.keys_dir))
        self.processor = LitSpanProcessor(self.sender.submit)
        self.provider.add_span_processor(self.processor)
        if settings.otlp_endpoint:
            self.provider.add_span_processor(_otlp_processor(settings.otlp_endpoint))
        self.tracer = self.provider.get_tracer("lit_sdk")
        self.bridges: list[_Bridge] = []
        self.openai_instrumentor = LitOpenAIInstrumentor()
        self.openai_on = False
        self.instrumentors: list[Any] = []

    def start(self) -> None:
        self._start_openai()
        for name in self.settings.frameworks:
            try:
                self._start_framework(name)
            except Exception:  # one framework's instrumentor that fails leaves the others on
                log.warning("lit: could not instrument %s; its spans are not recorded", name, exc_info=True)
        atexit.register(self.close)

    def _start_framework(self, name: str) -> None:
        """Turn on the openinference instrumentor of ``name`` (skipped quietly when it is not installed)."""
        package, target, kwargs = _INSTRUMENTORS[name]
        if importlib.util.find_spec(package) is None:
            log.debug("lit: %s is not installed; not instrumented", package)
            return
        module_name, class_name = target.split(":")
        try:
            instrumentor = getattr(importlib.import_module(module_name), class_name)()
        except ImportError:
            log.debug("lit: the openinference instrumentor for %s is not installed", name)
            return
        if instrumentor.is_instrumented_by_opentelemetry:  # the user's, for their own backend: leave it theirs
            self._listen_in(name, instrumentor)
        else:
            instrumentor.instrument(tracer_provider=self.provider, **kwargs)
            self.instrumentors.append(instrumentor)
        if name == "openai_agents":
            _agents.track_agents_sdk()

    def _listen_in(self, name: str, instrumentor: Any) -> None:
        """Get the spans of an instrumentor someone else turned on, through a bridge on its provider's processors."""
        processors = _span_processors_of(instrumentor)
        if processors is None:
            log.warning("lit: %s is already instrumented by another tracer provider that lit cannot reach; lit records "
                        "its LLM calls and rollouts, but not %s's own spans", name, name)
            return
        bridge = _Bridge(self.processor)
        processors.add_span_processor(bridge)
        self.bridges.append(bridge)
        log.info("lit: %s was already instrumented; lit leaves it on and listens in", name)

    def close(self) -> DeliveryCounts:
        atexit.unregister(self.close)
        for bridge in self.bridges:
            bridge.enabled = False  # a provider's processors cannot be removed; the bridge goes quiet instead
        self.bridges.clear()
        for instrumentor in reversed(self.instrumentors):
            try:
                instrumentor.uninstrument()
            except Exception:
                log.exception("lit: could not turn off %s", type(instrumentor).__name__)
        self.instrumentors.clear()
        _agents.untrack_agents_sdk()
        if self.openai_on:
            self.openai_on = False
            if self.openai_instrumentor.is_instrumented_by_opentelemetry:
                self.openai_instrumentor.uninstrument()
        self.provider.shutdown()
        return self.sender.shutdown(timeout=self.settings.flush_timeout_s)

    def _start_openai(self) -> None:
        """Turn on lit's openai instrumentor with these settings (skipped quietly when openai is not installed)."""
        if importlib.util.find_spec("openai") is None:
            log.debug("lit: openai is not installed; its client is not patched")
            return
        instrumentor = self.openai_instrumentor
        if instrumentor.is_instrumented_by_opentelemetry:  # turned on outside lit.instrument(): these settings win
            instrumentor.uninstrument()
        instrumentor.instrument(llm_base_urls=self.settings.llm_base_urls, processor=self.processor, tracer=self.tracer)
        self.openai_on = instrumentor.is_instrumented_by_opentelemetry


def instrument(
    endpoint: str | None = None,
    frameworks: list[str] | tuple[str, ...] | None = None,
    llm_base_urls: list[str] | tuple[str, ...] | str | None = None,
    spool_dir: Any = None,
    service_name: str | None = None,
    flush_timeout_s: float | None = None,
    otlp_endpoint: str | None = None,
) -> Instrumentation:
    """Trace this process's agents and send their spans to the trainer. Idempotent.

    endpoint: the trainer's collector (``LIT_ENDPOINT``, default ``tcp://127.0.0.1:7373``).
    frameworks: openinference instrumentors to turn on if installed (``LIT_FRAMEWORKS``; default langchain,
        autogen, openai_agents; ``openai`` adds openinference's span with the message text of each openai call).
        lit's own patch of the openai client, which records token ids, is always on.
    llm_base_urls: base URLs of the lit-managed engine(s) whose calls record token ids (``LIT_LLM_BASE_URLS``).
    spool_dir: where spans wait on disk while the trainer is away (``LIT_SPOOL_DIR``).
    service_name: this process's OpenTelemetry service name (``LIT_SERVICE_NAME``).
    flush_timeout_s: how long exit waits for delivery before spooling the rest (``LIT_FLUSH_TIMEOUT``, 5 s).
    otlp_endpoint: an OTLP/HTTP traces URL that gets lit's spans as well (``LIT_OTLP_ENDPOINT``; the ``otlp`` extra).
    Frameworks the caller already instrumented for their own tracing stay theirs (module docstring).
    """
    settings = config.resolve(endpoint, frameworks, llm_base_urls, spool_dir, service_name, flush_timeout_s,
                              otlp_endpoint=otlp_endpoint)
    with _lock:
        current = _current()
        if current is not None:
            if current.settings == settings:
                return current
            current.close()
            _state.set_active(None)
        instrumentation = Instrumentation(settings)
        try:
            instrumentation.start()
        except Exception:
            instrumentation.close()
            raise
        _state.set_active(instrumentation)
        return instrumentation


class _Bridge(SpanProcessor):
    """lit's span processor on a provider that is not lit's, until ``enabled`` is turned off."""

    def __init__(self, processor: LitSpanProcessor):
        self.processor = processor
        self.enabled = True

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if self.enabled:
            self.processor.on_start(span, parent_context)

    def on_end(self, span: Any) -> None:
        if self.enabled:
            self.processor.on_end(span)


def _span_processors_of(instrumentor: Any) -> Any:
    """The span processors of the SDK tracer provider an openinference instrumentor writes to, found down its chain
    of ``_tracer`` attributes (LangChain's callback tracer, openinference's ``OITracer`` proxy, OpenTelemetry's
    ``ProxyTracer``) to the SDK tracer, which shares its provider's processors; None when it is not there (the Agents
    SDK's instrumentor keeps its tracer inside a processor of that SDK)."""
    node = instrumentor
    for _ in range(5):
        node = getattr(node, "_tracer", None)
        if node is None:
            return None
        for name in ("span_processor", "_active_span_processor"):  # the SDK tracer's, by OpenTelemetry version
            processors = getattr(node, name, None)
            if callable(getattr(processors, "add_span_processor", None)):
                return processors
    return None


def _otlp_processor(endpoint: str) -> SpanProcessor:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ValueError(f"sending lit's spans to the OTLP endpoint {endpoint} needs OpenTelemetry's OTLP exporter: "
                         "pip install 'lit-rl[otlp]'") from None
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    return BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))


def _own_provider(service_name: str) -> TracerProvider:
    """lit's tracer provider, deaf to the OpenTelemetry settings a user sets for their own telemetry: with
    ``OTEL_SDK_DISABLED=true``, a sampler such as ``always_off`` or attribute limits from the environment, lit
    would record nothing, or lose the token ids, silently."""
    unlimited = SpanLimits(max_span_attributes=SpanLimits.UNSET, max_attribute_length=SpanLimits.UNSET,
                           max_event_attributes=SpanLimits.UNSET, max_attributes=SpanLimits.UNSET)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}), sampler=ALWAYS_ON,
                              span_limits=unlimited)
    if getattr(provider, "_disabled", False):  # OTEL_SDK_DISABLED: read at construction, no argument for it
        provider._disabled = False
    return provider


def uninstrument() -> DeliveryCounts | None:
    """Undo ``instrument()``: original functions back, pending spans delivered or spooled. None if not on."""
    with _lock:
        current = _current()
        if current is None:
            return None
        _state.set_active(None)
        return current.close()


def flush(timeout: float | None = None) -> DeliveryCounts | None:
    """Wait until every span ended so far is acknowledged by the trainer (or ``timeout`` passes); the counts."""
    current = _current()
    if current is None:
        return None
    current.provider.force_flush()
    return current.sender.flush(timeout)


def _current() -> Instrumentation | None:
    # Only instrument() sets the state, always to an Instrumentation.
    return cast("Instrumentation | None", _state.active())
