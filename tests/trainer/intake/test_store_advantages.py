"""The store's advantages table (what ``lit show`` colours tokens by): round trips, replacement, and a store made
before the table existed gaining it on open."""

from __future__ import annotations

from lit_trainer.intake.rows import AdvantageRow, RolloutRow
from lit_trainer.intake.store import SqliteStore


def test_advantages_round_trip_per_rollout_and_a_later_save_replaces(tmp_path):
    with SqliteStore(tmp_path / "lit.sqlite") as store:
        store.save_advantages([AdvantageRow("r1", 0, 1, 0.5), AdvantageRow("r1", 1, 1, -1.25),
                               AdvantageRow("r2", 0, 1, 0.0)])
        assert store.advantages_of_rollout("r1") == {0: 0.5, 1: -1.25}
        assert store.advantages_of_rollout("r2") == {0: 0.0}
        assert store.advantages_of_rollout("r3") == {}
        store.save_advantages(iter([AdvantageRow("r1", 1, 2, 2.0)]))  # any iterable
        assert store.advantages_of_rollout("r1") == {0: 0.5, 1: 2.0}
    with SqliteStore(tmp_path / "lit.sqlite") as store:  # durable
        assert store.advantages_of_rollout("r1") == {0: 0.5, 1: 2.0}


def test_trainer_logprobs_round_trip_for_transitions_with_a_saved_advantage(tmp_path):
    with SqliteStore(tmp_path / "lit.sqlite") as store:
        store.save_advantages([AdvantageRow("r1", 0, 1, 0.5), AdvantageRow("r1", 1, 1, 0.0)])
        assert store.trainer_logprobs_of_rollout("r1") == {}
        store.save_trainer_logprobs([("r1", 0, [-0.25, -1.5]), ("r9", 0, [-1.0])])  # r9 has no advantage: ignored
        assert store.trainer_logprobs_of_rollout("r1") == {0: [-0.25, -1.5]}
        assert store.trainer_logprobs_of_rollout("r9") == {}


def test_last_step_is_the_latest_step_of_any_rollout(tmp_path):
    with SqliteStore(tmp_path / "lit.sqlite") as store:
        assert store.last_step() is None
        store.add_rollouts([RolloutRow("a", "t1", 0), RolloutRow("b", "t1", 2), RolloutRow("c", "t2", 1)])
        assert store.last_step() == 2
