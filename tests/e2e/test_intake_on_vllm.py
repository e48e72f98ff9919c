"""The intake path end to end, with nothing stood in: the real vLLM server on the prepared SmolLM2, an instrumented
openai client inside a @lit.trace rollout, spans over a real ZeroMQ socket to the real collector, a real SQLite
store, and the episode rebuilt from it. The token ids and logprobs that come out must be the engine's own: they
decode to the text the agent saw, and the trainer's model gives the same logprobs for them."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from handed_out import hand_out
from openai import OpenAI

import lit_sdk as lit
from lit_trainer.engine.logprob_check import trainer_logprobs
from lit_trainer.intake.collector import Collector
from lit_trainer.intake.episodes import Episode, build_episode
from lit_trainer.intake.store import SqliteStore

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPT = "Question: what is 2 + 3?\nAnswer:"
SECRET = "9a" * 16
"""Handed out with the rollouts, as the dispatcher hands out each attempt's."""


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

    with SqliteStore(tmp_path / "lit.db") as store, \
            Collector(store, "tcp://127.0.0.1:0", on_root, open_to_local_users=True) as collector:
        lit.instrument(endpoint=collector.endpoint, llm_base_urls=[vllm_server.openai_url], frameworks=[],
                       spool_dir=tmp_path / "spool")
        hand_out(store, "r-vllm", secret=SECRET)  # as the dispatcher does: the collector stores only these
        try:
            with lit.assign_rollout("r-vllm", secret=SECRET):
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


def test_logprobs_at_the_sampling_temperature_match_the_trainers(vllm_server, trainer_model, tmp_path):
    """Defect 1: rollouts sampled at T=0.7 used to carry vLLM's raw (T=1) logprobs, and the trainer computed T=1
    logprobs too: both described a distribution nobody sampled from. Now vLLM returns the tempered distribution's
    logprobs and the trainer divides the logits by each call's recorded temperature: at T=0.7 the two agree as
    closely as at T=1, and both differ from the T=1 values of the same tokens."""
    import torch

    from lit_trainer.learner.batching import BatchingConfig, make_micro_batches
    from lit_trainer.learner.logprobs import plain_token_logprobs

    client = OpenAI(base_url=vllm_server.openai_url, api_key="unused")

    @lit.trace(agent="solver")
    def sample(question: str, temperature: float) -> float:
        for _ in range(3):
            client.chat.completions.create(model=vllm_server.model_name, max_tokens=24, temperature=temperature,
                                           messages=[{"role": "user", "content": question}])
        return 1.0

    roots: list[str] = []
    with SqliteStore(tmp_path / "lit.db") as store, \
            Collector(store, "tcp://127.0.0.1:0", roots.append, open_to_local_users=True) as collector:
        lit.instrument(endpoint=collector.endpoint, llm_base_urls=[vllm_server.openai_url], frameworks=[],
                       spool_dir=tmp_path / "spool")
        hand_out(store, "r-t1.0", "r-t0.7", secret=SECRET)
        try:
            for temperature in (1.0, 0.7):
                with lit.assign_rollout(f"r-t{temperature}", secret=SECRET):
                    sample("Tell me about the sea.", temperature)
            counts = lit.flush(timeout=30)
        finally:
            lit.uninstrument()
        assert counts.pending == 0 and counts.dropped == 0
        deadline = time.monotonic() + 10
        while len(roots) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        episodes = [build_episode(store.spans_of_rollout(r)) for r in roots]

    gaps, untempered = {}, {}
    for episode in episodes:
        transitions = episode.transitions
        (temperature,) = {t.temperature for t in transitions}
        batch = make_micro_batches(transitions, [0.0] * len(transitions), BatchingConfig(), pad_id=0)[0]
        mask = batch.response_mask.bool()
        with torch.no_grad():
            ours = plain_token_logprobs(trainer_model, batch)[0]
            raw = plain_token_logprobs(trainer_model, replace(batch, temperature=torch.ones_like(batch.temperature)))[0]
        gaps[temperature] = (ours - batch.old_logprobs)[mask].abs().mean().item()
        untempered[temperature] = (raw - batch.old_logprobs)[mask].abs().mean().item()
    assert sorted(gaps) == [0.7, 1.0]
    tolerance = max(3 * gaps[1.0], 1e-4)  # the fp32 agreement measured at T=1 in the same run
    assert gaps[0.7] <= tolerance, (gaps, tolerance)
    assert untempered[0.7] > 100 * tolerance, untempered  # T=1 logprobs of T=0.7 samples are far off
