"""The update pipeline (``run/pipeline.py``): ``prepare`` on real episodes (spans recorded from a real AutoGen agent,
tests/trainer/intake/golden/, rebuilt by the intake's ``build_episode``), with advantages computed by hand; then
``update`` on a tiny real Llama, ``push`` and ``check``. The fleet that ``push`` and ``check`` talk to is a stand-in
(a vLLM takes minutes: the e2e runs in tests/e2e push into real ones)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lit_sdk import semconv as sc
from lit_sdk.protocol import STATUS_OK, SpanRecord
from lit_trainer.config import ConfigError, TrainConfig, from_dict
from lit_trainer.engine.logprob_check import Sample, trainer_logprobs
from lit_trainer.engine.weight_sync import WeightSyncError
from lit_trainer.intake.episodes import Episode, build_episode
from lit_trainer.intake.store import SqliteStore
from lit_trainer.run import pipeline

GOLDEN = json.loads((Path(__file__).parent / "intake" / "golden" / "autogen_assistant_agent.json").read_text())


def episode(rollout_id: str, task_id: str, reward: float, **call_attrs: object) -> Episode:
    """The real AutoGen rollout's spans as another rollout of ``task_id`` that returned ``reward``; ``call_attrs``
    go on each of its two LLM calls."""
    spans = []
    for raw in copy.deepcopy(GOLDEN):
        attrs = {**raw["attributes"], sc.ROLLOUT_ID: rollout_id, sc.TASK_ID: task_id}
        if raw["name"] == sc.ROLLOUT_SPAN:
            attrs[sc.ROLLOUT_RETURN_REWARD] = reward
        if raw["name"] == sc.LLM_SPAN:
            attrs.update(call_attrs)
        spans.append(SpanRecord(**{**raw, "rollout_id": rollout_id, "attributes": attrs}))
    built = build_episode(spans)
    assert isinstance(built, Episode) and built.episode_return == reward and len(built.transitions) == 2
    return built


def test_prepare_keeps_every_advantage_and_trains_on_the_groups_with_signal():
    episodes = [episode("a1", "a", 1.0), episode("a2", "a", 0.0), episode("a3", "a", 1.0),  # signal
                episode("b1", "b", 0.5), episode("b2", "b", 0.5),  # equal returns: no signal
                episode("c1", "c", 1.0)]  # a group of one: below min_group_size = 2
    work = pipeline.prepare(episodes, TrainConfig(), step=3)
    # group a: mean 2/3, Bessel std sqrt(1/3); every call of a rollout gets its rollout's advantage
    up, down = (1 / 3) / math.sqrt(1 / 3), (-2 / 3) / math.sqrt(1 / 3)
    assert [(r.rollout_id, r.index, r.step) for r in work.advantages] == [
        (rid, i, 3) for rid in ("a1", "a2", "a3", "b1", "b2") for i in (0, 1)]
    assert [r.advantage for r in work.advantages] == pytest.approx([up, up, down, down, up, up, 0, 0, 0, 0],
                                                                   abs=1e-5)
    assert [(t.rollout_id, t.index) for t, _ in work.pairs] == [(r.rollout_id, r.index) for r in work.advantages]
    assert work.trains and work.metrics["update/transitions"] == 6.0  # the zero ones cost nothing in the update
    assert work.metrics["rollouts/small_groups_dropped"] == 1.0 and work.metrics["rollouts/without_signal"] == 2.0
    assert work.metrics["adv/groups"] == 2.0 and work.metrics["adv/zero_std_groups"] == 1.0
    assert work.metrics["update/overlong_masked"] == 0.0 and "async/dropped_stale" not in work.metrics


def test_a_step_without_signal_trains_nothing_but_keeps_its_advantages():
    work = pipeline.prepare([episode("a1", "a", 1.0), episode("a2", "a", 1.0)], TrainConfig(), step=1)
    assert not work.trains and work.pairs == [] and [r.advantage for r in work.advantages] == [0.0] * 4
    assert work.metrics["update/transitions"] == 0.0 and work.metrics["rollouts/without_signal"] == 2.0
    nothing = pipeline.prepare([episode("c1", "c", 1.0)], TrainConfig(), step=1)
    assert not nothing.trains and nothing.advantages == [] and nothing.metrics == {
        "rollouts/small_groups_dropped": 1.0}
    kl = from_dict({"loss": {"kl_beta": 0.1}})  # the KL term has a gradient on every call
    assert pipeline.prepare([episode("a1", "a", 1.0), episode("a2", "a", 1.0)], kl, step=1).trains


def test_a_call_sampled_with_settings_lit_cannot_reproduce_is_skipped_and_counted(caplog):
    """#27's hole: one span claiming top-p (a forged attribute, or one odd call) raised ConfigError and stopped
    the run; it now costs that transition (update/skipped_sampling)."""
    episodes = [episode("a1", "a", 1.0), episode("a2", "a", 0.0, **{sc.LLM_SAMPLING_UNSUPPORTED: "top_p=0.9"})]
    work = pipeline.prepare(episodes, TrainConfig(), step=1)
    assert work.metrics["update/skipped_sampling"] == 2.0  # episode() gives each rollout two calls
    assert [t.rollout_id for t, _ in work.pairs] == ["a1", "a1"]
    assert "transition a2#0 (agent" in caplog.text and "top_p=0.9: " in caplog.text and "Remove them" in caplog.text


def test_an_agent_whose_every_call_samples_beyond_temperature_stops_the_run():
    episodes = [episode(r, "a", v, **{sc.LLM_SAMPLING_UNSUPPORTED: "top_p=0.9"}) for r, v in (("a1", 1.0), ("a2", 0))]
    with pytest.raises(ConfigError, match=r"every transition of step 1 .* a1#0 .* top_p=0.9: .*Remove them"):
        pipeline.prepare(episodes, TrainConfig(), step=1)


def test_calls_sampled_too_many_versions_ago_are_left_out_with_asynchronous_rollouts():
    cfg = from_dict({"rollouts": {"max_staleness": 1}, "update": {"recompute_old_logprobs": True},
                     "loss": {"is_correction": "truncate"}})
    old = [episode("a1", "a", 1.0, **{sc.LLM_WEIGHT_VERSION: "1"}), episode("a2", "a", 0.0)]
    work = pipeline.prepare(old, cfg, step=4, dispatched=1)  # the policy of 3 updates trains on calls of version 1
    assert not work.trains and len(work.advantages) == 4 and work.metrics["async/dropped_stale"] == 4.0
    work = pipeline.prepare(old, cfg, step=3, dispatched=1)  # one version old: kept
    assert work.trains and len(work.pairs) == 4 and work.metrics["async/dropped_stale"] == 0.0


class Fleet:
    """A stand-in for the vLLM fleet: records the pushes, and reports the logprob gaps it is given."""

    def __init__(self, gap: float = 0.001):
        self.pushed, self.asked, self.gap = [], [], gap

    def push_weights(self, state, version):
        self.pushed.append((version, sorted(state)))
        return SimpleNamespace(total_s=0.25)

    def logprob_gaps(self, score, prompts, tolerance):
        """vLLM's greedy continuation stood in by two fixed tokens; the trainer's side (``score``) really runs."""
        self.asked.append(prompts)
        self.scored = score([Sample(list(p), [4, 5], [-1.0, -1.0]) for p in prompts])
        return {"http://127.0.0.1:8000": SimpleNamespace(max_abs=self.gap, tolerance=tolerance,
                                                         ok=self.gap <= tolerance)}


def tiny_episode(rollout_id: str, reward: float, prompt: list[int], responses: list[list[int]]) -> Episode:
    """A rollout of task ``t`` with one call per response, token ids within the tiny model's vocabulary."""
    trace, spans = "ab" * 16, []

    def add(name: str, parent: str | None, start: int, **attrs: object) -> str:
        span_id = format(len(spans) + 1, "016x")
        spans.append(SpanRecord(trace, span_id, parent, name, start, start + 5, STATUS_OK, "", rollout_id,
                                {sc.ROLLOUT_ID: rollout_id, sc.TASK_ID: "t", sc.ATTEMPT: 1, **attrs}))
        return span_id

    root = add(sc.ROLLOUT_SPAN, None, 0, **{sc.ROLLOUT_RETURN_REWARD: reward})
    for k, response in enumerate(responses):
        add(sc.LLM_SPAN, root, 10 * (k + 1), **{
            sc.AGENT_NAME: "solver", sc.LLM_PROMPT_TOKEN_IDS: prompt, sc.LLM_RESPONSE_TOKEN_IDS: response,
            sc.LLM_RESPONSE_LOGPROBS: [-3.5] * len(response), sc.LLM_FINISH_REASON: "stop"})
    built = build_episode(spans)
    assert isinstance(built, Episode)
    return built


