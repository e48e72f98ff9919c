"""The intake path end to end, with nothing stood in: the real vLLM server on the prepared SmolLM2, an instrumented
openai client inside a @lit.trace rollout, spans over a real ZeroMQ socket to the real collector, a real SQLite
store, and the episode rebuilt from it. The token ids and logprobs that come out must be the engine's own: they
decode to the text the agent saw, and the trainer's model gives the same logprobs for them."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from openai import OpenAI

import lit_sdk as lit
from lit_trainer.engine.logprob_check import trainer_logprobs
from lit_trainer.intake.collector import Collector
from lit_trainer.intake.episodes import Episode, build_episode
from lit_trainer.intake.store import SqliteStore

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPT = "Question: what is 2 + 3?\nAnswer:"


def test_rollout_on_vllm_becomes_an_episode_with_the_engines_ids(vllm_server, prepared_model: Path, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    roots: list[str] = []
    arrived = threading.Event()

    def on_root(rollout_id: str) -> None:
        roots.append(rollout_id)
        arrived.set()

    client = OpenAI(base_url=vllm_server.openai_url, api_key="unused")
    replies: dict[str, str] = {}

    @lit.trace(agent="solver")
    def solve(question: str) -> float:
        chat = client.chat.completions.create(
            model=vllm_server.model_name, messages=[{"role": "user", "content": question}],
            max_tokens=12, temperature=0,
        )
        replies["chat"] = chat.choices[0].message.content
        lit.reward(0.5, name="answered")
        text = client.completions.create(model=vllm_server.model_name, prompt=PROMPT, max_tokens=6, temperature=0)
        replies["text"] = text.choices[0].text
        return 1.0

    with SqliteStore(tmp_path / "lit.db") as store, Collector(store, "tcp://127.0.0.1:0", on_root) as collector:
        lit.instrument(endpoint=collector.endpoint, llm_base_urls=[vllm_server.openai_url], frameworks=[],
                       spool_dir=tmp_path / "spool")
        try:
            assert solve("What is 2 + 3?") == 1.0
            counts = lit.flush(timeout=30)
        finally:
            lit.uninstrument()
        assert counts.pending == 0 and counts.dropped == 0
        assert arrived.wait(10), "the rollout's root span did not reach the collector"
        episode = build_episode(store.spans_of_rollout(roots[0]))

    assert isinstance(episode, Episode)
    assert episode.episode_return == 1.0 and episode.rewards == [("answered", 0.5, 0)]
    chat, text = episode.transitions
    assert (chat.reward, text.reward) == (0.5, None)
    assert chat.agent == text.agent == "solver"

    tokenizer = AutoTokenizer.from_pretrained(prepared_model)
    assert tokenizer.decode(chat.response_ids, skip_special_tokens=True).strip() == replies["chat"].strip()
    assert tokenizer.decode(text.response_ids) == replies["text"]
    assert text.prompt_ids == tokenizer(PROMPT)["input_ids"]
    assert "What is 2 + 3?" in tokenizer.decode(chat.prompt_ids)

    model = AutoModelForCausalLM.from_pretrained(prepared_model, dtype=torch.float32).eval()
    with torch.no_grad():
        for transition in (chat, text):
            assert transition.logprobs is not None and len(transition.logprobs) == len(transition.response_ids)
            ours = trainer_logprobs(model, transition.prompt_ids, transition.response_ids)
            gap = (ours - torch.tensor(transition.logprobs)).abs().max().item()
            assert gap < 0.02, f"vLLM's recorded logprobs differ from the trainer's by {gap:.4f} nats"
