"""Span trees → episodes: golden trees recorded from the real frameworks, and hand-built trees for the hard cases.

The golden files in tests/trainer/intake/golden/ come from tests/sdk/test_frameworks.py; regenerate them with
``LIT_RECORD_GOLDEN=tests/trainer/intake/golden python -m pytest tests/sdk/test_frameworks.py``.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from lit_sdk import semconv as sc
from lit_sdk.protocol import STATUS_ERROR, STATUS_OK, SpanRecord
from lit_trainer.intake.episodes import Episode, Unusable, UnusableRollout, build_episode, unsupported_sampling

GOLDEN = Path(__file__).parent / "golden"
TRACE = "ab" * 16
RID = "rollout-1"


def load(name: str) -> list[SpanRecord]:
    return [SpanRecord(**span) for span in json.loads((GOLDEN / name).read_text())]


@pytest.mark.parametrize(
    ("name", "agent"),
    [
        ("langchain_create_agent.json", "calc"),
        ("autogen_assistant_agent.json", "calculator"),
        ("openai_agents_sdk_agent.json", "calculator"),
    ],
)
def test_golden_trees_from_real_frameworks(name, agent):
    spans = load(name)
    llm = sorted((s for s in spans if s.name == sc.LLM_SPAN), key=lambda s: s.start_ns)
    episode = build_episode(spans)
    assert isinstance(episode, Episode)
    assert [t.prompt_ids for t in episode.transitions] == [s.attributes[sc.LLM_PROMPT_TOKEN_IDS] for s in llm]
    assert [t.response_ids for t in episode.transitions] == [s.attributes[sc.LLM_RESPONSE_TOKEN_IDS] for s in llm]
    assert [t.logprobs for t in episode.transitions] == [s.attributes[sc.LLM_RESPONSE_LOGPROBS] for s in llm]
    assert [t.agent for t in episode.transitions] == [agent, agent]
    assert [t.index for t in episode.transitions] == [0, 1]
    assert [t.finish_reason for t in episode.transitions] == ["tool_calls", "stop"]
    # lit.reward(0.25, name="format") came after the agent's last call; the function returned 1.0.
    assert [t.reward for t in episode.transitions] == [None, 0.25]
    assert episode.rewards == [("format", 0.25, 1)]
    assert episode.final_reward == 1.0 and episode.episode_return == 1.0
    assert episode.rollout_id == llm[0].rollout_id
    assert all(t.rollout_id == episode.rollout_id for t in episode.transitions)
    assert episode.skipped_calls == 0

    shuffled = spans + random.Random(7).sample(spans, len(spans) // 2)  # duplicates, any order
    random.Random(3).shuffle(shuffled)
    assert build_episode(shuffled) == episode


def test_golden_tree_round_trips_through_a_dict():
    episode = build_episode(load("autogen_assistant_agent.json"))
    assert Episode.from_dict(json.loads(json.dumps(episode.to_dict()))) == episode


class Tree:
    """Hand-built span trees; times are in ticks, ids are made up."""

    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []

    def add(self, name, parent=None, start=0, end=None, status=STATUS_OK, **attrs) -> str:
        span_id = format(len(self.spans) + 1, "016x")
        self.spans.append(
            SpanRecord(TRACE, span_id, parent, name, start, end if end is not None else start + 1, status, "",
                       RID, {sc.ROLLOUT_ID: RID, sc.TASK_ID: "t1", sc.ATTEMPT: 1, **attrs})
        )
        return span_id

    def root(self, reward=1.0, status=STATUS_OK) -> str:
        attrs = {sc.ROLLOUT_RETURN_REWARD: reward} if reward is not None else {}
        return self.add(sc.ROLLOUT_SPAN, start=0, end=1000, status=status, **attrs)

    def llm(self, parent, start, agent="solver", ids=(1, 2), status=STATUS_OK, token_ids=True) -> str:
        attrs = {sc.AGENT_NAME: agent}
        if token_ids:
            attrs |= {sc.LLM_PROMPT_TOKEN_IDS: [start, start + 1], sc.LLM_RESPONSE_TOKEN_IDS: list(ids),
                      sc.LLM_RESPONSE_LOGPROBS: [-0.5] * len(ids)}
        return self.add(sc.LLM_SPAN, parent, start, start + 5, status, **attrs)

    def reward(self, parent, start, value, name="") -> str:
        return self.add(sc.REWARD_SPAN, parent, start, start, **{sc.REWARD_VALUE: value, sc.REWARD_NAME: name})


def test_nested_agents_are_ordered_by_time():
    t = Tree()
    root = t.root()
    team = t.add("team", root, 1, 900)
    a = t.add("planner.on_messages", team, 2, 100, **{sc.OI_GRAPH_NODE_ID: "planner"})
    b = t.add("solver.on_messages", team, 101, 800)
    t.llm(b, 150, agent="solver")
    t.llm(a, 10, agent="planner")
    t.llm(b, 300, agent="solver")
    episode = build_episode(t.spans)
    assert [(tr.agent, tr.prompt_ids[0]) for tr in episode.transitions] == [
        ("planner", 10), ("solver", 150), ("solver", 300)
    ]


def test_two_agents_only_one_trained():
    t = Tree()
    root = t.root(reward=None)
    t.llm(root, 10, agent="solver")
    t.llm(root, 20, agent="critic")
    t.reward(root, 30, 0.5, "critic-said")  # follows the critic's call, so it lands on the solver's
    t.llm(root, 40, agent="solver")
    t.reward(root, 50, 1.0, "correct")
    episode = build_episode(t.spans, agents={"solver"})
    assert [tr.prompt_ids[0] for tr in episode.transitions] == [10, 40]
    assert [tr.reward for tr in episode.transitions] == [0.5, 1.0]
    assert episode.final_reward is None and episode.episode_return == 1.5
    only_critic = build_episode(t.spans, agents={"critic"})
    assert [tr.agent for tr in only_critic.transitions] == ["critic"]
    nobody = build_episode(t.spans, agents={"planner"})
    assert isinstance(nobody, UnusableRollout) and nobody.reason is Unusable.NO_LLM_CALLS
    assert nobody.detail == ("its LLM calls are by other agents: 'critic' x1, 'solver' x2; the agents selected "
                             "for training (agent.agents): 'planner'")  # the names that point at the fix


def test_a_rollout_without_a_usable_call_says_what_it_did_call():
    no_ids = Tree()
    root = no_ids.root()
    no_ids.llm(root, 10, token_ids=False)
    no_ids.llm(root, 20, status=STATUS_ERROR)
    no_ids.llm(root, 30, agent="critic", token_ids=False)  # not selected: not counted
    result = build_episode(no_ids.spans, agents={"solver"})
    assert result.reason is Unusable.NO_LLM_CALLS and result.detail.startswith(
        "2 LLM call(s) of the selected agents failed or carry no token ids"), result
    silent = Tree()
    silent.root()
    assert build_episode(silent.spans).detail.startswith("the rollout made no LLM call that lit recorded")


def test_parallel_tool_calls_and_tool_errors_are_counted_on_the_call_before():
    t = Tree()
    root = t.root()
    t.llm(root, 10)
    t.add("add", root, 20, 40, **{sc.OI_SPAN_KIND: "TOOL"})
    t.add("divide", root, 21, 30, STATUS_ERROR, **{sc.OI_SPAN_KIND: "TOOL"})
    t.add("parse", root, 22, 23, STATUS_ERROR)
    t.llm(root, 50)
    episode = build_episode(t.spans)
    assert [(tr.tool_errors, tr.other_errors) for tr in episode.transitions] == [(1, 1), (0, 0)]


def test_retried_llm_call_keeps_only_the_successful_attempt():
    t = Tree()
    root = t.root()
    t.llm(root, 10, status=STATUS_ERROR, token_ids=False)  # the engine timed out; the client retried
    t.llm(root, 20, ids=(7, 8, 9))
    episode = build_episode(t.spans)
    assert [tr.response_ids for tr in episode.transitions] == [[7, 8, 9]]
    assert episode.skipped_calls == 1


def test_an_orphan_never_becomes_a_transition():
    """#27's hole: an LLM span with a made-up parent (a forger's, who knows the rollout id but no span id of it)
    became a trained transition of that rollout; so did a second parentless span."""
    t = Tree()
    root = t.root()
    made_up_parent = "f" * 16  # no span of the rollout has this id
    t.llm(root, 10)
    forged = {sc.AGENT_NAME: "solver", sc.LLM_PROMPT_TOKEN_IDS: [20], sc.LLM_RESPONSE_TOKEN_IDS: [3],
              sc.LLM_RESPONSE_LOGPROBS: [-1.0]}
    t.add(sc.LLM_SPAN, made_up_parent, 20, 25, **forged)
    t.add(sc.LLM_SPAN, None, 30, 35, **forged)
    orphan_parent = t.add("tool", made_up_parent, 40, 50)
    t.llm(orphan_parent, 41)  # a whole forged subtree
    episode = build_episode(t.spans)
    assert [tr.prompt_ids for tr in episode.transitions] == [[10, 11]]


BAD_VALUES = {  # #27's holes: each one raised in the trainer (assert, ValueError, IndexError) or went through
    "nan_return": (Unusable.BAD_REWARD, lambda t, root, call: t.spans.__setitem__(0, _with(
        t.spans[0], **{sc.ROLLOUT_RETURN_REWARD: float("nan")}))),
    "inf_reward": (Unusable.BAD_REWARD, lambda t, root, call: t.reward(root, 20, float("inf"))),
    "text_return": (Unusable.BAD_REWARD, lambda t, root, call: t.spans.__setitem__(0, _with(
        t.spans[0], **{sc.ROLLOUT_RETURN_REWARD: "1.0"}))),
    "huge_return": (Unusable.BAD_REWARD, lambda t, root, call: t.spans.__setitem__(0, _with(
        t.spans[0], **{sc.ROLLOUT_RETURN_REWARD: -1.7e308}))),  # a group's mean of two such is -inf
    "huge_reward": (Unusable.BAD_REWARD, lambda t, root, call: t.reward(root, 20, 2e9)),
    "text_attempt": (Unusable.BAD_ATTEMPT, lambda t, root, call: t.spans.__setitem__(0, _with(
        t.spans[0], **{sc.ATTEMPT: "x"}))),
    "huge_token_id": (Unusable.BAD_TOKEN_IDS, lambda t, root, call: t.llm(root, 30, ids=(1_000_000_000,))),
    "negative_token_id": (Unusable.BAD_TOKEN_IDS, lambda t, root, call: t.llm(root, 30, ids=(-1,))),
    "text_token_id": (Unusable.BAD_TOKEN_IDS, lambda t, root, call: t.llm(root, 30, ids=("7",))),
    "float_token_id": (Unusable.BAD_TOKEN_IDS, lambda t, root, call: t.llm(root, 30, ids=(7, 2.0))),
    "token_id_past_2_32": (Unusable.BAD_TOKEN_IDS, lambda t, root, call: t.llm(root, 30, ids=(2**32,))),
    "positive_logprob": (Unusable.BAD_LOGPROBS, lambda t, root, call: _set(t, call, **{
        sc.LLM_RESPONSE_LOGPROBS: [-0.5, 3.0]})),
    "nan_logprob": (Unusable.BAD_LOGPROBS, lambda t, root, call: _set(t, call, **{
        sc.LLM_RESPONSE_LOGPROBS: [float("nan"), -0.5]})),
    "text_logprob": (Unusable.BAD_LOGPROBS, lambda t, root, call: _set(t, call, **{
        sc.LLM_RESPONSE_LOGPROBS: ["-0.5", -0.5]})),
    "list_logprob": (Unusable.BAD_LOGPROBS, lambda t, root, call: _set(t, call, **{
        sc.LLM_RESPONSE_LOGPROBS: [[-0.5], -0.5]})),
    "overflowing_logprobs": (Unusable.BAD_LOGPROBS, lambda t, root, call: _set(t, call, **{
        sc.LLM_RESPONSE_LOGPROBS: [-1.7e308, -1.7e308]})),
    "logprob_float32_cannot_hold": (Unusable.BAD_LOGPROBS, lambda t, root, call: _set(t, call, **{
        sc.LLM_RESPONSE_LOGPROBS: [-1e39, -0.5]})),  # finite in float64, -inf in the trainer's float32
    "text_temperature": (Unusable.BAD_SAMPLING, lambda t, root, call: _set(t, call, **{sc.LLM_TEMPERATURE: "hot"})),
    "negative_temperature": (Unusable.BAD_SAMPLING, lambda t, root, call: _set(t, call, **{
        sc.LLM_TEMPERATURE: -1.0})),
    "infinite_temperature": (Unusable.BAD_SAMPLING, lambda t, root, call: _set(t, call, **{
        sc.LLM_TEMPERATURE: float("inf")})),
    "map_sampling": (Unusable.BAD_SAMPLING, lambda t, root, call: _set(t, call, **{
        sc.LLM_SAMPLING_UNSUPPORTED: {"top_p": 0.9}})),
}


def _with(span: SpanRecord, **attrs) -> SpanRecord:
    return dataclasses.replace(span, attributes={**span.attributes, **attrs})


def _set(t: Tree, span_id: str, **attrs) -> None:
    i = next(i for i, s in enumerate(t.spans) if s.span_id == span_id)
    t.spans[i] = _with(t.spans[i], **attrs)


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_a_value_lit_cannot_train_on_makes_the_rollout_unusable_with_its_reason(case):
    reason, spoil = BAD_VALUES[case]
    t = Tree()
    root = t.root()
    call = t.llm(root, 10)
    assert isinstance(build_episode(t.spans, vocab_size=64), Episode)  # the same tree before
    spoil(t, root, call)
    result = build_episode(t.spans, vocab_size=64)
    assert isinstance(result, UnusableRollout) and result.reason is reason, result
    assert result.detail  # which value, in words


def test_the_sum_of_the_rewards_is_checked_too():
    """Two lit.reward(1e308) summed to an infinite return, which failed an assert in credit assignment and stopped
    the run; each reward is bounded now, and so is their sum (the return when the agent returns none)."""
    t = Tree()
    root = t.root(reward=None)
    t.llm(root, 10)
    t.reward(root, 20, 6e8)
    assert build_episode(t.spans).episode_return == 6e8
    t.reward(root, 30, 6e8)
    result = build_episode(t.spans)
    assert result.reason is Unusable.BAD_REWARD and "sum of its 2 lit.reward values" in result.detail, result


def test_a_call_longer_than_the_engines_context_makes_the_rollout_unusable():
    """vLLM never samples past max_model_len: a longer call is not the engine's, and a long enough one would not
    fit in the update's memory."""
    t = Tree()
    t.llm(t.root(), 10, ids=tuple(range(6)))  # 2 prompt + 6 response tokens
    assert isinstance(build_episode(t.spans, context=8), Episode)
    result = build_episode(t.spans, context=7)
    assert result.reason is Unusable.BAD_LENGTH and "2 prompt and 6 response tokens, over 7" in result.detail


