"""Off-policy guidance (``rollouts/guidance.py``): which groups get a reference episode, what that episode is, how
credit and the advantages treat it (by hand), and the references a run accepts. The tokenizer is the default
model's, and a reference's tokens are checked against a response the engine wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lit_trainer.algorithm.advantages import AdvantageConfig, episode_advantages
from lit_trainer.algorithm.credit import CreditConfig, assign_credit
from lit_trainer.intake.episodes import Episode, Transition
from lit_trainer.learner.batching import BatchingConfig, unusable
from lit_trainer.rollouts.guidance import GUIDED_SUFFIX, check_references, guide, reference_encoder, references_of

PROMPT = [5, 6, 7, 8]


def episode(task: str, n: int, ret: float, calls: int = 1) -> Episode:
    transitions = [Transition(prompt_ids=PROMPT + [i], response_ids=[9, 10, 11], logprobs=[-1.0, -2.0, -0.5],
                              reward=None, agent="calc", rollout_id=f"{task}-r{n}", task_id=task, index=i,
                              span_id=f"s{i}", tool_errors=1, finish_reason="length", temperature=0.7,
                              weight_version=3) for i in range(calls)]
    return Episode(f"{task}-r{n}", task, 0, transitions, ret, ret)


def encode(text: str) -> list[int]:
    return [ord(c) for c in text] + [2]


def test_a_failed_group_with_a_reference_gets_one_reference_episode():
    episodes = ([episode("a", n, 0.0, calls=2) for n in (3, 1, 2)]  # every rollout failed: guided
                + [episode("b", n, r) for n, r in ((1, 0.0), (2, 1.0))]  # one solved it: a signal already
                + [episode("c", n, 0.0) for n in (1, 2)]  # failed, but no reference
                + [episode("d", 1, 0.0)])  # a group of one: nothing to compare
    guided, metrics = guide(episodes, {"a": "ok", "b": "yes", "d": "no"}, encode, success_reward=1.0,
                            min_group_size=2)
    assert metrics == {"guidance/groups": 1.0, "guidance/failed_groups": 2.0}
    [g] = guided
    assert (g.rollout_id, g.task_id, g.final_reward, g.episode_return) == ("a-r1" + GUIDED_SUFFIX, "a", 1.0, 1.0)
    [call] = g.transitions  # the first call only, its prompt from the first rollout by id
    assert call.prompt_ids == PROMPT + [0] and call.response_ids == [ord("o"), ord("k"), 2]
    assert call.guided and call.logprobs is None and call.reward is None and call.index == 0
    assert (call.finish_reason, call.tool_errors, call.temperature, call.weight_version) == ("stop", 0, 0.7, 3)
    assert (call.rollout_id, call.task_id) == (g.rollout_id, "a")
    # a partial return is not a success: still guided; min_group_size above the group's size: not
    partial = [episode("a", n, 0.5) for n in (1, 2)]
    assert guide(partial, {"a": "ok"}, encode, 1.0, 2)[1]["guidance/groups"] == 1.0
    assert guide(partial, {"a": "ok"}, encode, 1.0, 3)[1] == {"guidance/groups": 0.0, "guidance/failed_groups": 0.0}


def test_the_reference_gets_the_positive_advantage_by_hand():
    """Returns 0, 0, 0 and the reference's 1: mean 1/4, std (unbiased) 1/2, so the reference's advantage is
    (1 - 1/4) / (1/2) = 1.5 and each failed rollout's -0.5; the credit of the guided call is 1 in every mode."""
    episodes = [episode("a", n, 0.0) for n in (1, 2, 3)]
    guided, _ = guide(episodes, {"a": "ok"}, encode, 1.0, 2)
    for mode in ("identical", "discounted", "intermediate"):
        assert assign_credit(guided[0], CreditConfig(mode=mode)).tolist() == [1.0]
    advantages, _ = episode_advantages(episodes + guided, CreditConfig(), AdvantageConfig())
    assert torch.cat(advantages).tolist() == pytest.approx([-0.5, -0.5, -0.5, 1.5], abs=1e-5)  # eps 1e-6 in the std


def test_a_guided_call_is_usable_without_behaviour_logprobs_and_a_sampled_one_is_not():
    [g], _ = guide([episode("a", n, 0.0) for n in (1, 2)], {"a": "ok"}, encode, 1.0, 2)
    config = BatchingConfig()
    assert unusable(g.transitions[0], config) is None
    sampled = episode("a", 1, 0.0).transitions[0]
    sampled.logprobs = None
    assert unusable(sampled, config) == "no_logprobs"
    assert unusable(g.transitions[0], BatchingConfig(max_prompt_tokens=3)) == "prompt_too_long"


def test_references_are_checked_before_a_run_starts():
    assert check_references([{"id": 1, "reference": "x"}, {"id": 2}]) is None
    assert references_of([{"id": 1, "reference": "x"}, {"id": 2}, {"id": 3, "reference": None}]) == {"1": "x"}
    assert "no training task has a 'reference'" in check_references([{"id": 1}, {"id": 2, "reference": None}])
    for bad in ("", "  ", 7, ["x"]):
        problem = check_references([{"id": "t1", "reference": bad}])
        assert "task 't1' has reference" in problem and "non-empty string" in problem


def test_a_reference_is_tokenized_as_the_engine_wrote_a_response(prepared_model: Path):
    """The ids of a calc response vLLM sampled (a run's store, 2026-11-29): a calculator call then ``<|im_end|>``."""
    engine = [44, 19324, 79, 4350, 46, 198, 39428, 1245, 1799, 476, 21870, 1508, 1002, 476, 24370, 1799, 9583, 17382,
              1799, 476, 39, 34, 27, 40, 35, 18, 17859, 198, 9617, 19324, 79, 4350, 46, 2]
    text = '<tool_call>\n{"name": "calculator", "arguments": ' + json.dumps({"expression": "72+83"}) + "}\n</tool_call>"
    assert reference_encoder(prepared_model)(text) == engine


def test_lit_train_with_guidance_and_no_reference_stops_before_the_model_loads(tmp_path: Path):
    """``rollouts.guidance = true`` on tasks without a ``reference``: the run stops at once, naming the fix, before
    the model, vLLM or a worker starts (the e2e option run, tests/e2e/test_train_options.py, trains with it)."""
    import lit_trainer
    from lit_trainer.config import ConfigError
    from lit_trainer.run.loop import run

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for split in ("train", "validation"):
        (tasks / f"{split}.jsonl").write_text('{"id": "a", "question": "2+2?"}\n')
    cfg = lit_trainer.make_config(agent={"function": "examples.calc.agent:calc_agent"}, data={"tasks": str(tasks)},
                                  rollouts={"guidance": True}, train={"output_dir": str(tmp_path / "run")})
    with pytest.raises(ConfigError, match="no training task has a 'reference'.*set rollouts.guidance = false"):
        run(cfg)
    assert not (tmp_path / "run" / "lit.sqlite").exists()
