"""Demonstrations (rollouts/demonstrations.py): which a step trains on, how a task's reference becomes one, what
is refused at load and how they are kept for a resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_trainer.config import ConfigError, from_dict
from lit_trainer.intake.episodes import Episode, Transition
from lit_trainer.rollouts.demonstrations import (
    SftConfig,
    batch_of,
    check_task_references,
    from_references,
    load,
    refuse_unfit,
    save,
)


def call(agent: str, index: int, rollout: str = "r1", task: str = "t1") -> Transition:
    return Transition([1, 2, 3 + index], [7, 8], [-0.1, -0.2], 1.0, agent, rollout, task, index, f"s{index}",
                      finish_reason="length", temperature=0.7, weight_version=3)


def test_each_demonstration_comes_once_a_pass_in_a_seeded_order():
    """7 demonstrations, 3 a step: steps 1-7 take 21 = three passes, each pass every index once; the same seed
    gives the same batches, another seed others; fewer demonstrations than a batch: all of them."""
    steps = [batch_of(7, 3, step, seed=0) for step in range(1, 8)]
    taken = [i for batch in steps for i in batch]
    assert all(sorted(taken[p * 7:(p + 1) * 7]) == list(range(7)) for p in range(3))
    assert steps == [batch_of(7, 3, step, seed=0) for step in range(1, 8)]
    assert steps != [batch_of(7, 3, step, seed=1) for step in range(1, 8)]
    assert sorted(batch_of(2, 5, 1, 0)) == [0, 1] and batch_of(0, 5, 1, 0) == []


def test_a_reference_replaces_the_first_call_of_its_role_with_its_tokens():
    """Text: the episode's first call; a table: the first call of each role it names (a role the episode never
    called gives nothing). The prompt is the engine's; the response the reference's tokens; nothing of the
    sampled call's behaviour is kept."""
    episode = Episode("r1", "t1", 1, [call("writer", 0), call("checker", 1), call("rewriter", 2)], 0.0, 0.0)
    other = Episode("r2", "t2", 1, [call("writer", 0, "r2", "t2")], 0.0, 0.0)
    refs = {"t1": {"rewriter": "fixed", "judge": "never called"}, "t2": "gold"}
    demos = from_references([episode, other], refs, lambda text: [len(text), 99])
    assert [(d.task_id, d.agent, d.prompt_ids, d.response_ids) for d in demos] == [
        ("t1", "rewriter", [1, 2, 5], [5, 99]), ("t2", "writer", [1, 2, 3], [4, 99])]
    assert all(d.logprobs is None and d.finish_reason == "stop" and d.temperature == 1.0 and d.reward is None
               and d.weight_version is None for d in demos)


@pytest.mark.parametrize(("tasks", "agents", "message"), [
    ([{"id": "a"}, {"id": "b", "reference": {"checker": "SELECT 1"}}], ("writer", "rewriter"),
     "training task 2 (id 'b') has a reference for role 'checker', which is not trained"),
    ([{"id": "a", "reference": ""}], (), "training task 1 (id 'a') has reference ''"),
    ([{"id": "a", "reference": {"writer": 3}}], (), "training task 1 (id 'a') has reference {'writer': 3}"),
    ([{"id": "a"}], (), "no training task has a 'reference'"),
])
def test_a_reference_that_cannot_teach_is_refused_with_its_position(tasks, agents, message):
    assert message in check_task_references(tasks, agents)


def test_valid_references_pass():
    assert check_task_references([{"id": "a", "reference": {"writer": "SELECT 1"}}, {"id": "b"}], ("writer",)) is None


def test_a_demonstration_longer_than_the_context_is_refused_with_its_position():
    demos = [call("writer", 0), Transition(list(range(30)), [1, 2], None, None, "writer", "r9", "t9", 0, "s")]
    refuse_unfit(demos, 32, "store")
    with pytest.raises(ValueError, match=r"demonstration 2 from sft.source = 'store' \(task 't9', role 'writer'\) "
                                         r"is 32 tokens, over inference.max_model_len = 31"):
        refuse_unfit(demos, 31, "store")


@pytest.mark.parametrize(("settings", "message"), [
    ({"sft": {"steps": 2}}, "sft.steps and sft.weight train on demonstrations: set sft.source"),
    ({"sft": {"source": "references"}}, "collects demonstrations nothing trains on"),
    ({"sft": {"source": "teacher", "steps": 1}}, "sft.source = 'teacher' needs sft.teacher_url"),
    ({"sft": {"source": "store", "steps": 1}}, "sft.source = 'store' needs sft.store"),
    ({"sft": {"source": "refs", "steps": 1}}, "sft.source must be one of"),
    ({"sft": {"source": "references", "steps": 30}, "train": {"steps": 20}},
     "sft.steps = 30 is more than train.steps = 20"),
    ({"sft": {"source": "references", "weight": -1.0}}, "sft.weight must be"),
])
def test_sft_settings_that_cannot_work_are_refused_naming_the_key(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_dict(settings)


def test_every_sft_key_is_listed_by_lit_config_keys():
    """``sft.source`` too, though the config's own record of its file is also named ``source``."""
    from lit_trainer.config import config_keys

    assert [k.name for k in config_keys() if k.name.startswith("sft.")] == [
        f"sft.{name}" for name in ("source", "steps", "batch_size", "learning_rate", "weight", "tasks", "teacher_url",
                                   "teacher_model", "teacher_api_key_env", "store")]


def test_sft_only_is_sft_steps_equal_to_train_steps():
    cfg = from_dict({"sft": {"source": "references", "steps": 20}, "train": {"steps": 20}})
    assert cfg.sft == SftConfig(source="references", steps=20)


def test_demonstrations_saved_for_a_resume_read_back_the_same(tmp_path: Path):
    demos = [Transition([1, 2], [3, 4], None, None, "writer", "r1", "t1", 0, "s0", finish_reason="stop"),
             Transition([5], [6], None, None, "rewriter", "r2", "t2", 2, "s2", finish_reason="stop")]
    save(tmp_path / "demonstrations.jsonl", demos)
    assert load(tmp_path / "demonstrations.jsonl") == demos
    assert not list(tmp_path.glob(".tmp-*"))