def test_a_weight_version_is_a_short_decimal_number_or_none():
    """int() of a 5 kB digit string raised ValueError (past 4300 digits), which stopped the run."""
    t = Tree()
    call = t.llm(t.root(), 10)
    for text, version in (("12", 12), ("9" * 18, 10**18 - 1), ("9" * 19, None), ("9" * 5000, None), ("v3", None)):
        _set(t, call, **{sc.LLM_WEIGHT_VERSION: text})
        assert build_episode(t.spans).transitions[0].weight_version == version, text[:20]


def test_token_ids_are_checked_against_the_vocabulary():
    t = Tree()
    t.llm(t.root(), 10, ids=(63,))
    assert isinstance(build_episode(t.spans, vocab_size=64), Episode)
    assert build_episode(t.spans, vocab_size=63).reason is Unusable.BAD_TOKEN_IDS
    t.llm(t.spans[0].span_id, 20, ids=(2**32 - 1, 2**32))  # no vocabulary given: any id below 2**32
    result = build_episode(t.spans)
    assert result.reason is Unusable.BAD_TOKEN_IDS and str(2**32) in result.detail, result


def test_spans_arriving_after_the_root_give_the_same_episode():
    t = Tree()
    root = t.root()
    t.llm(root, 10)
    t.reward(root, 12, 0.1)
    t.llm(root, 20)
    in_order = build_episode(t.spans)
    root_first = build_episode([t.spans[0]] + t.spans[1:][::-1])
    root_last = build_episode(t.spans[1:] + [t.spans[0]])
    assert in_order == root_first == root_last
    assert [tr.reward for tr in in_order.transitions] == [0.1, None]


