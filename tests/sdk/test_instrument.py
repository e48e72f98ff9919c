"""instrument()/uninstrument(): one patch however often it is called, and every original function back after;
lit's openai patch is an OpenTelemetry BaseInstrumentor."""

from __future__ import annotations

import importlib
import inspect

import openai
import pytest
from ack_server import AckServer
from fake_llm import FakeLLM
from openai import OpenAI
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from packaging.requirements import Requirement

import lit_sdk as lit
from lit_sdk import _context, _state
from lit_sdk import semconv as sc
from lit_sdk.openai_instrumentor import _TARGETS, LitOpenAIInstrumentor

PATCHED = [(getattr(importlib.import_module(m), c), "create") for m, c, _ in _TARGETS]
FRAMEWORK_FUNCTIONS = [
    ("autogen_agentchat.agents", "AssistantAgent", "on_messages_stream"),
    ("autogen_agentchat.teams", "BaseGroupChat", "run_stream"),
    ("openai", "OpenAI", "request"),
]


def key(cls: type, name: str) -> str:
    return f"{cls.__module__}.{cls.__qualname__}.{name}"


def originals() -> dict[str, object]:
    """What each patch target resolves to now (inherited ones included), without binding it."""
    found = {key(cls, name): inspect.getattr_static(cls, name) for cls, name in PATCHED}
    for module, cls_name, name in FRAMEWORK_FUNCTIONS:
        cls = getattr(importlib.import_module(module), cls_name)
        found[f"{cls_name}.{name}"] = inspect.getattr_static(cls, name)
    return found


@pytest.fixture
def clean():
    assert _state.active() is None, "an earlier test left lit instrumented"
    assert not LitOpenAIInstrumentor().is_instrumented_by_opentelemetry
    yield
    lit.uninstrument()
    assert not LitOpenAIInstrumentor().is_instrumented_by_opentelemetry


def test_twice_leaves_one_patch_and_uninstrument_restores_identity(clean, tmp_path):
    before = originals()
    every = ["langchain", "autogen", "openai_agents", "openai"]
    first = lit.instrument(endpoint="tcp://127.0.0.1:9", frameworks=every, llm_base_urls="*", spool_dir=tmp_path)
    patched = originals()
    assert all(patched[k] is not before[k] for k in before), "every target is patched"
    second = lit.instrument(endpoint="tcp://127.0.0.1:9", frameworks=every, llm_base_urls="*", spool_dir=tmp_path)
    assert second is first
    again = originals()
    assert all(again[k] is patched[k] for k in before), "a second call adds no second patch"
    for cls, name in PATCHED:
        assert cls.__dict__[name].__wrapped__ is before[key(cls, name)]
    lit.uninstrument()
    after = originals()
    assert all(after[k] is before[k] for k in before), "uninstrument restores every original"
    assert _state.active() is None
    assert lit.uninstrument() is None  # a second uninstrument is harmless


def test_other_settings_reconfigure_instead_of_stacking(clean, tmp_path):
    before = originals()
    lit.instrument(endpoint="tcp://127.0.0.1:9", spool_dir=tmp_path)
    second = lit.instrument(endpoint="tcp://127.0.0.1:10", spool_dir=tmp_path)
    assert second.settings.endpoint == "tcp://127.0.0.1:10"
    for cls, name in PATCHED:
        assert cls.__dict__[name].__wrapped__ is before[key(cls, name)]
    lit.uninstrument()
    assert originals() == before


def test_frameworks_can_be_chosen(clean, tmp_path):
    before = originals()
    lit.instrument(endpoint="tcp://127.0.0.1:9", frameworks=["autogen"], spool_dir=tmp_path)
    now = originals()
    assert now["AssistantAgent.on_messages_stream"] is not before["AssistantAgent.on_messages_stream"]
    assert now["BaseGroupChat.run_stream"] is not before["BaseGroupChat.run_stream"]
    assert now["OpenAI.request"] is before["OpenAI.request"]  # openinference's openai instrumentor stays off
    assert settings_default_frameworks() == ("langchain", "autogen", "openai_agents")


def settings_default_frameworks() -> tuple[str, ...]:
    from lit_sdk import config

    return config.resolve().frameworks