def test_update_push_and_check_on_a_tiny_model(tiny_model: Path, tmp_path: Path):
    from lit_trainer.learner.policy import Policy

    cfg = from_dict({"policy": {"model": str(tiny_model)}, "train": {"check_sync_every": 2}})
    policy = Policy(cfg.policy)
    episodes = [tiny_episode("r1", 1.0, [1, 2, 3], [[4, 5], [6]]), tiny_episode("r2", 0.0, [1, 2, 3], [[7, 8, 9]])]
    work = pipeline.prepare(episodes, cfg, step=1)
    before = {name: p.detach().clone() for name, p in policy.unwrapped().named_parameters() if p.requires_grad}
    with SqliteStore(tmp_path / "store.sqlite") as store:
        store.save_advantages(work.advantages)  # as the loop does, before the update
        job = pipeline.UpdateJob(work.pairs, pad_id=0, seed=7, learning_rate=pipeline.learning_rate(cfg, step=1))
        metrics = pipeline.update(policy, job, cfg, store)
        kept = {rid: store.trainer_logprobs_of_rollout(rid) for rid in ("r1", "r2")}
    assert math.isfinite(metrics["loss/policy"]) and metrics["time/update"] >= 0
    # the step ran at the rate the job carried (constant schedule: policy.learning_rate)
    assert metrics["policy/learning_rate"] == cfg.policy.learning_rate
    assert [g["lr"] for g in policy.optimizer.param_groups] == [cfg.policy.learning_rate]
    # the trainer's logprob of every response token it trained on, for the viewer: one per token, each a logprob
    assert {rid: {i: len(v) for i, v in calls.items()} for rid, calls in kept.items()} == {"r1": {0: 2, 1: 1},
                                                                                          "r2": {0: 3}}
    assert all(value < 0 for calls in kept.values() for values in calls.values() for value in values)
    after = dict(policy.unwrapped().named_parameters())
    assert all(not torch.equal(before[name], after[name]) for name in before)  # every trainable parameter moved

    fleet = Fleet()
    assert pipeline.push(fleet, pipeline.weights(policy), step=1) == {"time/sync": 0.25}
    assert fleet.pushed == [("1", sorted(policy.state_dict()))]
    checked = pipeline.check(fleet, policy, work.pairs, cfg, step=1)  # step 1 is always checked
    assert checked == {"sync/logprob_gap_max": 0.001, "sync/servers_checked": 1.0}
    assert fleet.asked == [[[1, 2, 3], [1, 2, 3]]]  # two of the step's prompts
    expected = trainer_logprobs(policy.unwrapped(), [1, 2, 3], [4, 5])  # the trained weights score the samples
    assert len(fleet.scored) == 2 and all(torch.equal(scored, expected) for scored in fleet.scored)
    assert pipeline.check(fleet, policy, work.pairs, cfg, step=3) == {} and len(fleet.asked) == 1  # not due
    with pytest.raises(WeightSyncError, match=r"sync of step 2, the logprobs of vLLM at http://127.0.0.1:8000 "
                                              r"differ .* by up to 0.5000 nats"):
        pipeline.check(Fleet(gap=0.5), policy, work.pairs, cfg, step=2)