def test_unusable_rollouts_are_reported_not_zeroed():
    t = Tree()
    root = t.root()
    t.llm(root, 10)
    no_root = build_episode(t.spans[1:])
    assert isinstance(no_root, UnusableRollout) and no_root.reason is Unusable.NO_ROOT and no_root.rollout_id == RID

    failed = Tree()
    failed_root = failed.root(status=STATUS_ERROR)
    failed.llm(failed_root, 10)
    assert build_episode(failed.spans).reason is Unusable.FAILED

    no_calls = Tree()
    no_calls.root()
    assert build_episode(no_calls.spans).reason is Unusable.NO_LLM_CALLS

    no_reward = Tree()
    no_reward.llm(no_reward.root(reward=None), 10)
    result = build_episode(no_reward.spans)
    assert isinstance(result, UnusableRollout) and result.reason is Unusable.NO_REWARD


def test_reward_before_any_call_counts_in_the_return_but_on_no_call():
    t = Tree()
    root = t.root(reward=None)
    t.reward(root, 5, 0.25, "setup")
    t.llm(root, 10)
    episode = build_episode(t.spans)
    assert episode.rewards == [("setup", 0.25, -1)]
    assert episode.transitions[0].reward is None and episode.episode_return == 0.25


def test_inconsistent_logprobs_are_dropped_not_misaligned():
    t = Tree()
    root = t.root()
    call = t.llm(root, 10, ids=(1, 2, 3))
    span = next(s for s in t.spans if s.span_id == call)
    span.attributes[sc.LLM_RESPONSE_LOGPROBS] = [-0.1]
    (transition,) = build_episode(t.spans).transitions
    assert transition.response_ids == [1, 2, 3] and transition.logprobs is None


