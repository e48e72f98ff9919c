"""#27: a peer that learned a rollout id cannot change that rollout's episode (intake/admission.py). A real agent
instrumented by lit sends its spans through a real collector into a real store; a forger on its own ZeroMQ socket
sends roots and calls for the same rollout."""

from __future__ import annotations

import dataclasses

import pytest
from fake_llm import FakeLLM
from handed_out import hand_out
from openai import OpenAI
from test_collector import WAIT_S, Client, span, spans_frame

import lit_sdk as lit
from lit_sdk import semconv as sc
from lit_trainer.intake import admission
from lit_trainer.intake.collector import Collector
from lit_trainer.intake.episodes import Episode, build_episode
from lit_trainer.intake.store import SqliteStore

SECRET = "5e" * 16


def forged_root(n: int, rollout: str, reward: float, **attrs) -> object:
    """A root span as a forger writes it: an earlier start than the agent's, and the reward it wants."""
    return dataclasses.replace(span(n, rollout=rollout, parent=None, name=sc.ROLLOUT_SPAN), start_ns=0, attributes={
        sc.ROLLOUT_ID: rollout, sc.ATTEMPT: 1, sc.ROLLOUT_RETURN_REWARD: reward, **attrs})


def honest_rollout(collector: Collector, llm: FakeLLM, tmp_path, rollout: str, secret: str) -> None:
    """One rollout of a real instrumented agent (one LLM call, return 0.0), as a lit worker runs it."""
    lit.instrument(endpoint=collector.endpoint, llm_base_urls=[llm.base_url], spool_dir=tmp_path / "spool",
                   frameworks=[])
    try:
        client = OpenAI(base_url=llm.base_url, api_key="x")

        @lit.trace(agent="solver")
        def solve(task: str) -> float:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": task}])
            return 0.0

        with lit.assign_rollout(rollout, secret=secret):
            solve("2+3?")
        assert lit.flush(timeout=WAIT_S).pending == 0
    finally:
        lit.uninstrument()


def send_and_wait(client: Client, batch: str, spans: list) -> None:
    client.send(spans_frame(batch, spans))
    (ack,) = client.replies(1)  # acknowledged: an honest resender would stop here
    assert ack.batch == batch


@pytest.mark.parametrize("forger_first", [True, False], ids=["forger_first", "agent_first"])
def test_a_forged_root_cannot_change_the_reward(tmp_path, forger_first):
    """#27's hole: one extra root for the same rollout id, with an earlier start and return_reward 1.0, turned the
    episode's return from 0.0 to 1.0; the earliest root won."""
    with SqliteStore(tmp_path / "lit.db") as store, FakeLLM() as llm, \
            Collector(store, "tcp://127.0.0.1:0", open_to_local_users=True) as collector:
        hand_out(store, "r-target", secret=SECRET)
        forger = Client(collector.endpoint)
        try:
            forgeries = [forged_root(901, "r-target", 1.0),  # no secret
                         forged_root(902, "r-target", 1.0, **{sc.ROLLOUT_SECRET: "00" * 16})]  # a guessed one
            if forger_first:
                send_and_wait(forger, "f1", forgeries)
            honest_rollout(collector, llm, tmp_path, "r-target", SECRET)
            if not forger_first:
                send_and_wait(forger, "f1", forgeries)
            # a key holder that has the secret too (a buggy agent sending its root twice) adds no second root
            send_and_wait(forger, "f2", [forged_root(903, "r-target", 1.0, **{sc.ROLLOUT_SECRET: SECRET})])
            # a rollout nobody handed out is refused whole
            send_and_wait(forger, "f3", [forged_root(904, "r-nobody", 1.0), span(905, rollout="r-nobody")])
        finally:
            forger.close()
        counts = collector.counts
        spans = store.spans_of_rollout("r-target")
        assert store.get_rollout("r-nobody") is None and store.spans_of_rollout("r-nobody") == []
    assert counts.refused_spans == {"wrong_secret": 2, "second_root": 1, "unknown_rollout": 2}
    roots = [s for s in spans if s.parent_id is None]
    assert len(roots) == 1 and roots[0].attributes[sc.ROLLOUT_SECRET] == SECRET
    episode = build_episode(spans)
    assert isinstance(episode, Episode) and episode.episode_return == 0.0 and len(episode.transitions) == 1


def test_a_forged_call_under_a_made_up_parent_is_stored_but_never_trained_on(tmp_path):
    """#27's hole: an orphan lit.llm span with a made-up parent became a trained transition of another rollout."""
    with SqliteStore(tmp_path / "lit.db") as store, FakeLLM() as llm, \
            Collector(store, "tcp://127.0.0.1:0", open_to_local_users=True) as collector:
        hand_out(store, "r-target", secret=SECRET)
        honest_rollout(collector, llm, tmp_path, "r-target", SECRET)
        forger = Client(collector.endpoint)
        try:
            call = dataclasses.replace(span(906, rollout="r-target", parent="ab" * 8, name=sc.LLM_SPAN), attributes={
                sc.ROLLOUT_ID: "r-target", sc.AGENT_NAME: "solver", sc.LLM_PROMPT_TOKEN_IDS: [1, 2],
                sc.LLM_RESPONSE_TOKEN_IDS: [3], sc.LLM_RESPONSE_LOGPROBS: [-0.1]})
            send_and_wait(forger, "f1", [call])
        finally:
            forger.close()
        spans = store.spans_of_rollout("r-target")
    assert any(s.span_id == f"{906:016x}" for s in spans)  # it arrived...
    episode = build_episode(spans)
    assert [t.span_id for t in episode.transitions] != [] and all(t.span_id != f"{906:016x}"
                                                                 for t in episode.transitions)  # ...and is no call


