"""Calls recorded at the engine by lit's gateway (``lit.engine.call``) in episodes: one call seen by the agent's SDK
and by the gateway is one transition (the engine's ids, the SDK's place, agent and timing); a call only the gateway
saw is a call of its own under the root; a cut call is never trained; a peer cannot send one."""

from __future__ import annotations

from test_episodes import RID, Tree

from lit_sdk import semconv as sc
from lit_sdk.protocol import STATUS_ERROR, STATUS_OK, SpanRecord, codec, pack_span
from lit_trainer.intake.admission import Admission
from lit_trainer.intake.episodes import Episode, Unusable, build_episode


def engine_call(start: int, ids=(7, 8, 9), call_id: str | None = None, agent: str | None = None,
                status: int = STATUS_OK) -> SpanRecord:
    attrs = {sc.LLM_API: "chat", sc.LLM_PROMPT_TOKEN_IDS: [100 + start, 101 + start],
             sc.LLM_RESPONSE_TOKEN_IDS: list(ids), sc.LLM_RESPONSE_LOGPROBS: [-0.25] * len(ids),
             sc.LLM_WEIGHT_VERSION: "3", sc.LLM_FINISH_REASON: "stop"}
    if call_id:
        attrs[sc.LLM_CALL_ID] = call_id
    if agent:
        attrs[sc.AGENT_NAME] = agent
    return SpanRecord("cd" * 16, format(0xE000 + start, "016x"), None, sc.ENGINE_CALL_SPAN, start, start + 3, status,
                      "cut" if status == STATUS_ERROR else "", RID, attrs)


def test_a_call_seen_by_the_sdk_and_the_engine_is_one_transition_with_the_engines_ids():
    t = Tree()
    root = t.root()
    streamed = t.llm(root, 10, agent="writer", token_ids=False)  # a streamed call: the SDK has no ids
    with_ids = t.llm(root, 50, agent="writer", ids=(1, 2))  # non-streamed: the SDK's ids, the engine's win
    spans = [*t.spans, engine_call(12, call_id=streamed), engine_call(52, ids=(5, 6), call_id=with_ids)]
    episode = build_episode(spans)
    assert isinstance(episode, Episode)
    assert [tr.response_ids for tr in episode.transitions] == [[7, 8, 9], [5, 6]]
    assert [tr.prompt_ids for tr in episode.transitions] == [[112, 113], [152, 153]]
    assert [tr.span_id for tr in episode.transitions] == [streamed, with_ids]  # the SDK's place in the tree
    assert [tr.agent for tr in episode.transitions] == ["writer", "writer"]
    assert [tr.logprobs for tr in episode.transitions] == [[-0.25] * 3, [-0.25] * 2]
    assert [tr.weight_version for tr in episode.transitions] == [3, 3]
    assert episode.skipped_calls == 0


def test_a_call_only_the_engine_saw_is_a_call_of_the_rollout_named_by_its_header():
    t = Tree()
    root = t.root(reward=None)
    t.reward(root, 30, 0.5, "checked")
    t.reward(root, 80, 1.0, "correct")
    spans = [*t.spans, engine_call(10, agent="writer"), engine_call(60, agent="rewriter"), engine_call(70)]
    episode = build_episode(spans)
    assert [tr.agent for tr in episode.transitions] == ["writer", "rewriter", ""]
    assert [tr.reward for tr in episode.transitions] == [0.5, None, 1.0]  # rewards follow the calls in time
    assert episode.episode_return == 1.5
    assert [tr.agent for tr in build_episode(spans, agents={"rewriter"}).transitions] == ["rewriter"]


def test_a_reward_posted_to_the_gateway_is_the_rollouts_where_it_arrived():
    t = Tree()
    t.root(reward=None)
    posted = SpanRecord("cd" * 16, format(0xF000, "016x"), None, sc.ENGINE_REWARD_SPAN, 20, 20, STATUS_OK, "", RID,
                        {sc.REWARD_VALUE: 0.25, sc.REWARD_NAME: "tests"})
    episode = build_episode([*t.spans, engine_call(10, agent="writer"), posted, engine_call(30, agent="writer")])
    assert [tr.reward for tr in episode.transitions] == [0.25, None]
    assert episode.rewards == [("tests", 0.25, 0)] and episode.episode_return == 0.25


def test_a_cut_call_is_skipped_and_counted_never_trained():
    t = Tree()
    root = t.root()
    sdk = t.llm(root, 10, token_ids=False)
    spans = [*t.spans, engine_call(12, call_id=sdk, status=STATUS_ERROR), engine_call(40, status=STATUS_ERROR),
             engine_call(60)]
    episode = build_episode(spans)
    assert [tr.prompt_ids[0] for tr in episode.transitions] == [160]
    assert episode.skipped_calls == 2
    only_cut = build_episode([*t.spans, engine_call(12, call_id=sdk, status=STATUS_ERROR)])
    assert only_cut.reason is Unusable.NO_LLM_CALLS


def test_a_peer_cannot_send_an_engine_call():
    pack = codec.packer()
    t = Tree()
    t.root()
    spans = [pack_span(s, pack) for s in [*t.spans, engine_call(10)]]
    admission = Admission(lambda ids: {RID: (None, None)})
    admitted, refused, _ = admission.admit(spans[1:])
    assert admitted == [] and refused == {"engine_span": 1}
    reward = SpanRecord("cd" * 16, "f" * 16, None, sc.ENGINE_REWARD_SPAN, 1, 1, STATUS_OK, "", RID,
                        {sc.REWARD_VALUE: 1.0, sc.REWARD_NAME: ""})
    assert admission.admit([pack_span(reward, pack)])[1] == {"engine_span": 1}