def test_each_call_keeps_its_sampling_temperature_and_unsupported_settings_are_found():
    t = Tree()
    root = t.root()
    t.llm(root, 10)  # no temperature recorded
    tempered, nucleus = t.llm(root, 20), t.llm(root, 30)
    spans = {s.span_id: s for s in t.spans}
    spans[tempered].attributes[sc.LLM_TEMPERATURE] = 0.7
    spans[nucleus].attributes[sc.LLM_TEMPERATURE] = 0.5
    spans[nucleus].attributes[sc.LLM_SAMPLING_UNSUPPORTED] = "top_p=0.9"
    episode = build_episode(t.spans)
    assert [tr.temperature for tr in episode.transitions] == [1.0, 0.7, 0.5]  # none recorded: the engine's 1.0
    assert unsupported_sampling([episode]) is episode.transitions[2]
    assert unsupported_sampling([build_episode(t.spans[:3])]) is None
    assert Episode.from_dict(json.loads(json.dumps(episode.to_dict()))) == episode


def test_each_call_keeps_the_weight_version_it_was_served_with():
    t = Tree()
    root = t.root()
    calls = [t.llm(root, 10 * (i + 1)) for i in range(5)]
    spans = {s.span_id: s for s in t.spans}
    for call, version in zip(calls, ["0", "7", "v3", "-1"], strict=False):  # the last call has none
        spans[call].attributes[sc.LLM_WEIGHT_VERSION] = version
    episode = build_episode(t.spans)
    assert [tr.weight_version for tr in episode.transitions] == [0, 7, None, None, None]
    assert Episode.from_dict(json.loads(json.dumps(episode.to_dict()))) == episode
    stored_before = episode.to_dict()  # as the store holds episodes written before the field existed
    for transition in stored_before["transitions"]:
        del transition["weight_version"]
    assert [tr.weight_version for tr in Episode.from_dict(stored_before).transitions] == [None] * 5