def test_bad_settings_are_clear_errors(clean, monkeypatch):
    with pytest.raises(ValueError, match="ZeroMQ address"):
        lit.instrument(endpoint="127.0.0.1:7373")
    with pytest.raises(ValueError, match="unknown frameworks"):
        lit.instrument(frameworks=["crewai"])
    monkeypatch.setenv("LIT_FLUSH_TIMEOUT", "-1")
    with pytest.raises(ValueError, match="flush_timeout_s"):
        lit.instrument()
    assert _state.active() is None


def test_environment_fallbacks(clean, monkeypatch, tmp_path):
    monkeypatch.setenv("LIT_ENDPOINT", "tcp://127.0.0.1:11")
    monkeypatch.setenv("LIT_FRAMEWORKS", "langchain,openai")
    monkeypatch.setenv("LIT_LLM_BASE_URLS", "http://a/v1, http://b/v1/")
    monkeypatch.setenv("LIT_SPOOL_DIR", str(tmp_path))
    monkeypatch.setenv("LIT_SERVICE_NAME", "calc-worker")
    settings = lit.instrument().settings
    assert settings.endpoint == "tcp://127.0.0.1:11"
    assert settings.frameworks == ("langchain", "openai")
    assert settings.llm_base_urls == ("http://a/v1", "http://b/v1/")
    assert settings.spool_dir == tmp_path and settings.service_name == "calc-worker"


def test_the_openai_patch_is_an_opentelemetry_instrumentor_of_openai():
    instrumentor = LitOpenAIInstrumentor()
    assert isinstance(instrumentor, BaseInstrumentor)
    assert instrumentor is LitOpenAIInstrumentor()  # one per process, like every BaseInstrumentor
    (dependency,) = (Requirement(d) for d in instrumentor.instrumentation_dependencies())
    assert dependency.name == "openai" and "1.60" in dependency.specifier


def test_the_instrumentor_alone_round_trips_to_the_original_functions(clean):
    before = {cls: cls.__dict__[name] for cls, name in PATCHED}
    instrumentor = LitOpenAIInstrumentor()
    instrumentor.instrument()  # no managed engine: every call passes through
    try:
        assert instrumentor.is_instrumented_by_opentelemetry
        assert all(cls.__dict__[name].__wrapped__ is before[cls] for cls, name in PATCHED)
        instrumentor.instrument()  # already on: a no-op, not a second layer
        assert all(cls.__dict__[name].__wrapped__ is before[cls] for cls, name in PATCHED)
    finally:
        instrumentor.uninstrument()
    assert all(cls.__dict__[name] is before[cls] for cls, name in PATCHED)
    with pytest.raises(TypeError, match="processor= and tracer="):
        instrumentor.instrument(llm_base_urls=["http://127.0.0.1:1/v1"])
    assert not instrumentor.is_instrumented_by_opentelemetry
    assert all(cls.__dict__[name] is before[cls] for cls, name in PATCHED)


def _ask(base_url: str) -> None:
    OpenAI(base_url=base_url, api_key="x").chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}]
    )


def _llm_spans(server: AckServer) -> list[dict]:
    counts = lit.flush(timeout=10)
    assert counts is not None and counts.pending == 0 and counts.dropped == 0, counts
    return [s for s in server.spans() if s["name"] == sc.LLM_SPAN]


def test_instrument_twice_records_each_call_once(clean, tmp_path):
    with FakeLLM() as llm, AckServer() as server:
        for _ in range(2):
            lit.instrument(endpoint=server.endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path)

        @lit.trace
        def agent() -> None:
            _ask(llm.base_url)

        agent()
        (span,) = _llm_spans(server)
        assert len(llm.requests) == 1 and llm.requests[0]["return_token_ids"] is True
        assert span["attributes"][sc.LLM_PROMPT_TOKEN_IDS] == llm.responses[0]["prompt_token_ids"]


def test_a_raw_response_call_is_recorded_with_its_token_ids(clean, tmp_path):
    """``with_raw_response.create`` (what LangChain's ChatOpenAI calls) returns a wrapper: lit reads the parsed
    response through it, and the caller still gets the wrapper."""
    with FakeLLM() as llm, AckServer() as server:
        lit.instrument(endpoint=server.endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path)

        @lit.trace
        def agent() -> object:
            client = OpenAI(base_url=llm.base_url, api_key="x")
            return client.chat.completions.with_raw_response.create(
                model="m", messages=[{"role": "user", "content": "hi"}])

        raw = agent()
        assert raw.http_response.status_code == 200 and raw.parse().choices
        (span,) = _llm_spans(server)
        assert span["attributes"][sc.LLM_PROMPT_TOKEN_IDS] == llm.responses[0]["prompt_token_ids"]
        assert sc.LLM_TOKEN_IDS_MISSING not in span["attributes"]


