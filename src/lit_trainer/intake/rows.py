"""What the store holds, row by row, and the ``Store`` interface the trainer uses (``store.py``: ``SqliteStore``,
the embedded default)."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from lit_sdk.protocol import PackedSpan, SpanRecord


class RolloutStatus(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"


_ENDED = frozenset({RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.TIMED_OUT})
ALLOWED_TRANSITIONS: dict[RolloutStatus, frozenset[RolloutStatus]] = {
    RolloutStatus.QUEUED: frozenset({RolloutStatus.RUNNING}) | _ENDED,
    RolloutStatus.RUNNING: _ENDED,
    **{status: frozenset() for status in _ENDED},
}
"""Which status each status may move to (see the module docstring)."""


@dataclass(slots=True)
class RolloutRow:
    """One execution of the agent on one task. Times are Unix seconds; ``created_at`` is set on insert if None."""

    rollout_id: str
    task_id: str
    step: int
    attempt: int = 1
    status: RolloutStatus = RolloutStatus.QUEUED
    created_at: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    error: str | None = None
    secret: str | None = None
    """What the attempt's root span must carry to be stored (intake/admission.py); None: a root without one."""


@dataclass(slots=True)
class TaskRow:
    """One input of a dataset; ``payload`` is anything JSON can hold."""

    task_id: str
    split: str
    payload: Any


@dataclass(slots=True)
class EpisodeRow:
    rollout_id: str
    data: dict[str, Any]
    episode_return: float | None
    built_at: float


@dataclass(slots=True)
class AdvantageRow:
    """The advantage one transition (LLM call) got in the update of training step ``step`` (from 1)."""

    rollout_id: str
    index: int
    """The transition's position in its episode, from 0 (``Transition.index``)."""
    step: int
    advantage: float


@dataclass(slots=True)
class BatchOutcome:
    """What storing one batch of spans did."""

    stored: int
    duplicates: int
    new_roots: list[str] = field(default_factory=list)
    """Rollout ids of the rollout root spans this batch stored for the first time."""
    refused: dict[str, int] = field(default_factory=dict)
    """Spans not stored, by ``admission.EXPLAINED`` kind (not counted in ``duplicates``)."""


class Store(Protocol):
    """What the trainer needs from a database. ``SqliteStore`` is the default; another backend implements this."""

    def add_spans(self, records: Sequence[SpanRecord]) -> tuple[int, int]: ...
    def add_span_batches(self, batches: Sequence[Sequence[SpanRecord]]) -> list[BatchOutcome]: ...
    def add_packed_span_batches(self, batches: Sequence[Sequence[PackedSpan]], admit: bool = False
                                ) -> list[BatchOutcome]: ...
    def spans_of_rollout(self, rollout_id: str) -> list[SpanRecord]: ...
    def missing_spans(self, rollout_id: str) -> str | None: ...
    def add_rollouts(self, rows: Iterable[RolloutRow]) -> None: ...
    def set_rollout_status(self, rollout_id: str, status: RolloutStatus, error: str | None = None) -> None: ...
    def end_unfinished(self, error: str) -> int: ...
    def get_rollout(self, rollout_id: str) -> RolloutRow | None: ...
    def rollouts_of_step(self, step: int) -> list[RolloutRow]: ...
    def last_step(self) -> int | None: ...
    def supersede(self, rollout_ids: Iterable[str], restart_step: int) -> int: ...
    def superseded(self, rollout_ids: Sequence[str]) -> dict[str, int]: ...
    def add_tasks(self, rows: Iterable[TaskRow]) -> int: ...
    def get_task(self, task_id: str) -> TaskRow | None: ...
    def save_episode(self, rollout_id: str, data: dict[str, Any], episode_return: float | None) -> None: ...
    def get_episode(self, rollout_id: str) -> EpisodeRow | None: ...
    def save_advantages(self, rows: Iterable[AdvantageRow]) -> None: ...
    def advantages_of_rollout(self, rollout_id: str) -> dict[int, float]: ...
    def save_trainer_logprobs(self, rows: Iterable[tuple[str, int, list[float]]]) -> None: ...
    def trainer_logprobs_of_rollout(self, rollout_id: str) -> dict[int, list[float]]: ...
    def counts(self) -> dict[str, int]: ...
    def close(self) -> None: ...
