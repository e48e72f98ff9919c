"""Load: 64 concurrent rollouts x 1,000 through the whole of lit (dispatcher, two real worker processes, the
agent's three traced openai calls, ZeroMQ, the collector, SQLite) against a fast test LLM server, counted exactly
end to end. bench/rollout_throughput.py runs the same and reports rollouts per second."""

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))
from rollout_throughput import run_load, start_llm_server  # noqa: E402


@pytest.mark.slow
def test_a_thousand_rollouts_64_at_once_are_counted_exactly(tmp_path):
    server, url = start_llm_server()
    try:
        result = run_load(1000, workers=2, concurrency=32, llm_url=url, work_dir=tmp_path)
    finally:
        server.kill()
    assert result.succeeded == 1000
    assert result.spans_declared == 4000  # per rollout: the root and its three LLM calls
    assert result.spans_stored == 4000 and result.incomplete == 0 and result.rejected == 0  # none lost, none twice
    assert result.refused == 0  # with CURVE keys and the collector's admission on, as lit train runs (#27)
    # bounded: no process holds what it ran (growth, since this test's process may hold vLLM from earlier tests)
    assert max(result.rss_growth_mb.values()) < 512, result.rss_growth_mb