def test_reinstrument_with_other_base_urls_takes_effect(clean, tmp_path):
    with FakeLLM() as first, FakeLLM() as second, AckServer() as server:
        lit.instrument(endpoint=server.endpoint, llm_base_urls=[first.base_url], spool_dir=tmp_path)
        lit.instrument(endpoint=server.endpoint, llm_base_urls=[second.base_url], spool_dir=tmp_path)
        assert LitOpenAIInstrumentor().is_instrumented_by_opentelemetry

        @lit.trace
        def agent() -> None:
            _ask(first.base_url)
            _ask(second.base_url)

        agent()
        (span,) = _llm_spans(server)
        assert "return_token_ids" not in first.requests[0], "the first engine is no longer managed"
        assert second.requests[0]["return_token_ids"] is True
        assert span["attributes"][sc.LLM_RESPONSE_TOKEN_IDS] == second.responses[0]["choices"][0]["token_ids"]


def test_the_sampling_temperature_and_unsupported_settings_are_recorded(clean, tmp_path):
    with FakeLLM() as llm, AckServer() as server:
        lit.instrument(endpoint=server.endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path)
        client = OpenAI(base_url=llm.base_url, api_key="x")
        messages = [{"role": "user", "content": "hi"}]

        @lit.trace
        def agent() -> None:
            client.chat.completions.create(model="m", messages=messages)
            client.chat.completions.create(model="m", messages=messages, temperature=0.7, top_p=1.0,
                                           presence_penalty=openai.NOT_GIVEN, frequency_penalty=openai.omit)
            client.chat.completions.create(model="m", messages=messages, temperature=0.5, top_p=0.9,
                                           extra_body={"top_k": 20, "repetition_penalty": 1.0})

        agent()
        default, tempered, nucleus = (s["attributes"] for s in _llm_spans(server))
    assert sc.LLM_TEMPERATURE not in default and sc.LLM_SAMPLING_UNSUPPORTED not in default
    assert tempered[sc.LLM_TEMPERATURE] == 0.7 and sc.LLM_SAMPLING_UNSUPPORTED not in tempered  # top_p=1 is neutral
    assert nucleus[sc.LLM_TEMPERATURE] == 0.5 and nucleus[sc.LLM_SAMPLING_UNSUPPORTED] == "top_p=0.9,top_k=20"


def test_the_users_opentelemetry_settings_do_not_switch_lit_off(clean, tmp_path, monkeypatch):
    """OTEL_SDK_DISABLED, a sampler that drops everything and tight span limits are the user's settings for their
    own telemetry; lit's provider is its own, and before it inherited them: no span, or token ids dropped."""
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "2")
    with FakeLLM() as llm, AckServer() as server:
        lit.instrument(endpoint=server.endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path)

        @lit.trace
        def agent() -> float:
            _ask(llm.base_url)
            return 1.0

        assert agent() == 1.0
        (span,) = _llm_spans(server)
        assert span["attributes"][sc.LLM_RESPONSE_TOKEN_IDS] == llm.responses[0]["choices"][0]["token_ids"]
        assert span["attributes"][sc.LLM_PROMPT_TOKEN_IDS] == llm.responses[0]["prompt_token_ids"]


def test_the_engines_weight_version_is_recorded_when_its_answer_carries_one(clean, tmp_path):
    """lit's vLLM adds ``lit_weight_version`` to its answers: it becomes the span's weight version, in place of
    the one the trainer gave the rollout; an answer without it leaves the span with the rollout's, or none."""
    with FakeLLM(weight_version="12") as llm, AckServer() as server:
        lit.instrument(endpoint=server.endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path)
        client = OpenAI(base_url=llm.base_url, api_key="x")

        @lit.trace
        def agent(version: str) -> None:
            llm.weight_version = version
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            client.completions.create(model="m", prompt="hi")
            llm.weight_version = None
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])

        agent("12")
        with _context.assign("r-1", weight_version="11"):
            agent("13")
        spans = sorted(_llm_spans(server), key=lambda s: s["start_ns"])
    versions = [s["attributes"].get(sc.LLM_WEIGHT_VERSION) for s in spans]
    assert versions == ["12", "12", None, "13", "13", "11"]