def test_the_sync_check_scores_a_bf16_lora_policy_in_float32(tiny_model: Path):
    """vLLM got float32 merged weights; the trainer's side of the check must compute in float32 too, not on the
    bfloat16 base it trains with (``Policy.in_float32``)."""
    from lit_trainer.learner.policy import Policy

    class Scoring(Fleet):
        def logprob_gaps(self, score, prompts, tolerance):
            dtypes = []
            head = policy.unwrapped().get_output_embeddings()
            handle = head.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
            gaps = super().logprob_gaps(score, prompts[:1], tolerance)
            handle.remove()
            self.asked.append(dtypes)
            return gaps

    cfg = from_dict({"policy": {"model": str(tiny_model), "precision": "bf16", "lora_rank": 4}})
    policy = Policy(cfg.policy)
    assert policy.unwrapped().get_output_embeddings().weight.dtype == torch.bfloat16
    work = pipeline.prepare([tiny_episode("r1", 1.0, [1, 2, 3], [[4, 5]]), tiny_episode("r2", 0.0, [1, 2, 3], [[6]])],
                            cfg, step=1)
    fleet = Scoring()
    assert pipeline.check(fleet, policy, work.pairs, cfg, step=1)["sync/servers_checked"] == 1.0
    assert fleet.asked[1] == [torch.float32]
    assert policy.unwrapped().get_output_embeddings().weight.dtype == torch.bfloat16  # and back after


