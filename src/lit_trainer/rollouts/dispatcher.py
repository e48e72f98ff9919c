"""The trainer's side of the agent workers: hands rollouts to whichever workers are connected, retries what
fails, and keeps every attempt's status in the store.

Workers (``lit_sdk/worker.py``) connect to one ZeroMQ ROUTER socket from any host; the messages are those of
``lit_sdk/protocol/dispatch.py`` (docs/protocol.md, "Dispatch"), and one that does not decode is counted in
``Dispatcher.rejected``, logged once per kind and ignored.
``run(requests)`` gives each requested rollout up to ``max_attempts`` attempts. An attempt is one rollout row in the
store (id ``<request>-a<attempt>``) that ends ``succeeded``, ``failed`` (the agent raised, or its worker went silent
for ``worker_timeout_s``) or ``timed_out`` (past ``rollout_timeout_s``); a failed or timed-out attempt is retried
while attempts remain. A request whose attempts all fail ends failed: it yields no episode, never a reward of 0.

The dispatcher runs in the trainer's thread and only while the trainer waits for rollouts (generation and training
alternate); messages that arrive meanwhile wait in the socket, so a worker's liveness is judged only after they
are read.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from lit_sdk.protocol.codec import ProtocolError
from lit_sdk.protocol.dispatch import (
    TO_TRAINER,
    Done,
    Hello,
    Run,
    Stop,
    ToTrainer,
    ToWorker,
    Welcome,
    Who,
    decode_dispatch,
    encode_dispatch,
)
from lit_sdk.resources import LLM
from lit_trainer.intake.store import RolloutRow, RolloutStatus, Store

log = logging.getLogger("lit.dispatcher")


class DispatchError(RuntimeError):
    """No worker is there to run rollouts, or the dispatch endpoint cannot be bound."""


@dataclass(frozen=True)
class DispatchConfig:
    rollout_timeout_s: float = 300.0
    """An attempt running longer is ``timed_out`` (the worker cancels it too) and retried."""
    max_attempts: int = 2
    """Attempts per rollout before it is marked failed for good."""
    worker_timeout_s: float = 30.0
    """A worker silent this long (no heartbeat) is dead: its running attempts fail and are retried elsewhere."""
    no_worker_timeout_s: float = 300.0
    """How long ``run`` waits with rollouts to do and no worker connected before it gives up."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        for name in ("rollout_timeout_s", "worker_timeout_s", "no_worker_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class RolloutRequest:
    """One rollout the trainer wants: ``key`` is unique in the run (attempt ids derive from it)."""

    key: str
    task_id: str
    task: Any
    llm: LLM
    step: int


@dataclass
class Outcome:
    """What became of one request: the attempt that succeeded, or the last failure."""

    request: RolloutRequest
    status: RolloutStatus
    rollout_id: str
    attempts: int
    reward: float | None = None
    errors: list[str] = field(default_factory=list)


@dataclass
class _Worker:
    identity: bytes
    slots: int
    last_seen: float
    running: set[str] = field(default_factory=set)
    label: str = ""


@dataclass
class _Attempt:
    request: RolloutRequest
    number: int
    worker: bytes | None = None
    deadline: float = 0.0

    @property
    def rollout_id(self) -> str:
        return f"{self.request.key}-a{self.number}"


