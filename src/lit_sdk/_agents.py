"""Which agent is making this LLM call? Asked by the openai patch at the moment of the call.

Sources, most specific first (a source that fails is skipped: naming never breaks the user's call):
1. LangGraph / LangChain: the runnable config of the running node (``lc_agent_name`` of ``create_agent(name=...)``,
   else the ``langgraph_node``). LangSmith tracing and callbacks do not change it.
2. OpenAI Agents SDK, while an SDK span is current: the agent span enclosing it, from a trace processor registered
   with the SDK (openinference sets ``agent.name`` only when that span ends); for a span no processor saw (the
   SDK's tracing off: ``set_tracing_disabled(True)``, ``RunConfig(tracing_disabled=True)``,
   ``OPENAI_AGENTS_DISABLE_TRACING``, all of which make no-op spans), the agent whose model the run loop fetched
   last in this task (``_AgentsSdkModels``).
3. The nearest live OpenTelemetry ancestor that names an agent (AutoGen-AgentChat sets ``graph.node.id`` when its
   agent span starts, on lit's tracer provider, so AutoGen's own runtime tracing settings do not change it; nested
   ``@lit.trace(agent=...)`` spans set ``lit.agent.name``).
4. The rollout's own agent (``@lit.trace(agent=...)``, else the traced function's name).

Imports a framework only when it is already loaded.
"""

from __future__ import annotations

import contextvars
import sys
import threading
from collections import OrderedDict
from typing import Any

from lit_sdk import _context, semconv

_AGENT_KEYS = (semconv.AGENT_NAME, semconv.OI_AGENT_NAME, semconv.OI_GRAPH_NODE_ID)


def resolve_agent(processor: Any, current_span: Any) -> str:
    name = _langgraph_agent() or _agents_sdk_agent()
    if name:
        return name
    for span in processor.ancestors(current_span):
        attrs = getattr(span, "attributes", None) or {}
        for key in _AGENT_KEYS:
            if attrs.get(key):
                return str(attrs[key])
    rollout = _context.current_rollout()
    return (rollout.agent if rollout else None) or ""


def _langgraph_agent() -> str | None:
    config_module = sys.modules.get("langchain_core.runnables.config")
    if config_module is None:
        return None
    try:
        config = config_module.var_child_runnable_config.get()
        metadata = (config.get("metadata") if config else None) or {}
        return metadata.get("lc_agent_name") or metadata.get("langgraph_node")
    except Exception:  # naming never breaks the user's call
        return None


def _agents_sdk_agent() -> str | None:
    """None outside SDK spans, so that a later call of the same rollout made outside the SDK is not named after
    the SDK's last agent."""
    if not (_agents_sdk.registered or _agents_sdk_models.patched):
        return None
    try:
        from agents.tracing import get_current_span

        span = get_current_span()
        if span is None:
            return None
        seen, agent = _agents_sdk.agent_of(span)
        return agent if seen else _agents_sdk_models.agent_of_current()
    except Exception:  # naming never breaks the user's call
        return None


