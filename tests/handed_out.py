"""Rollouts registered in a store as the trainer's dispatcher registers them, for tests that send spans through a
real collector: the collector stores only spans of rollouts the trainer handed out (intake/admission.py)."""

from __future__ import annotations

from lit_trainer.intake.rows import RolloutRow, Store


def hand_out(store: Store, *rollout_ids: str, secret: str | None = None) -> None:
    """Register each rollout id (not yet stored) as an attempt of step 0 whose root carries ``secret``."""
    store.add_rollouts(RolloutRow(rid, "task", 0, secret=secret) for rid in dict.fromkeys(rollout_ids)
                       if store.get_rollout(rid) is None)
