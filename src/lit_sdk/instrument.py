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
  instrumentor writes to. The bridge hands lit's processor the spans of lit's rollouts only (a span whose trace a
  rollout started, or that starts while a rollout is current); the user's other spans never reach the trainer. A
  provider's processors cannot be taken out again, so on ``uninstrument()`` the bridge goes quiet and stays, and the
  next ``instrument()`` reuses it. A failure of lit's in the bridge is logged and swallowed: that provider calls its
  processors on the user's thread and would let it through to their code.
- The bridged spans are the user's: their provider's sampler and span limits decide what is recorded, not lit's
  ALWAYS_ON and unlimited ones. That is right, as lit must not change what the user's backend gets, and enough: under
  the default parent-based sampler every span under lit's sampled rollout root is sampled, and what lit trains on
  (``lit.llm`` spans with the token ids, rewards, rollout roots) comes from lit's own provider as always. A sampler
  of theirs that drops spans costs lit only those framework spans (the agent names then come from the next source
  in ``_agents``). Their backend keeps every span; within a rollout a span's parent may be lit's root, which their
  backend gets only through ``otlp_endpoint``. An instrumentor the user turns on *after* ``lit.instrument()`` finds
  it on already: set up your own tracing first.
- ``otlp_endpoint`` (``LIT_OTLP_ENDPOINT``) sends lit's spans to an OTLP/HTTP endpoint as well, with OpenTelemetry's
  own exporter in a batch processor on lit's provider, which exports on a thread of its own. Its flush and shutdown
  run on a thread of their own too, waited for at most ``flush()``'s timeout and ``flush_timeout_s``: an endpoint
  that does not answer never holds up the agent, ``flush()`` or exit. The token ids and logprobs, and the rollout ids,
  that lit's processor adds to its wire records are not in that copy: they go to the trainer only.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, cast

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from lit_sdk import _agents, _context, _state, config
from lit_sdk._processor import LitSpanProcessor
from lit_sdk._spans import quietly
from lit_sdk.delivery import DeliveryCounts
from lit_sdk.install import pip_install
from lit_sdk.openai_instrumentor import LitOpenAIInstrumentor
from lit_sdk.protocol import security
from lit_sdk.sender import SpanSender

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
        # First: a missing exporter package stops instrument() before anything is started.
        self.otlp = _OtlpCopy(settings.otlp_endpoint, settings.flush_timeout_s) if settings.otlp_endpoint else None
        self.provider = _own_provider(settings.service_name)
        self.sender = SpanSender(settings.endpoint, spool_dir=settings.spool_dir,
                                 keys=security.client_keys(settings.keys_dir))
        self.processor = LitSpanProcessor(self.sender.submit)
        self.provider.add_span_processor(self.processor)
        if self.otlp is not None:
            self.provider.add_span_processor(self.otlp)
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
        processors = _span_processors_of(name, instrumentor)
        if processors is None:
            log.warning("lit: %s is already instrumented by another tracer provider that lit cannot reach; lit records "
                        "its LLM calls and rollouts, but not %s's own spans", name, name)
            return
        bridge = _bridges.get(processors)
        if bridge is None:  # the first lit on this provider; later ones reuse its bridge
            bridge = _bridges[processors] = _Bridge()
            processors.add_span_processor(bridge)
        bridge.processor = self.processor
        if bridge not in self.bridges:  # two frameworks the user instrumented onto one provider share it
            self.bridges.append(bridge)
        log.info("lit: %s was already instrumented; lit leaves it on and listens in", name)

    def close(self) -> DeliveryCounts:
        atexit.unregister(self.close)
        for bridge in self.bridges:
            bridge.processor = None  # a provider's processors cannot be taken out; the bridge goes quiet instead
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
        if self.otlp is not None:
            self.otlp.start_shutdown()  # beside the sender's: exit waits for the slower of the two, not for both
        counts = self.sender.shutdown(timeout=self.settings.flush_timeout_s)
        self.provider.shutdown()  # the OTLP copy's waits for what is left of its flush_timeout_s
        return counts

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
    keys_dir: Any = None,
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
    otlp_endpoint: an OTLP/HTTP traces URL (``http://host:4318/v1/traces``) that gets lit's spans as well
        (``LIT_OTLP_ENDPOINT``; needs lit's ``otlp`` extra); sent from a thread of its own, waited for
        within ``flush()``'s timeout and, at exit, ``flush_timeout_s``.
    keys_dir: the folder of this host's CURVE keys, which a trainer's collector with keys asks for
        (``LIT_KEYS_DIR``; docs/security.md).
    A framework the caller already instrumented for their own backend stays theirs: lit neither instruments it again
    nor turns it off, and takes from their tracer provider only the spans of its rollouts. Set up your own tracing
    first (module docstring; docs/tracing.md).
    """
    settings = config.resolve(endpoint, frameworks, llm_base_urls, spool_dir, service_name, flush_timeout_s,
                              keys_dir=keys_dir, otlp_endpoint=otlp_endpoint)
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
    """lit's span processor on a tracer provider of the user's: it hands ``processor`` the spans of lit's rollouts,
    and nothing while ``processor`` is None (lit is off)."""

    def __init__(self) -> None:
        self.processor: LitSpanProcessor | None = None

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        processor = self.processor
        if processor is not None:
            with quietly("take a span of the user's tracer provider"):
                if _context.current_rollout() is not None or processor.in_rollout(span):
                    processor.on_start(span, parent_context)

    def on_end(self, span: Any) -> None:
        processor = self.processor
        if processor is not None:
            with quietly("take a span of the user's tracer provider"):
                if processor.in_rollout(span):
                    processor.on_end(span)


_bridges: weakref.WeakKeyDictionary[Any, _Bridge] = weakref.WeakKeyDictionary()
"""lit's bridge on each of the user's providers (by its span processors), for as long as that provider lives."""


def _span_processors_of(name: str, instrumentor: Any) -> Any:
    """The span processors of the SDK tracer provider an openinference instrumentor writes to; None when they cannot
    be found. The way there starts where the instrumentor keeps its tracer: on itself (LangChain, AutoGen), in its
    processor registered with the Agents SDK, or in its wrapper of the openai client's ``request``. It goes down
    ``_tracer`` attributes (LangChain's callback tracer, openinference's ``OITracer`` proxy, OpenTelemetry's
    ``ProxyTracer``) to the SDK tracer, which shares its provider's processors."""
    node = instrumentor
    if name == "openai":
        import openai

        node = getattr(openai.OpenAI.request, "_self_wrapper", None)
    for _ in range(6):
        node = getattr(node, "_tracer", None) or getattr(node, "_processor", None)
        if node is None:
            return None
        for attribute in ("span_processor", "_active_span_processor"):  # the SDK tracer's, by OpenTelemetry version
            processors = getattr(node, attribute, None)
            if callable(getattr(processors, "add_span_processor", None)):
                return processors
    return None


class _OtlpCopy(SpanProcessor):
    """lit's spans to an OTLP/HTTP endpoint: OpenTelemetry's exporter in its batch processor, which exports on a thread
    of its own. That processor's ``force_flush`` exports on the caller's thread whatever its timeout, and its
    ``shutdown`` waits up to 30 s: an endpoint that does not answer would hold either for the exporter's timeout and
    retries. Here both run on a thread of their own, waited for at most ``force_flush``'s timeout and
    ``shutdown_timeout_s``; what is not exported by then is dropped."""

    def __init__(self, endpoint: str, shutdown_timeout_s: float):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError(f"sending lit's spans to the OTLP endpoint {endpoint} needs OpenTelemetry's OTLP "
                             f"exporter: {pip_install('otlp')}") from None
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.batch = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))
        self.shutdown_timeout_s = shutdown_timeout_s
        self._lock = threading.Lock()
        self._flushing: threading.Thread | None = None
        self._closing: threading.Thread | None = None
        self._closed_by = 0.0  # time.monotonic() when shutdown stops waiting

    def on_end(self, span: Any) -> None:
        self.batch.on_end(span)  # into its queue: never waits (a full queue drops the span, with a warning)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export what is queued, on a thread of its own (one at a time); wait for it up to ``timeout_millis``."""
        with self._lock:
            if self._closing is not None:
                return False
            if self._flushing is None or not self._flushing.is_alive():
                self._flushing = _in_background("lit-otlp-flush", self.batch.force_flush)
            flushing = self._flushing
        flushing.join(max(0, timeout_millis) / 1000)
        return not flushing.is_alive()

    def start_shutdown(self) -> threading.Thread:
        """Export what is queued and stop, on a thread of its own (once); ``shutdown()`` waits for it."""
        with self._lock:
            if self._closing is None:
                self._closed_by = time.monotonic() + self.shutdown_timeout_s
                self._closing = _in_background("lit-otlp-shutdown", self.batch.shutdown)
            return self._closing

    def shutdown(self) -> None:
        """Wait for ``start_shutdown()``'s thread until ``shutdown_timeout_s`` after it started."""
        self.start_shutdown().join(max(0.0, self._closed_by - time.monotonic()))


def _in_background(name: str, step: Callable[[], Any]) -> threading.Thread:
    def run() -> None:
        with quietly(f"run {name}"):
            step()

    thread = threading.Thread(target=run, name=name, daemon=True)  # daemon: exit never waits for an endpoint
    thread.start()
    return thread


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
    if current.otlp is None:
        return current.sender.flush(timeout)
    # Both copies at once, within one timeout: the OTLP export starts first, on its own thread.
    until = None if timeout is None else time.monotonic() + timeout
    current.otlp.force_flush(0)
    counts = current.sender.flush(timeout)
    current.otlp.force_flush(30_000 if until is None else int(max(0.0, until - time.monotonic()) * 1000))
    return counts


def _current() -> Instrumentation | None:
    # Only instrument() sets the state, always to an Instrumentation.
    return cast("Instrumentation | None", _state.active())
