"""Which rollout the running code belongs to: a context variable, so it follows threads started with a copied
context and asyncio tasks.
"""

from __future__ import annotations

import contextlib
import contextvars
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Rollout:
    rollout_id: str
    task_id: str = ""
    attempt: int = 1
    weight_version: str | None = None
    """The policy weight version the trainer served this rollout with, when it says so."""
    agent: str | None = None
    """The agent name for LLM calls that no framework names (``@lit.trace(agent=...)``)."""
    secret: str | None = None
    """The attempt's secret from the trainer (``Run.secret``), stamped on the root span."""


_rollout: contextvars.ContextVar[Rollout | None] = contextvars.ContextVar("lit_rollout", default=None)
_assigned: contextvars.ContextVar[Rollout | None] = contextvars.ContextVar("lit_assigned", default=None)


def current_rollout() -> Rollout | None:
    return _rollout.get()


@contextlib.contextmanager
def assign(rollout_id: str, task_id: str = "", attempt: int = 1, weight_version: str | None = None,
           secret: str | None = None) -> Iterator[None]:
    """Run the next ``@lit.trace`` function as this rollout, with this id and the trainer's ``secret`` for it
    (``lit.assign_rollout``; the trainer's workers and ``lit_trainer.Playground`` use it; outside them a rollout
    gets a fresh id and no secret)."""
    token = _assigned.set(Rollout(rollout_id, task_id, attempt, weight_version, secret=secret))
    try:
        yield
    finally:
        _assigned.reset(token)


def begin_rollout(agent: str | None) -> tuple[Rollout, contextvars.Token]:
    """The rollout a new root span stands for: the assigned one, or a fresh id when run outside the trainer."""
    base = _assigned.get() or Rollout(rollout_id=uuid.uuid4().hex)
    rollout = replace(base, agent=agent)
    return rollout, _rollout.set(rollout)


def enter_agent(agent: str) -> contextvars.Token:
    """Inside a rollout, make ``agent`` the default agent name (nested ``@lit.trace(agent=...)``)."""
    return _rollout.set(replace(_rollout.get(), agent=agent))  # type: ignore[arg-type]


def leave(token: contextvars.Token) -> None:
    _rollout.reset(token)