def role_episode(rollout_id: str, reward: float, *calls: tuple[str, str]) -> Episode:
    """A rollout of task ``a`` that returned ``reward``, with one call per (agent, the model that answered it)."""
    from lit_trainer.intake.episodes import Transition

    transitions = [Transition([1, 2], [3], [-1.0], None, agent, rollout_id, "a", i, f"s{i}", finish_reason="stop",
                              model=model) for i, (agent, model) in enumerate(calls)]
    return Episode(rollout_id, "a", 1, transitions, reward, reward)


def test_each_roles_adapter_is_normalised_among_its_own_calls_and_a_call_another_adapter_served_is_skipped():
    cfg = from_dict({"roles": {"writer": "own", "rewriter": "own", "checker": "base"}, "policy": {"lora_rank": 8}})
    w, r = ("writer", "policy-writer"), ("rewriter", "policy-rewriter")
    episodes = [role_episode("a1", 1.0, w, r), role_episode("a2", 0.0, w), role_episode("a3", 0.0, w, r),
                role_episode("a4", 1.0, ("writer", "policy"))]  # a writer's call the base model answered
    work = pipeline.prepare(episodes, cfg, step=1)
    # the writer's group: all four rollouts, returns 1 0 0 1: mean 1/2, Bessel std sqrt(1/3); the rewriter's: the
    # two rollouts in which it called, returns 1 0: mean 1/2, std sqrt(1/2)
    w_up, r_up = 0.5 / math.sqrt(1 / 3), 0.5 / math.sqrt(1 / 2)
    assert [(a.rollout_id, a.index, a.advantage) for a in work.advantages] == [
        ("a1", 0, pytest.approx(w_up, abs=1e-5)), ("a1", 1, pytest.approx(r_up, abs=1e-5)),
        ("a2", 0, pytest.approx(-w_up, abs=1e-5)),
        ("a3", 0, pytest.approx(-w_up, abs=1e-5)), ("a3", 1, pytest.approx(-r_up, abs=1e-5)),
        ("a4", 0, pytest.approx(w_up, abs=1e-5))]
    assert [(t.rollout_id, t.index) for t, _ in work.pairs] == [("a1", 0), ("a1", 1), ("a2", 0), ("a3", 0), ("a3", 1)]
    assert work.metrics["update/skipped_wrong_adapter"] == 1.0
    assert work.metrics["role/writer/calls"] == 4.0 and work.metrics["role/rewriter/calls"] == 2.0
    assert work.metrics["role/rewriter/rollouts"] == 2.0 and work.metrics["role/rewriter/adv/groups"] == 1.0

    # one adapter shared by both: one group of every call, as without a table
    shared = from_dict({"roles": {"writer": "shared", "rewriter": "shared"}, "policy": {"lora_rank": 8}})
    s = ("writer", "policy-shared")
    episodes = [role_episode("a1", 1.0, s, ("rewriter", "policy-shared")), role_episode("a2", 0.0, s)]
    assert [a.advantage for a in pipeline.prepare(episodes, shared, step=1).advantages] == pytest.approx(
        [a.advantage for a in pipeline.prepare(episodes, TrainConfig(), step=1).advantages])
