"""How lit numbers steps for the user, and the one place that converts to the store's count.

The user sees training steps counted from 1: the console's ``step N/STEPS``, metrics.jsonl's train records,
``checkpoints/step-N`` and the advantages of the update of step N. A validation is numbered by the training steps
before it: ``validation after step N`` (0: before the first), as the console says it and metrics.jsonl records it.

The store records a rollout under the number of updates the engine had when it ran: training step N's rollouts
under N - 1, the validation after step N's under N (``lit eval``'s under its checkpoint's step), so a store step
holds a training step and a validation side by side. Their rollout ids tell them apart:
``<session>-s<N - 1>-t<task>-...`` for training, ``<session>-val<N>-t<task>-...`` for a validation
(``RolloutRunner.run`` builds them from these labels; bench/normalizer.py parses them). Stored data is never
renumbered: readers (``runs.Run``, the viewer, ``lit show``) convert here, so every store, old or new, reads the same.
"""

from __future__ import annotations

import re
from typing import Literal

_LABEL = re.compile(r"[^-]+-(?P<kind>s|val|demo|teacher)\d+-")
"""The session, then the label a rollout id starts with (a run restarted after a vLLM death adds ``-restartK``)."""

Kind = Literal["training", "validation", "demonstrations"]


def training_label(recorded: int) -> str:
    """The label of the rollouts of the training step recorded under ``recorded`` (training step ``recorded + 1``)."""
    return f"s{recorded}"


def validation_label(step: int) -> str:
    """The label of the rollouts of the validation after ``step`` training steps."""
    return f"val{step}"


def demonstrations_label() -> str:
    """The label of the rollouts that collect demonstrations from the tasks' references (``[sft]``; a teacher's
    are ``teacher<step>-...``), recorded under step 0."""
    return "demo0"


def kind_of(rollout_id: str) -> Kind | None:
    """Whether a rollout ran for a training step, a validation or to collect demonstrations, by its id; None for an
    id the rollout runner did not make (a ``Playground``'s)."""
    match = _LABEL.match(rollout_id)
    if match is None:
        return None
    return {"val": "validation", "s": "training"}.get(match["kind"], "demonstrations")


def recorded_step(step: int, validation: bool = False) -> int:
    """The store's step of training step ``step`` (from 1), or with ``validation`` of the validation after ``step``
    steps."""
    return step if validation else step - 1


def shown_step(recorded: int, validation: bool = False) -> int:
    """The user's step of rollouts recorded under ``recorded``: ``recorded_step``'s inverse."""
    return recorded if validation else recorded + 1


def step_name(step: int, validation: bool = False) -> str:
    """``training step 3``, ``validation after step 3``: a step as the console names it."""
    if not validation:
        return f"training step {step}"
    return "validation before training (after step 0)" if step == 0 else f"validation after step {step}"
