"""Which agent is making this LLM call? Asked by the openai patch at the moment of the call.

Sources, most specific first:
1. LangGraph / LangChain: the runnable config of the running node (``lc_agent_name`` of ``create_agent(name=...)``,
   else the ``langgraph_node``).
2. OpenAI Agents SDK: the agent span enclosing the SDK's current span (tracked by a trace processor registered
   with the SDK, since openinference sets ``agent.name`` only when that span ends).
3. The nearest live OpenTelemetry ancestor that names an agent (AutoGen-AgentChat sets ``graph.node.id`` when its
   agent span starts; nested ``@lit.trace(agent=...)`` spans set ``lit.agent.name``).
4. The rollout's own agent (``@lit.trace(agent=...)``, else the traced function's name).

Knows the frameworks only through their public context accessors, imported only when already loaded.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Any

from lit_sdk import _context, semconv

_AGENT_KEYS = (semconv.AGENT_NAME, semconv.OI_AGENT_NAME, semconv.OI_GRAPH_NODE_ID)


def resolve_agent(processor: Any, current_span: Any) -> str:
    name = _langgraph_agent() or _agents_sdk.agent_of_current()
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
    config = config_module.var_child_runnable_config.get()
    if not config:
        return None
    metadata = config.get("metadata") or {}
    return metadata.get("lc_agent_name") or metadata.get("langgraph_node")


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

    def agent_of_current(self) -> str | None:
        if not self.registered:
            return None
        from agents.tracing import get_current_span

        span = get_current_span()
        span_id = getattr(span, "span_id", None)
        for _ in range(64):
            if span_id is None:
                return None
            with self._lock:
                parent, agent = self._spans.get(span_id, (None, None))
            if agent:
                return agent
            span_id = parent
        return None

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


_agents_sdk = _AgentsSdkTracker()


def track_agents_sdk() -> None:
    """Register the Agents SDK tracker once per process (the SDK has no way to remove a trace processor)."""
    _agents_sdk.register()


def untrack_agents_sdk() -> None:
    pass
