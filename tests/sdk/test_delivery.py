"""Nothing is lost between an instrumented agent and the trainer: a trainer that is down while rollouts run
gets every span once it comes up, even when the agent process exited in between."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from ack_server import AckServer
from fake_llm import FakeLLM
from openai import OpenAI

import lit_sdk as lit
from lit_sdk import semconv as sc

SDK_TESTS = Path(__file__).resolve().parent


SPANS_PER_ROLLOUT = 3  # lit.rollout, lit.llm, lit.reward


def rollouts(llm: FakeLLM, n: int) -> None:
    client = OpenAI(base_url=llm.base_url, api_key="x")

    @lit.trace
    def agent(i: int) -> float:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": str(i)}])
        lit.reward(0.5, name="half")
        return 1.0

    for i in range(n):
        agent(i)


def test_trainer_down_then_up_gets_every_span_once(tmp_path):
    server = AckServer()
    server.start()
    endpoint = server.endpoint
    server.stop()  # the trainer is away while the agent runs
    with FakeLLM() as llm:
        lit.instrument(endpoint=endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path)
        try:
            rollouts(llm, 20)
            waiting = lit.flush(timeout=0.5)
            assert waiting.acknowledged == 0 and waiting.pending == waiting.submitted == 20 * SPANS_PER_ROLLOUT
            server.start()  # same port
            counts = lit.flush(timeout=15)
        finally:
            lit.uninstrument()
            server.stop()
    assert counts.acknowledged == 20 * SPANS_PER_ROLLOUT
    assert counts.pending == counts.dropped == counts.rejected == 0
    spans = server.spans()
    assert len(spans) == 20 * SPANS_PER_ROLLOUT and server.duplicates == counts.duplicates
    assert sorted(s["name"] for s in spans).count(sc.LLM_SPAN) == 20
    assert len({s["rollout_id"] for s in spans}) == 20


def test_flush_reports_counts(tracing):
    rollouts(tracing.llm, 3)
    counts = lit.flush(timeout=10)
    assert (counts.submitted, counts.sent, counts.acknowledged, counts.pending) == (9, 9, 9, 0)
    assert (counts.spooled, counts.rejected, counts.dropped) == (0, 0, 0)
    assert lit.uninstrument() == counts  # nothing more to deliver at the end


AGENT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import lit_sdk as lit
    from fake_llm import FakeLLM
    from test_delivery import rollouts

    with FakeLLM() as llm:
        lit.instrument(endpoint={endpoint!r}, llm_base_urls=[llm.base_url], spool_dir={spool!r},
                       flush_timeout_s=0.5)
        rollouts(llm, 5)
    # exits here, trainer still down: atexit keeps the 15 spans in the spool
    """
)


def test_spans_of_an_exited_process_are_delivered_by_the_next_one(tmp_path):
    server = AckServer()
    server.start()
    endpoint = server.endpoint
    server.stop()
    spool = tmp_path / "spool"
    code = AGENT.format(tests=str(SDK_TESTS), endpoint=endpoint, spool=str(spool))
    env = {**os.environ, "PYTHONPATH": str(SDK_TESTS.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "15 spans kept in the spool" in out.stderr
    assert any(spool.iterdir())
    server.start()
    try:
        lit.instrument(endpoint=endpoint, spool_dir=spool)  # a later process of the same agent
        counts = lit.flush(timeout=15)
        lit.uninstrument()
    finally:
        server.stop()
    assert len(server.spans()) == 15 and counts.pending == 0 and counts.acknowledged == 15
    names = sorted(s["name"] for s in server.spans())
    assert names.count(sc.ROLLOUT_SPAN) == names.count(sc.LLM_SPAN) == names.count(sc.REWARD_SPAN) == 5
    assert list(spool.iterdir()) == [], "delivered segments are removed from the spool"