def test_a_flood_of_spans_under_a_rollout_id_is_capped_and_its_root_still_lands(tmp_path, monkeypatch):
    """A key holder that learned a rollout id could store any number of orphan spans under it (each read into the
    trainer's memory to build the episode), and any number outside rollouts (which no episode uses): the disk or
    the memory filled. The store takes a share of each (4 spans here, 50,000 by default); the root, guarded by its
    secret, lands even then."""
    monkeypatch.setattr(admission, "MAX_ROLLOUT_SPANS", 4)
    with SqliteStore(tmp_path / "lit.db") as store, FakeLLM() as llm, \
            Collector(store, "tcp://127.0.0.1:0", open_to_local_users=True) as collector:
        hand_out(store, "r-target", secret=SECRET)
        forger = Client(collector.endpoint)
        try:
            send_and_wait(forger, "f1", [span(900 + i, rollout="r-target", parent="ab" * 8) for i in range(6)])
            send_and_wait(forger, "f2", [span(950 + i, rollout=None) for i in range(3)])
            send_and_wait(forger, "f3", [span(960 + i, rollout=None) for i in range(3)])  # another transaction
        finally:
            forger.close()
        honest_rollout(collector, llm, tmp_path, "r-target", SECRET)
        counts = collector.counts
        spans = store.spans_of_rollout("r-target")
        outside = store._conn().execute("SELECT count(*) FROM spans WHERE rollout_id = x''").fetchone()[0]
    roots = [s for s in spans if s.parent_id is None]
    assert len(roots) == 1 and roots[0].attributes[sc.ROLLOUT_SECRET] == SECRET
    assert len(spans) == 5 and outside == 4  # the share, and the root
    honest = roots[0].attributes[sc.ROLLOUT_SPANS]  # the spans the agent sent, its root among them
    assert counts.refused_spans == {"too_many_spans": 2 + 2 + honest - 1}
    assert counts.spans_stored == 4 + 4 + 1


def test_the_share_of_a_rollout_counts_bytes_and_what_the_store_holds_already(monkeypatch):
    from lit_sdk.protocol import pack_span
    from lit_trainer.intake.admission import Admission

    monkeypatch.setattr(admission, "MAX_ROLLOUT_SPANS", 4)
    small, big = pack_span(span(1, rollout="r1")), pack_span(span(2, rollout="r1"))
    big = big._replace(attributes=big.attributes + b"\x00" * 100)  # only its length matters here
    size = len(small.attributes + small.events)
    assert len(big.attributes + big.events) > size + 50
    monkeypatch.setattr(admission, "MAX_ROLLOUT_BYTES", 4 * size + 50)
    asked: list[list] = []

    def usage(ids: list) -> dict:
        asked.append(ids)
        return {"r1": (2, 2 * size)}  # two small spans stored before

    gate = Admission(lambda ids: {"r1": (SECRET, "9" * 16)}, usage)
    admitted, refused, _ = gate.admit([big, small, small, small])
    assert admitted == [small, small] and refused == {"too_many_spans": 2}  # big: over the bytes; the last: 5 spans
    assert asked == [["r1"]]


def test_the_secret_round_trips(tmp_path):
    with SqliteStore(tmp_path / "lit.db") as store:
        hand_out(store, "r1", secret=SECRET)
        hand_out(store, "r2")
        assert store.get_rollout("r1").secret == SECRET and store.get_rollout("r2").secret is None
    with SqliteStore(tmp_path / "lit.db") as store:  # and after the store is opened again
        assert store.get_rollout("r1").secret == SECRET


def test_a_batch_asks_the_store_once_for_all_its_new_rollouts():
    from lit_sdk.protocol import pack_span
    from lit_trainer.intake.admission import Admission

    asked: list[list[str]] = []

    def lookup(ids: list[str]) -> dict:
        asked.append(sorted(ids))
        return {"r1": (SECRET, None), "r2": (None, f"{99:016x}")}  # r2 has its root already; r3 is unknown

    admission = Admission(lookup)
    batch = [pack_span(s) for s in (span(1, rollout="r1"), forged_root(2, "r1", 0.0, **{sc.ROLLOUT_SECRET: SECRET}),
                                    span(3, rollout="r2"), forged_root(4, "r2", 1.0), span(5, rollout="r3"),
                                    forged_root(6, "r1", 1.0, **{sc.ROLLOUT_SECRET: SECRET}))]
    admitted, refused, new_roots = admission.admit(batch)
    assert asked == [["r1", "r2", "r3"]] and new_roots == ["r1"]
    assert [int(s.span_id, 16) for s in admitted] == [1, 2, 3]
    assert refused == {"second_root": 2, "unknown_rollout": 1}  # r2's root arrived before; r1's second root
    assert admission.admit([pack_span(span(7, rollout="r1"))]) == ([pack_span(span(7, rollout="r1"))], {}, [])
    assert asked == [["r1", "r2", "r3"]]  # known since: not asked again
