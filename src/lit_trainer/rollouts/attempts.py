"""What the dispatcher (dispatcher.py) hands out and keeps track of: the rollouts the trainer requests, each
attempt at one, the workers that run them, a ``run``'s round, and what became of each request."""

from __future__ import annotations

import collections
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lit_sdk.resources import LLM
from lit_trainer.intake.rows import RolloutStatus


@dataclass(frozen=True)
class RolloutRequest:
    """One rollout the trainer wants: ``key`` is unique in the run (attempt ids derive from it)."""

    key: str
    task_id: str
    task: Any
    llm: LLM
    step: int
    version: int = 0
    """The weight version the engine held when the trainer asked for this rollout."""
    balanced: bool = False
    """``llm`` names one of the run's vLLM servers, and the dispatcher calls the one its group was given when it
    was first handed out (``pick_server``) instead."""


@dataclass
class Outcome:
    """What became of one request: the attempt that succeeded, or the last failure."""

    request: RolloutRequest
    status: RolloutStatus
    rollout_id: str
    attempts: int
    reward: float | None = None
    errors: list[str] = field(default_factory=list)


UNCONFIRMED_BEATS = 3
"""Heartbeats of a worker, received after a ``Run`` was sent to it, that may leave the rollout out before the ``Run``
is taken as lost (the first may have been on the way when the ``Run`` was sent)."""


@dataclass
class WorkerState:
    identity: bytes
    slots: int
    last_seen: float
    label: str = ""
    worker_id: str | None = None
    pid: int = 0
    """The process id its hello gave (on its own host)."""
    fd: int = -1
    """The descriptor of its connection, from its last ``hello`` (``ConnectionLimit.doubt`` when it goes silent)."""
    running: set[str] = field(default_factory=set)
    listed: set[str] | None = None
    """The rollout ids its last heartbeat listed; None while it has not listed any (a worker that does not say)."""

    @property
    def busy(self) -> int:
        """Its slots in use: the attempts it runs, and what it still lists that is not one of them (a timed-out
        sync call whose thread has not ended)."""
        return len(self.running) + (len(self.listed - self.running) if self.listed else 0)


@dataclass
class Attempt:
    request: RolloutRequest
    number: int
    worker: WorkerState | None = None
    deadline: float = 0.0
    confirmed: bool = False
    """Whether a heartbeat of its worker listed it."""
    unlisted: int = 0
    """Heartbeats of its worker since its ``Run`` that did not list it."""
    secret: str = field(default_factory=lambda: secrets.token_hex(16))
    """Handed out with its ``Run`` and stored with the rollout: its root span must carry it (intake/admission.py)."""
    server: str = ""
    """The base URL of the server its agent calls, once handed out."""

    @property
    def rollout_id(self) -> str:
        return f"{self.request.key}-a{self.number}"


@dataclass
class Round:
    """What ``run`` tracks: the requests it has to return (its own, and those an earlier ``run`` carried over),
    attempts waiting and running, and the requests that ended."""

    on_progress: Callable[[Outcome], None] | None = None
    requests: list[RolloutRequest] = field(default_factory=list)
    queue: collections.deque[Attempt] = field(default_factory=collections.deque)
    running: dict[str, Attempt] = field(default_factory=dict)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    errors: dict[str, list[str]] = field(default_factory=lambda: collections.defaultdict(list))
    servers: dict[tuple[int, str], str] = field(default_factory=dict)
    """The server each group of balanced requests was given (``pick_server``)."""


def pick_server(group: tuple[int, str], serving: list[str], given: dict[tuple[int, str], str],
                running: collections.Counter[str]) -> str:
    """The server of a rollout of ``group``: the one the group was given while it serves (its prompt is in that
    server's prefix cache), else the serving server with the fewest rollouts ``running`` on it (the first of
    those in ``serving``'s order), given to the group from now on. A server that answers faster ends its
    rollouts sooner and gets more groups."""
    server = given.get(group)
    if server not in serving:
        server = given[group] = min(serving, key=lambda url: running[url])
    return server


def group_of(request: RolloutRequest) -> tuple[int, str]:
    """The group of a request: its step and task."""
    return request.step, request.task_id


def ended_groups(round_: Round) -> set[tuple[int, str]]:
    """The groups of ``round_`` all of whose requests ended."""
    groups: dict[tuple[int, str], bool] = {}
    for r in round_.requests:
        groups[group_of(r)] = groups.get(group_of(r), True) and r.key in round_.outcomes
    return {key for key, ended in groups.items() if ended}
