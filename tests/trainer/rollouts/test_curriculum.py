"""The curriculum that rests what every rollout solves (``rollouts/curriculum.py``), by hand: which categories rest
after which groups, for how long, what a step draws from, and the state a checkpoint keeps. The feed's use of it
is in test_feed.py; ``lit train`` with it, resumed, in tests/e2e/test_train_options.py (the ``lora_kl`` option)."""

from __future__ import annotations

import re

import pytest

from lit_trainer.rollouts.curriculum import Curriculum, check_rest_by
from lit_trainer.rollouts.sampling import RolloutsConfig

TASKS = [{"id": f"t{i}", "op": "add" if i < 3 else "div"} for i in range(6)]
ADD, DIV = TASKS[0], TASKS[3]
SOLVED, MIXED = [1.0, 1.0], [1.0, 0.0]


def curriculum(rest_after: int = 2, rest_steps: int = 3) -> Curriculum:
    return Curriculum(RolloutsConfig(rest_by="op", rest_after=rest_after, rest_steps=rest_steps), success_reward=1.0)


def test_a_category_rests_after_its_groups_are_solved_by_every_rollout_that_many_times_in_a_row():
    c = curriculum()
    c.record(0, [(ADD, SOLVED), (DIV, MIXED)])
    assert c.resting(1) == set() and c.streak == {"add": 1, "div": 0}
    c.record(1, [(ADD, SOLVED)])  # the second in a row: rests in steps 2, 3 and 4 (rest_steps = 3)
    assert [c.resting(s) for s in (2, 3, 4, 5)] == [{"add"}, {"add"}, {"add"}, set()]
    assert c.until == {"add": 5} and c.streak["add"] == 0  # back at step 5, counting afresh


def test_a_group_not_solved_by_every_rollout_starts_the_count_again():
    c = curriculum()
    c.record(0, [(ADD, SOLVED), (TASKS[1], MIXED), (TASKS[2], SOLVED)])  # solved, not, solved: one in a row
    assert c.resting(1) == set() and c.streak["add"] == 1
    c.record(1, [(ADD, [0.0, 0.0])])  # nothing to learn there either, but nothing solved: stays
    assert c.streak["add"] == 0 and c.resting(2) == set()


def test_a_return_below_the_success_reward_is_not_solved_and_a_short_group_does_not_count():
    c = Curriculum(RolloutsConfig(rest_by="op", rest_after=1, rest_steps=3, min_group_size=2), success_reward=1.0)
    c.record(0, [(ADD, [0.9, 0.9]), (DIV, [1.0])])  # equal returns below the bar; one episode of two wanted
    assert c.resting(1) == set() and c.streak == {"add": 0}


def test_a_step_draws_from_the_tasks_not_resting_or_from_all_when_too_few_are_left():
    c = curriculum(rest_after=1)
    c.record(0, [(ADD, SOLVED)])
    assert c.drawable(TASKS, 1, 3) == TASKS[3:]  # the three divisions
    assert c.drawable(TASKS, 1, 4) == TASKS  # 3 left, 4 wanted
    assert c.drawable(TASKS, 4, 4) == TASKS  # rested its 3 steps
    assert c.metrics(TASKS, 1) == {"curriculum/resting": 1.0, "curriculum/resting_tasks": 3.0}


def test_by_id_each_task_rests_on_its_own():
    c = Curriculum(RolloutsConfig(rest_after=1, rest_steps=2), success_reward=1.0)
    c.record(0, [(ADD, SOLVED), (DIV, MIXED)])
    assert c.drawable(TASKS, 1, 2) == [t for t in TASKS if t is not ADD]


def test_the_state_a_checkpoint_keeps_gives_the_same_draws_again():
    c = curriculum()
    c.record(0, [(ADD, SOLVED), (DIV, SOLVED)])
    c.record(1, [(ADD, SOLVED)])
    again = curriculum()
    again.load(c.state())
    assert again.streak == c.streak and again.until == c.until and again.drawable(TASKS, 2, 3) == TASKS[3:]
    fresh = curriculum()
    fresh.load(None)  # a checkpoint written without the curriculum
    assert fresh.resting(2) == set()


@pytest.mark.parametrize(("tasks", "message"), [
    ([{"id": 1, "op": "add"}, {"id": 2}], r"training task 2 has no field 'op' \(its fields: id\)"),
    ([{"id": 1, "op": ["add"]}], r"training task 1 has a list there"),
])
def test_a_field_some_task_lacks_is_named_before_training(tasks, message):
    problem = check_rest_by(tasks, "op")
    assert problem is not None and re.search(message, problem), problem
    assert check_rest_by([{"id": 1, "op": "add"}], "op") is None