class Dispatcher:
    def __init__(self, store: Store, endpoint: str, spans_endpoint: str, llm_base_urls: Sequence[str],
                 config: DispatchConfig | None = None):
        self.store = store
        self.config = config or DispatchConfig()
        self.spans_endpoint = spans_endpoint
        self.llm_base_urls = list(llm_base_urls)
        self.workers: dict[bytes, _Worker] = {}
        self.rejected: dict[str, int] = {}
        """Messages from workers refused (malformed, wrong version...), by ``ProtocolError.kind``."""
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        bind = endpoint[:-2] + ":*" if endpoint.endswith(":0") else endpoint
        try:
            self.sock.bind(bind)
        except zmq.ZMQError as exc:
            self.sock.close()
            raise DispatchError(f"cannot listen for workers on {endpoint}: {exc} (is another trainer running? "
                                "set dispatch.endpoint to a free port, or tcp://127.0.0.1:0 for any)") from None
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def close(self) -> None:
        """Tell every known worker to stop, then close the socket. Idempotent."""
        if self.sock.closed:
            return
        for identity in list(self.workers):
            self._send(identity, Stop())
        self.sock.close()

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait_for_workers(self, n: int, timeout_s: float) -> None:
        """Block until ``n`` workers said hello (raises DispatchError after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while len(self.workers) < n:
            if time.monotonic() > deadline:
                raise DispatchError(f"{len(self.workers)} of {n} workers connected to {self.endpoint} within "
                                    f"{timeout_s:.0f} s; check the worker processes' output")
            self._drain(100)

    def run(self, requests: Sequence[RolloutRequest],
            on_progress: Callable[[Outcome], None] | None = None) -> list[Outcome]:
        """Run every request to an end (success, or failure after ``max_attempts``); outcomes in request order."""
        queue: collections.deque[_Attempt] = collections.deque()
        self._enqueue(queue, [_Attempt(r, 1) for r in requests])
        running: dict[str, _Attempt] = {}
        outcomes: dict[str, Outcome] = {}
        errors: dict[str, list[str]] = collections.defaultdict(list)
        idle_since = time.monotonic()

        def finish(attempt: _Attempt, status: RolloutStatus, error: str | None, reward: float | None = None) -> None:
            self.store.set_rollout_status(attempt.rollout_id, status, error)
            key = attempt.request.key
            if error:
                errors[key].append(f"attempt {attempt.number}: {error}")
            if status is RolloutStatus.SUCCEEDED or attempt.number >= self.config.max_attempts:
                outcomes[key] = Outcome(attempt.request, status, attempt.rollout_id, attempt.number, reward,
                                        errors.pop(key, []))
                if on_progress:
                    on_progress(outcomes[key])
            else:
                log.info("lit: rollout %s %s (%s); retrying", attempt.rollout_id, status.value, error)
                self._enqueue(queue, [_Attempt(attempt.request, attempt.number + 1)])

        while len(outcomes) < len(requests):
            for message, identity in self._drain(50):
                if isinstance(message, Done):
                    attempt = running.get(message.rollout_id)
                    if attempt is None or attempt.worker != identity:
                        continue  # a late report of an attempt already given up on
                    del running[attempt.rollout_id]
                    self.workers[identity].running.discard(attempt.rollout_id)
                    finish(attempt, RolloutStatus(message.status), message.error, message.reward)
            now = time.monotonic()
            for attempt in [a for a in running.values() if now > a.deadline]:
                del running[attempt.rollout_id]
                self._release(attempt)
                finish(attempt, RolloutStatus.TIMED_OUT,
                       f"no result within rollout_timeout_s={self.config.rollout_timeout_s:g} s")
            for identity, worker in list(self.workers.items()):
                if now - worker.last_seen > self.config.worker_timeout_s:
                    log.warning("lit: worker %s went silent for %.0f s; its %d rollouts will be retried",
                                worker.label, now - worker.last_seen, len(worker.running))
                    del self.workers[identity]
                    for rid in sorted(worker.running):
                        finish(running.pop(rid), RolloutStatus.FAILED, f"worker {worker.label} died or went silent")
            if queue and not self.workers and now - idle_since > self.config.no_worker_timeout_s:
                raise DispatchError(f"no worker connected to {self.endpoint} for "
                                    f"{self.config.no_worker_timeout_s:.0f} s with {len(queue)} rollouts waiting; "
                                    "start one with `lit worker --connect <endpoint> module:function`")
            if self.workers:
                idle_since = now
            self._assign(queue, running)
        return [outcomes[r.key] for r in requests]

    def _enqueue(self, queue: collections.deque[_Attempt], attempts: list[_Attempt]) -> None:
        self.store.add_rollouts(RolloutRow(a.rollout_id, a.request.task_id, a.request.step, a.number)
                                for a in attempts)
        queue.extend(attempts)

    def _assign(self, queue: collections.deque[_Attempt], running: dict[str, _Attempt]) -> None:
        """Hand queued attempts to workers with free slots, least busy first."""
        while queue:
            free = [w for w in self.workers.values() if len(w.running) < w.slots]
            if not free:
                return
            worker = min(free, key=lambda w: len(w.running) / w.slots)
            attempt = queue.popleft()
            attempt.worker = worker.identity
            attempt.deadline = time.monotonic() + self.config.rollout_timeout_s
            worker.running.add(attempt.rollout_id)
            running[attempt.rollout_id] = attempt
            self.store.set_rollout_status(attempt.rollout_id, RolloutStatus.RUNNING)
            r = attempt.request
            self._send(worker.identity, Run(attempt.rollout_id, r.task_id, attempt.number, r.task, r.llm.to_dict(),
                                            self.config.rollout_timeout_s))

    def _release(self, attempt: _Attempt) -> None:
        worker = self.workers.get(attempt.worker or b"")
        if worker is not None:
            worker.running.discard(attempt.rollout_id)

    def _drain(self, timeout_ms: int) -> list[tuple[ToTrainer, bytes]]:
        """Read every waiting message (waiting up to ``timeout_ms`` for the first); handle hellos and heartbeats
        here and return the rest with the sender's identity. A bad message is rejected and ignored."""
        out: list[tuple[ToTrainer, bytes]] = []
        wait = timeout_ms
        while self.sock.poll(wait):
            wait = 0
            parts = self.sock.recv_multipart()
            try:
                if len(parts) != 2:
                    raise ProtocolError("parts", f"a worker's message is one ZeroMQ frame, got {len(parts) - 1}")
                identity, data = parts
                message = decode_dispatch(data, accept=TO_TRAINER)
            except ProtocolError as exc:
                self._reject(exc)
                continue
            now = time.monotonic()
            if isinstance(message, Hello):
                label = f"{message.host}:{message.pid}"
                self.workers[identity] = _Worker(identity, message.slots, now, label=label)
                self._send(identity, Welcome(self.spans_endpoint, self.llm_base_urls))
                log.info("lit: worker %s connected (%d slots)", label, message.slots)
                continue
            worker = self.workers.get(identity)
            if worker is None:
                self._send(identity, Who())  # a worker of a previous trainer run: make it say hello
                continue
            worker.last_seen = now
            if isinstance(message, Done):
                out.append((message, identity))
        return out

    def _reject(self, exc: ProtocolError) -> None:
        n = self.rejected[exc.kind] = self.rejected.get(exc.kind, 0) + 1
        if n == 1:
            log.warning("lit: ignoring a bad message from a worker (%s): %s. Later ones of this kind are counted "
                        "in Dispatcher.rejected, not logged", exc.kind, exc)

    def _send(self, identity: bytes, message: ToWorker) -> None:
        try:
            self.sock.send_multipart([identity, encode_dispatch(message)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("lit: could not send to a worker: %s", exc)
