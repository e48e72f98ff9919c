"""Episodes from a run's outcomes: only what the trainer handed out is trained on."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from lit_sdk import semconv as sc
from lit_sdk.protocol import SpanRecord
from lit_sdk.resources import LLM
from lit_trainer.intake.rows import RolloutStatus
from lit_trainer.intake.store import SqliteStore
from lit_trainer.rollouts.attempts import Outcome, RolloutRequest
from lit_trainer.rollouts.gather import gather_episodes

GOLDEN = Path(__file__).parents[1] / "intake" / "golden" / "autogen_assistant_agent.json"


def stored_rollout(store: SqliteStore, rollout_id: str, task_id: str, attempt: int) -> None:
    """A real AutoGen rollout's spans (recorded), stored under ``rollout_id`` with the root naming that task."""
    spans = [SpanRecord(**span) for span in json.loads(GOLDEN.read_text())]
    renamed = []
    for span in spans:
        attrs = {**span.attributes, sc.ROLLOUT_ID: rollout_id}
        if span.parent_id is None:
            attrs |= {sc.TASK_ID: task_id, sc.ATTEMPT: attempt}
        renamed.append(dataclasses.replace(span, rollout_id=rollout_id, attributes=attrs))
    store.add_spans(renamed)


def outcome(rollout_id: str, task_id: str, attempts: int) -> Outcome:
    request = RolloutRequest(rollout_id.rsplit("-a", 1)[0], task_id, {"id": task_id},
                             LLM("http://127.0.0.1:9/v1", "none"), 0)
    return Outcome(request, RolloutStatus.SUCCEEDED, rollout_id, attempts, 1.0)


def test_a_root_naming_another_task_or_attempt_is_not_trained_on(tmp_path):
    """The root's task id decides the rollout's advantage group: a root naming another task (or none) would move
    that task's baseline. The trainer knows what it handed out, and trains on what matches it only."""
    store = SqliteStore(tmp_path / "lit.sqlite")
    stored_rollout(store, "r0-a1", "t0", 1)  # honest
    stored_rollout(store, "r1-a1", "t0", 1)  # handed out as task t1
    stored_rollout(store, "r2-a2", "t2", 1)  # handed out as attempt 2
    stored_rollout(store, "r3-a1", "", 1)  # names no task
    outcomes = [outcome("r0-a1", "t0", 1), outcome("r1-a1", "t1", 1), outcome("r2-a2", "t2", 2),
                outcome("r3-a1", "t3", 1)]
    episodes, metrics, why = gather_episodes(store, outcomes, (), 1.0)
    assert [(e.rollout_id, e.task_id) for e in episodes] == [("r0-a1", "t0")]
    assert metrics["rollouts/unusable_bad_task"] == 3.0
    assert why["bad_task"].endswith("(the first: rollout r1-a1: task 't0' attempt 1; handed out: task 't1' "
                                    "attempt 1)"), why
    assert store.get_episode("r1-a1") is None and store.get_episode("r0-a1") is not None
    store.close()
