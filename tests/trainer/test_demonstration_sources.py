"""Demonstrations from an earlier run's store (``sft.source = "store"``, run/demonstration_sources.py): a real
SQLite store holding rollouts as a training run leaves them (spans, rollout rows, episodes)."""

from __future__ import annotations

import json
from pathlib import Path

from test_viewer import SESSION, Rollout, fill_run

from lit_sdk import semconv as sc
from lit_trainer.intake.rows import RolloutRow, RolloutStatus
from lit_trainer.intake.store import SqliteStore
from lit_trainer.results.runs import RunFolder
from lit_trainer.run.demonstration_sources import from_store
from lit_trainer.run.preflight import check_store


def earlier_run(folder: Path, model: str = "smollm2-135m") -> list[str]:
    """A run folder whose store holds training steps 1 and 2 (two rollouts each, returns 1 and 0), a validation
    (return 1) and a failed attempt of step 2 (return 1 in its root, never finished); its rollout ids."""
    run = RunFolder(folder)
    run.create()
    run.save_config({"model": model, "agent": {"agents": []}})
    with SqliteStore(run.store) as store:
        ids = fill_run(store, [("s0", 0, 1), ("s0", 0, 0), ("s1", 1, 1), ("s1", 1, 0), ("val1", 1, 1)])
        failed = Rollout(f"{SESSION}-s1-t1-g9-a1")
        failed.call(failed.add(sc.ROLLOUT_SPAN, None, 0, **{sc.ROLLOUT_RETURN_REWARD: 1.0}), 1, "calc", [1, 2], [3, 4])
        store.add_spans(failed.spans)
        store.add_rollouts([RolloutRow(failed.rollout_id, "t1", 1, status=RolloutStatus.RUNNING)])
        store.set_rollout_status(failed.rollout_id, RolloutStatus.FAILED, "timed out")
    return ids


def test_the_successful_training_rollouts_of_an_earlier_run_are_demonstrations(tmp_path: Path):
    ids = earlier_run(tmp_path / "earlier")
    demos = from_store(tmp_path / "earlier", (), success_reward=1.0)
    assert sorted(d.rollout_id for d in demos) == sorted([ids[0], ids[2]])  # not the validation's, not the failed
    assert all(d.prompt_ids == [1, 2] and d.response_ids == [3, 4] and d.logprobs is None and d.agent == "calc"
               for d in demos)
    assert from_store(tmp_path / "earlier", ("writer",), success_reward=1.0) == []  # no call of a trained role
    assert len(from_store(tmp_path / "earlier", ("calc",), success_reward=0.0)) == 4


def test_a_store_of_another_model_or_no_run_at_all_is_refused_at_load(tmp_path: Path):
    earlier_run(tmp_path / "earlier", model="other-model")
    assert check_store(str(tmp_path / "earlier"), "other-model") is None
    assert "is a run of the model 'other-model', not 'smollm2-135m'" in check_store(str(tmp_path / "earlier"),
                                                                                     "smollm2-135m")
    assert "is not a run's output folder" in check_store(str(tmp_path / "nothing"), "smollm2-135m")
    assert json.loads((tmp_path / "earlier" / "config.json").read_text())["model"] == "other-model"


def test_the_rollouts_that_collect_demonstrations_are_no_training_steps(tmp_path: Path):
    """The rollouts run to collect demonstrations (references: ``demo0``, a teacher: ``teacher0-...``) are recorded
    under step 0 beside training step 1's, which ``lit show`` and ``sft.source = "store"`` read without them; the
    viewer names them for what they are."""
    from lit_trainer.results import viewer
    from lit_trainer.results.runs import Run
    from lit_trainer.steps import kind_of

    run = RunFolder(tmp_path / "run")
    run.create()
    with SqliteStore(run.store) as store:
        ids = fill_run(store, [("demo0", 0, 1), ("teacher0-a1b2c3", 0, 1), ("s0", 0, 1)])
    assert [kind_of(i) for i in ids] == ["demonstrations", "demonstrations", "training"]
    opened = Run(run.dir)
    try:
        assert [row.rollout_id for row in opened.rollouts(1)] == [ids[2]]
        assert viewer._step(opened.store().get_rollout(ids[0])) == "collecting demonstrations ([sft]), before step 1"
    finally:
        opened.close()
    assert [d.rollout_id for d in from_store(run.dir, (), 1.0)] == [ids[2]]
