from __future__ import annotations

from dataclasses import dataclass

import pytest
from ack_server import AckServer
from fake_llm import FakeLLM

import lit_sdk as lit


@dataclass
class Tracing:
    """A test's view of one instrumented process: the engine it calls and the spans that reached the trainer."""

    llm: FakeLLM
    server: AckServer

    def delivered(self) -> list[dict]:
        counts = lit.flush(timeout=10)
        assert counts is not None and counts.pending == 0 and counts.dropped == 0, counts
        return self.server.spans()


@pytest.fixture
def tracing(tmp_path):
    with FakeLLM(tool_args={"a": 2, "b": 3}) as llm, AckServer() as server:
        lit.instrument(endpoint=server.endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path / "spool")
        try:
            yield Tracing(llm, server)
        finally:
            lit.uninstrument()


@pytest.fixture(autouse=True)
def _agents_sdk_stays_on_this_machine():
    # The Agents SDK uploads traces to OpenAI by default; nothing may leave this machine in tests.
    import agents

    agents.set_trace_processors([])