class _AgentsSdkTracker:
    """A trace processor for the OpenAI Agents SDK: remembers which SDK span is an agent span, and its parent."""

    MAX_SPANS = 50_000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: OrderedDict[str, tuple[str | None, str | None]] = OrderedDict()
        self.registered = False

    def register(self) -> None:
        """Add this tracker to the SDK's processors unless it is there (the user may have reset the list)."""
        import agents
        from agents.tracing import get_trace_provider

        multi = getattr(get_trace_provider(), "_multi_processor", None)
        current = getattr(multi, "_processors", None)
        if current is not None:
            if any(p is self for p in current):
                return
        elif self.registered:  # an SDK whose processor list lit cannot see: add once per process
            return
        agents.add_trace_processor(self)
        self.registered = True

    def agent_of(self, span: Any) -> tuple[bool, str | None]:
        """Whether this tracker saw the span (it sees none while the SDK's tracing is off), and the agent span
        enclosing it."""
        span_id = getattr(span, "span_id", None)
        with self._lock:
            if span_id not in self._spans:
                return False, None
            for _ in range(64):
                parent, agent = self._spans.get(span_id, (None, None))
                if agent:
                    return True, agent
                if parent is None:
                    break
                span_id = parent
        return True, None

    # TracingProcessor interface (duck-typed: the SDK only calls these methods).
    def on_span_start(self, span: Any) -> None:
        data = getattr(span, "span_data", None)
        agent = getattr(data, "name", None) if getattr(data, "type", None) == "agent" else None
        with self._lock:
            self._spans[span.span_id] = (span.parent_id, agent)
            if len(self._spans) > self.MAX_SPANS:
                self._spans.popitem(last=False)

    def on_span_end(self, span: Any) -> None:
        pass  # kept until evicted: children of a span may still ask after it ends

    def on_trace_start(self, trace: Any) -> None:
        pass

    def on_trace_end(self, trace: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def force_flush(self) -> None:
        pass


class _AgentsSdkModels:
    """Names the calls while the Agents SDK's tracing is off, by wrapping its run loop's ``get_model(agent,
    run_config)``: plain, streamed and sync runs call it before every model call, in the task that then calls the
    model, so the agent's name set in a context variable there reaches the call. The other ways fail: a no-op span
    keeps its agent's name but not its parent, and the call runs under the generation span; the public hooks
    (``RunHooks.on_llm_start``, ``Agent.get_system_prompt``) run in tasks of their own (``asyncio.gather``), whose
    context variables never reach the call. The run loop also fetches models in the caller's task (turns after
    the first), so a name counts only under the SDK trace it was set in: not after the run."""

    TARGET = ("agents.run_internal.run_loop", "get_model")

    def __init__(self) -> None:
        self._agent: contextvars.ContextVar[tuple[str, Any] | None] = contextvars.ContextVar(
            "lit_agents_sdk_agent", default=None
        )
        self._wrapper: Any = None

    @property
    def patched(self) -> bool:
        return self._wrapper is not None

    def patch(self) -> None:
        """Wrap ``get_model``; on SDK versions without it, the tracker alone names the calls while tracing is on."""
        if self._wrapper is not None:
            return
        import wrapt

        try:
            self._wrapper = wrapt.wrap_function_wrapper(*self.TARGET, self._remember)
        except (ImportError, AttributeError):
            pass

    def unpatch(self) -> None:
        if self._wrapper is None:
            return
        module, name = sys.modules[self.TARGET[0]], self.TARGET[1]
        if getattr(module, name, None) is self._wrapper:  # else someone wrapped it since: theirs stays
            setattr(module, name, self._wrapper.__wrapped__)
        self._wrapper = None

    def _remember(self, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        try:
            from agents.tracing import get_current_trace

            name = getattr(args[0] if args else kwargs["agent"], "name", None)
            self._agent.set((name, get_current_trace()) if isinstance(name, str) and name else None)
        except Exception:  # naming never breaks the user's run
            pass
        return wrapped(*args, **kwargs)

    def agent_of_current(self) -> str | None:
        remembered = self._agent.get()
        if remembered is None:
            return None
        from agents.tracing import get_current_trace

        name, trace = remembered
        return name if get_current_trace() is trace else None


_agents_sdk = _AgentsSdkTracker()
_agents_sdk_models = _AgentsSdkModels()


def track_agents_sdk() -> None:
    """Name Agents SDK calls: wrap the run loop's model lookup and register the tracker (once per process: the SDK
    has no way to remove a trace processor, and it only remembers spans)."""
    _agents_sdk_models.patch()
    _agents_sdk.register()


def untrack_agents_sdk() -> None:
    """Restore the run loop's model lookup (``uninstrument()``); the tracker stays registered."""
    _agents_sdk_models.unpatch()
