"""lit's spans sent to an OTLP endpoint as well as to the trainer: a real OTLP/HTTP receiver (an HTTP server that
decodes OpenTelemetry's protobuf ``ExportTraceServiceRequest``, as a collector does) gets the same spans, by id; an
endpoint that never answers holds up neither the agent nor ``flush()`` nor exit."""

from __future__ import annotations

import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from ack_server import AckServer
from fake_llm import FakeLLM
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

import lit_sdk as lit
from lit_sdk import semconv as sc
from lit_sdk.install import pip_install


class OtlpReceiver:
    """An OTLP/HTTP traces endpoint on a free loopback port that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = ExportTraceServiceRequest()
                request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        receiver.spans.extend(scope.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


def test_the_same_spans_reach_the_trainer_and_an_otlp_receiver(receiver, tmp_path, monkeypatch):
    monkeypatch.setenv("LIT_OTLP_ENDPOINT", receiver.url)  # the environment's way; the argument is the other
    with FakeLLM() as llm, AckServer() as server:
        lit.instrument(endpoint=server.endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path / "spool")
        try:
            client = openai.OpenAI(base_url=llm.base_url, api_key="unused")

            @lit.trace(agent="solver")
            def solve(question: str) -> float:
                client.chat.completions.create(model="policy", messages=[{"role": "user", "content": question}])
                lit.reward(0.5, name="format")
                return 1.0

            for question in ("2+3?", "4+5?"):
                assert solve(question) == 1.0
            counts = lit.flush(timeout=10)  # also flushes the OTLP exporter's batch
            assert counts is not None and counts.pending == 0
        finally:
            lit.uninstrument()
        trainer = {s["span_id"]: s for s in server.spans()}
    otlp = {span.span_id.hex(): span for span in receiver.spans}
    assert len(trainer) == 6 and set(otlp) == set(trainer)  # 2 rollouts x (root, LLM call, reward)
    for span_id, span in otlp.items():
        assert span.name == trainer[span_id]["name"] and span.trace_id.hex() == trainer[span_id]["trace_id"]
        assert span.parent_span_id.hex() == (trainer[span_id]["parent_id"] or "")  # the same tree
        attributes = {a.key for a in span.attributes}
        # token ids go to the trainer only (lit attaches them in bulk, past OpenTelemetry)
        assert (sc.LLM_RESPONSE_TOKEN_IDS in attributes) is False
    assert sorted(s.name for s in otlp.values()) == sorted([sc.LLM_SPAN, sc.REWARD_SPAN, sc.ROLLOUT_SPAN] * 2)


def test_an_otlp_endpoint_that_never_answers_holds_up_neither_the_agent_nor_flush_nor_exit(tmp_path):
    """OpenTelemetry's own force_flush exports on the caller's thread, past its timeout, and its shutdown waits up
    to 30 s: lit's waits stay within their timeouts."""
    with socket.socket() as hanging, FakeLLM() as llm, AckServer() as server:
        hanging.bind(("127.0.0.1", 0))
        hanging.listen()  # connections are taken (the backlog) and never answered
        url = f"http://127.0.0.1:{hanging.getsockname()[1]}/v1/traces"
        lit.instrument(endpoint=server.endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path / "spool",
                       otlp_endpoint=url, flush_timeout_s=1)
        try:
            client = openai.OpenAI(base_url=llm.base_url, api_key="unused")

            @lit.trace
            def solve(question: str) -> float:
                client.chat.completions.create(model="policy", messages=[{"role": "user", "content": question}])
                return 1.0

            started = time.monotonic()
            for _ in range(3):
                assert solve("2+3?") == 1.0
            assert time.monotonic() - started < 3  # each call is a few ms; nothing waits for the endpoint
            started = time.monotonic()
            counts = lit.flush(timeout=1)
            assert time.monotonic() - started < 3
            assert counts is not None and counts.pending == 0 and len(server.spans()) == 6  # the trainer's copy
            solve("4+5?")  # one more for exit to flush
        finally:
            started = time.monotonic()
            lit.uninstrument()
            assert time.monotonic() - started < 3  # flush_timeout_s, not OpenTelemetry's 30 s
        assert len(server.spans()) == 8


def test_a_wrong_otlp_endpoint_or_a_missing_exporter_says_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="must be an OTLP/HTTP URL"):
        lit.instrument(endpoint="tcp://127.0.0.1:1", otlp_endpoint="localhost:4317", spool_dir=tmp_path)
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with pytest.raises(ValueError, match=re.escape(pip_install("otlp"))):
        lit.instrument(endpoint="tcp://127.0.0.1:1", otlp_endpoint="http://127.0.0.1:1/v1/traces", spool_dir=tmp_path)
    assert lit.flush() is None  # nothing was left half on
