"""Run an example agent once, traced by lit, against tests/fake_llm.py, with the trainer's real collector, store
and episode builder behind it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from fake_llm import FakeLLM
from handed_out import hand_out

import lit_sdk as lit
from lit_sdk import _context
from lit_sdk.protocol import SpanRecord
from lit_trainer.intake.collector import Collector
from lit_trainer.intake.store import SqliteStore

ROLLOUT_ID = "example-rollout-1"
SECRET = "ex" * 16


@pytest.fixture(autouse=True)
def _examples_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIT_EXAMPLES_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def traced_rollout(tmp_path) -> Callable[..., tuple[float, list[SpanRecord], FakeLLM]]:
    """``traced_rollout(agent_fn, task, script)``: the reward, the rollout's stored spans and the scripted engine."""

    def run(agent_fn, task: dict, script: list) -> tuple[float, list[SpanRecord], FakeLLM]:
        with FakeLLM(script=script) as llm, SqliteStore(tmp_path / "store.sqlite") as store, \
                Collector(store, "tcp://127.0.0.1:0", open_to_local_users=True) as collector:
            hand_out(store, ROLLOUT_ID, secret=SECRET)  # as the dispatcher does: the collector stores only these
            lit.instrument(endpoint=collector.endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path / "spool")
            try:
                with _context.assign(ROLLOUT_ID, task["id"], secret=SECRET):
                    llm_config = lit.LLM(llm.base_url, "policy", temperature=0.0, max_tokens=48)
                    reward = asyncio.run(agent_fn(task, llm_config))
                counts = lit.flush(timeout=10)
                assert counts is not None and counts.pending == 0 and counts.dropped == 0, counts
            finally:
                lit.uninstrument()
            deadline = time.monotonic() + 5  # acknowledged spans are stored; wait until the root is readable
            spans = store.spans_of_rollout(ROLLOUT_ID)
            while not any(s.parent_id is None for s in spans):
                assert time.monotonic() < deadline, "the rollout's root span never reached the store"
                time.sleep(0.05)
                spans = store.spans_of_rollout(ROLLOUT_ID)
            return reward, spans, llm

    return run
