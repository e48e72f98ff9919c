"""The trainer's side of the agent workers: hands rollouts to whichever workers are connected, retries what
fails, and keeps every attempt's status in the store.

Workers (``lit_sdk/worker.py``) connect to one ZeroMQ ROUTER socket from any host; the messages are those of
``lit_sdk/protocol/dispatch.py`` (docs/protocol.md, "Dispatch"). One that does not decode, or a ``Done`` for a
rollout that is not running on the worker that sends it, is counted in ``Dispatcher.rejected``, logged once per kind
and ignored: nothing a peer sends stops the dispatcher (authenticating peers is the socket's business, not this
module's). Its connections are bounded as the collector's are (``intake/connections.py``): at most ``max_peers``,
fewer if the open-files limit leaves fewer beside the collector's, the oldest that has not said hello closed beyond
that, and one that has not finished its handshake within ``handshake_s`` closed by ZeroMQ. Unlike the collector's,
its socket has no ZeroMQ heartbeat (it is not read while the trainer updates, and libzmq drops a connection whose
queue is full when its heartbeat times out, with the messages behind): instead a worker silent for
``worker_timeout_s`` loses its place, its connection the first closed for the cap.
``run(requests)`` gives each requested rollout up to ``max_attempts`` attempts. An attempt is one rollout row in the
store (id ``<request>-a<attempt>``) that ends ``succeeded``, ``failed`` or ``timed_out`` (past
``rollout_timeout_s``); a failed or timed-out attempt is retried while attempts remain. A request whose attempts all
fail ends failed: it yields no episode, never a reward of 0. An attempt fails when the agent raised; when the worker
said it succeeded but the store finds spans of it missing (``missing_spans``); when its worker went silent for
``worker_timeout_s``; and, at once, when its worker's heartbeats stop listing it without a ``Done`` (the report was
lost, or the worker reconnected without it) or never list it (the ``Run`` was lost). A worker that reconnects (a new
ZeroMQ identity) and says hello with its ``worker_id`` keeps its running attempts.

The dispatcher runs only while the trainer waits for rollouts (in the trainer's thread, or in the thread of
asynchronous rollouts); messages that arrive meanwhile wait in the socket, so a worker's liveness is judged only
after they are read.

A group is the requests of one task in one step (``RolloutRequest.step`` and ``task_id``). With ``enough``, ``run``
may return before every request ended: it returns the groups that ended, and the others carry over, still queued or
running, into the next ``run``, which returns them with its own (``carried``); ``close`` gives up what is still
carried over.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from lit_sdk.protocol import security
from lit_sdk.protocol.codec import ProtocolError
from lit_sdk.protocol.dispatch import (
    TO_TRAINER,
    Bye,
    Done,
    Heartbeat,
    Hello,
    Run,
    Stop,
    ToWorker,
    Welcome,
    Who,
    decode_dispatch,
    encode_dispatch,
)
from lit_trainer.intake.connections import ConnectionLimit
from lit_trainer.intake.rows import RolloutRow, RolloutStatus, Store
from lit_trainer.rollouts.attempts import (
    UNCONFIRMED_BEATS,
    Attempt,
    Outcome,
    RolloutRequest,
    Round,
    WorkerState,
    ended_groups,
    group_of,
    pick_server,
)
from lit_trainer.settings import at_least, between, check

if TYPE_CHECKING:
    from lit_trainer.intake.gateway.server import Gateway

log = logging.getLogger("lit.dispatcher")
MAX_MESSAGE_BYTES = 1 << 20
"""What a worker may send in one message (hello, heartbeat, done: a few hundred bytes; a done's error is capped):
ZeroMQ cuts off anything larger before it is read (``zmq.MAXMSGSIZE``), dropping that peer's connection."""


class DispatchError(RuntimeError):
    """No worker is there to run rollouts, or the dispatch endpoint cannot be bound."""


_LONGEST_S = 365 * 86400.0
"""The longest timeout a setting may name: a year (NaN or infinity would never time out, or be refused by the
workers: a ``Run``'s timeout must be finite)."""


@dataclass(frozen=True)
class DispatchConfig:
    SECTION = "dispatch"
    RULES = {"max_attempts": at_least(1), "max_peers": at_least(1),
             "handshake_s": between(0.001, 86400, "(seconds: at least a millisecond, at most a day)"),
             **dict.fromkeys(("rollout_timeout_s", "worker_timeout_s", "no_worker_timeout_s"),
                             between(0, _LONGEST_S, "(seconds: at most a year)", low_open=True))}

    rollout_timeout_s: float = 300.0
    """An attempt running longer is ``timed_out`` (the worker cancels it too) and retried."""
    max_attempts: int = 2
    """Attempts per rollout before it is marked failed for good."""
    worker_timeout_s: float = 30.0
    """A worker silent this long (no heartbeat) is dead: its running attempts fail and are retried elsewhere."""
    no_worker_timeout_s: float = 300.0
    """How long ``run`` waits with rollouts to do and no worker connected before it gives up."""
    max_peers: int = 1024
    """Connections at once (one per worker process); fewer if the open-files limit leaves fewer beside the
    collector's. Beyond it the oldest connection that has not said hello (or whose worker went silent) is closed."""
    handshake_s: float = 10.0
    """A connection that has not finished its ZeroMQ handshake by then is closed (counted in ``refused_peers`` as
    ``handshake``)."""

    def __post_init__(self) -> None:
        check(self)  # handshake_s: ZeroMQ takes it in milliseconds, below 2**31


class Dispatcher:
    def __init__(self, store: Store, endpoint: str, spans_endpoint: str, llm_base_urls: Sequence[str],
                 config: DispatchConfig | None = None, keys: security.ServerKeys | None = None,
                 gateway: Gateway | None = None, open_to_local_users: bool = False,
                 serving: Callable[[], list[str]] | None = None):
        """``keys``: the trainer's CURVE keys (``security.load_server_keys``): only workers holding the client key
        get in, the others are refused at the handshake and counted (``refused_peers``). Without them the
        dispatcher binds to loopback addresses only, and only with ``open_to_local_users=True``: any user of this
        machine may then take its rollouts (``security.check_keyless``). Binding claims its share of the process's
        descriptors (``ConnectionLimit.claim``), so a collector started first keeps its own. ``gateway``: lit's
        gateway in front of the servers; each attempt's agent then calls the model through its own URL there
        (``Gateway.rollout_url``), where its calls are recorded. ``serving``: the base URLs of the servers that take
        rollouts now, among which a ``balanced`` request's group gets the least loaded (``pick_server``)."""
        security.check_keyless(keys, open_to_local_users, "Dispatcher", "who says hello gets tasks, rollout ids, "
                               "their secrets and vLLM's API key")
        self.store = store
        self.config = config or DispatchConfig()
        self.spans_endpoint = spans_endpoint
        self.gateway = gateway
        self.serving = serving
        self.llm_base_urls = list(llm_base_urls) + ([gateway.url] if gateway is not None else [])
        self.workers: dict[bytes, WorkerState] = {}
        self.rejected: dict[str, int] = {}
        """Messages from workers refused (malformed, wrong version, a stale ``Done``...), by ``ProtocolError.kind``."""
        self._round = Round()
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, int(self.config.handshake_s * 1000))
        bind = endpoint[:-2] + ":*" if endpoint.endswith(":0") else endpoint
        self._limit = ConnectionLimit.claim(self.config.max_peers, "the dispatcher")
        try:
            self._monitor = security.guard_server(self.sock, bind, keys, "the dispatcher",
                                                  "dispatch_endpoint.endpoint", watch=self._limit.on_event)
        except BaseException:
            self.sock.close()
            self._limit.release()
            raise
        try:
            self.sock.bind(bind)
        except zmq.ZMQError as exc:
            self.sock.close()
            self._limit.release()
            raise DispatchError(f"cannot listen for workers on {endpoint}: {exc} (is another trainer running? set "
                                "dispatch_endpoint.endpoint to a free port, or tcp://127.0.0.1:0 for any)") from None
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._limit.listen(self.endpoint)

    @property
    def refused_peers(self) -> dict[str, int]:
        """Peers refused at the handshake, by kind (``security.HandshakeMonitor``): with ``keys`` a wrong or missing
        key; with or without, ``handshake`` for one that did not finish it within ``handshake_s``."""
        return self._monitor.counts if self._monitor is not None else {}

    @property
    def connections(self) -> int:
        """Peer connections open now."""
        return self._limit.open

    @property
    def evicted(self) -> int:
        """Connections closed because ``max_peers`` were open (the oldest that had not said hello)."""
        return self._limit.evicted

    @property
    def carried(self) -> list[RolloutRequest]:
        """The requests an earlier ``run`` returned without (their group had not ended); the next ``run`` carries
        them on."""
        return list(self._round.requests)

    def close(self) -> None:
        """Give up the requests carried over (their attempts end ``failed`` in the store), tell every known worker
        to stop, then close the socket. Idempotent."""
        if self.sock.closed:
            return
        if self._round.requests:
            self._abandon(self._round, "the trainer stopped before it ended (its group was carried over to a "
                                       "step that did not come)")
            self._round = Round()
        for identity in list(self.workers):
            self._send(identity, Stop())
        self.sock.close()
        self._limit.release()

    def worker_pids(self) -> set[int]:
        """The process ids the connected workers gave in their hellos."""
        return {worker.pid for worker in self.workers.values()}

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait_for_workers(self, n: int, timeout_s: float, check: Callable[[], None] | None = None) -> None:
        """Block until ``n`` workers said hello (raises DispatchError after ``timeout_s``); ``check``, called about
        every 100 ms, may raise to stop the wait (a worker process that exited)."""
        deadline = time.monotonic() + timeout_s
        while len(self.workers) < n:
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise DispatchError(f"{len(self.workers)} of {n} workers connected to {self.endpoint} within "
                                    f"{timeout_s:.0f} s; check the worker processes' output")
            self._drain(100)

    def answer(self, seconds: float) -> None:
        """Read and answer what the workers send, for up to ``seconds`` (it returns once it handled some): their
        hellos get a welcome, so that they set up their tracing while the trainer waits for something else."""
        self._drain(int(seconds * 1000))

    def run(self, requests: Sequence[RolloutRequest], on_progress: Callable[[Outcome], None] | None = None,
            check: Callable[[], None] | None = None, enough: Callable[[int], bool] | None = None) -> list[Outcome]:
        """Run every request, and those ``carried`` over from the previous ``run``, to an end (success, or failure
        after ``max_attempts``); their outcomes, the carried ones first, each in request order. ``on_progress``
        hears of each request that ended; ``check`` is called about every 50 ms while rollouts run, and what it
        raises stops ``run`` (a service the rollouts need, such as the collector, has stopped). ``enough``, called
        as often with the number of groups that ended, lets ``run`` return once it says True: with the outcomes of
        the groups that ended; the other requests carry over."""
        round_ = self._round
        round_.on_progress = on_progress
        round_.requests += requests
        self._enqueue([Attempt(r, 1) for r in requests])
        idle_since = time.monotonic()
        try:
            while len(round_.outcomes) < len(round_.requests):
                if enough is not None and enough(len(ended_groups(round_))):
                    break
                if check is not None:
                    check()
                self._drain(50)
                now = time.monotonic()
                self._expire(now)
                if self.workers:
                    idle_since = now
                elif round_.queue and now - idle_since > self.config.no_worker_timeout_s:
                    raise DispatchError(f"no worker connected to {self.endpoint} for "
                                        f"{self.config.no_worker_timeout_s:.0f} s with {len(round_.queue)} rollouts "
                                        "waiting; start one with `lit worker --connect <endpoint> module:function`")
                self._assign()
        except BaseException as exc:
            self._abandon(round_, f"the trainer stopped waiting for it ({type(exc).__name__}: {exc})"[:2000])
            self._round = Round()
            for worker in self.workers.values():  # its attempts are given up
                worker.running.clear()
            raise
        ended = ended_groups(round_)
        returned = [r for r in round_.requests if group_of(r) in ended]
        round_.requests = [r for r in round_.requests if group_of(r) not in ended]
        outcomes = [round_.outcomes.pop(r.key) for r in returned]
        round_.on_progress = None
        if not round_.requests:
            self._round = Round()
        return outcomes

    def _abandon(self, round_: Round, reason: str) -> None:
        """``run`` is raising, or ``close`` gives up what was carried over: the attempts left queued or running end
        ``failed`` in the store with the reason, so that none stays "running" there for ever (a late ``done`` for
        one is counted as stale)."""
        for attempt in [*round_.running.values(), *round_.queue]:
            try:
                self.store.set_rollout_status(attempt.rollout_id, RolloutStatus.FAILED, reason)
            except Exception as exc:  # the store may be what failed: the original error is the one to raise
                log.warning("lit: could not mark rollout %s failed: %s", attempt.rollout_id, exc)

    def _finish(self, attempt: Attempt, status: RolloutStatus, error: str | None, reward: float | None = None) -> None:
        """End an attempt: record it, then retry it or give its request an outcome."""
        r = self._round
        r.running.pop(attempt.rollout_id, None)
        if attempt.worker is not None:
            attempt.worker.running.discard(attempt.rollout_id)
        self.store.set_rollout_status(attempt.rollout_id, status, error)
        if self.gateway is not None:
            self.gateway.end(attempt.rollout_id)  # a straggler of a timed-out attempt calls the model no more
        key = attempt.request.key
        if error:
            r.errors[key].append(f"attempt {attempt.number}: {error}")
        if status is RolloutStatus.SUCCEEDED or attempt.number >= self.config.max_attempts:
            r.outcomes[key] = Outcome(attempt.request, status, attempt.rollout_id, attempt.number, reward,
                                      r.errors.pop(key, []))
            if r.on_progress:
                r.on_progress(r.outcomes[key])
        else:
            log.info("lit: rollout %s %s (%s); retrying", attempt.rollout_id, status.value, error)
            self._enqueue([Attempt(attempt.request, attempt.number + 1)])

    def _expire(self, now: float) -> None:
        """Time out attempts past their deadline; fail those of workers silent for ``worker_timeout_s``."""
        for attempt in [a for a in self._round.running.values() if now > a.deadline]:
            self._finish(attempt, RolloutStatus.TIMED_OUT,
                         f"no result within rollout_timeout_s={self.config.rollout_timeout_s:g} s")
        for identity, worker in list(self.workers.items()):
            if now - worker.last_seen > self.config.worker_timeout_s:
                log.warning("lit: worker %s went silent for %.0f s; its %d rollouts will be retried",
                            worker.label, now - worker.last_seen, len(worker.running))
                del self.workers[identity]
                self._limit.doubt(worker.fd)  # a peer that said hello and went silent does not hold a place
                for attempt in self._attempts_of(worker):
                    self._finish(attempt, RolloutStatus.FAILED, f"worker {worker.label} died or went silent")

    def _on_bye(self, worker: WorkerState, bye: Bye) -> None:
        """A worker leaves (Ctrl-C, SIGTERM, its own error): its attempts fail now and are retried elsewhere, not
        after ``worker_timeout_s`` of silence, and it gets no more."""
        log.warning("lit: worker %s stopped (%s); its %d rollouts will be retried", worker.label, bye.reason,
                    len(worker.running))
        del self.workers[worker.identity]
        self._limit.doubt(worker.fd)  # its connection goes next: it holds no place
        for attempt in self._attempts_of(worker):
            self._finish(attempt, RolloutStatus.FAILED, f"worker {worker.label} stopped before it ended "
                                                        f"({bye.reason})")

    def _attempts_of(self, worker: WorkerState) -> list[Attempt]:
        """The attempts of this round running on ``worker`` (forgetting those of a round that ended)."""
        worker.running &= self._round.running.keys()
        return [self._round.running[rid] for rid in sorted(worker.running)]

    def _enqueue(self, attempts: list[Attempt]) -> None:
        self.store.add_rollouts(RolloutRow(a.rollout_id, a.request.task_id, a.request.step, a.number,
                                           secret=a.secret) for a in attempts)
        self._round.queue.extend(attempts)

    def _assign(self) -> None:
        """Hand queued attempts to workers with free slots, least busy first."""
        queue = self._round.queue
        load: tuple[list[str], collections.Counter[str]] | None = None  # once per call, kept up to date below
        while queue:
            free = [w for w in self.workers.values() if w.busy < w.slots]
            if not free:
                return
            worker = min(free, key=lambda w: w.busy / w.slots)
            attempt = queue.popleft()
            attempt.worker = worker
            attempt.deadline = time.monotonic() + self.config.rollout_timeout_s
            worker.running.add(attempt.rollout_id)
            self._round.running[attempt.rollout_id] = attempt
            self.store.set_rollout_status(attempt.rollout_id, RolloutStatus.RUNNING)
            r = attempt.request
            attempt.server = r.llm.base_url
            if r.balanced and self.serving is not None:  # its group's server (pick_server)
                serving, running = load = load or self._load()
                attempt.server = pick_server(group_of(r), serving, self._round.servers, running)
                running[attempt.server] += 1
            llm = {**r.llm.to_dict(), "base_url": attempt.server}
            if self.gateway is not None:
                llm["base_url"] = self.gateway.rollout_url(attempt.server, attempt.rollout_id, attempt.secret)
            self._send(worker.identity, Run(attempt.rollout_id, r.task_id, attempt.number, r.task, llm,
                                            self.config.rollout_timeout_s, secret=attempt.secret))

    def _load(self) -> tuple[list[str], collections.Counter[str]]:
        """The servers that take rollouts now (``serving``) and how many attempts run on each."""
        assert self.serving is not None
        serving = self.serving()
        if not serving:
            raise DispatchError("no vLLM server takes rollouts: every one was dropped")
        return serving, collections.Counter(a.server for a in self._round.running.values())

    def _drain(self, timeout_ms: int) -> None:
        """Read and handle every waiting message, in order (waiting up to ``timeout_ms`` for the first). A bad
        message is rejected and ignored; one from an unknown worker is answered with ``Who``."""
        wait = timeout_ms
        while self.sock.poll(wait):
            wait = 0
            parts = self.sock.recv_multipart(copy=False)
            try:
                if len(parts) != 2:
                    raise ProtocolError("parts", f"a worker's message is one ZeroMQ frame, got {len(parts) - 1}")
                identity, data = parts[0].bytes, parts[1].bytes
                message = decode_dispatch(data, accept=TO_TRAINER)
            except ProtocolError as exc:
                self._reject(exc)
                continue
            fd = parts[1].get(zmq.SRCFD)
            if isinstance(message, Hello):
                self._limit.vouch(fd)
                self._on_hello(identity, message, fd)
                continue
            worker = self.workers.get(identity)
            if worker is None:
                self._send(identity, Who())  # a worker of a previous trainer run: make it say hello
                continue
            self._limit.vouch(fd)
            worker.last_seen = time.monotonic()
            if isinstance(message, Done):
                self._on_done(worker, message)
            elif isinstance(message, Heartbeat):
                self._on_heartbeat(worker, message)
            elif isinstance(message, Bye):
                self._on_bye(worker, message)

    def _on_hello(self, identity: bytes, hello: Hello, fd: int) -> None:
        """Welcome a worker: a new one, or a known one (by ``worker_id``) back on a new connection."""
        label = f"{hello.host}:{hello.pid}"
        worker = self.workers.get(identity)
        if worker is None and hello.worker_id is not None:
            worker = next((w for w in self.workers.values() if w.worker_id == hello.worker_id), None)
            if worker is not None:
                del self.workers[worker.identity]
                log.info("lit: worker %s reconnected; its %d rollouts go on", label, len(worker.running))
        if worker is None:
            worker = WorkerState(identity, hello.slots, 0.0)
            log.info("lit: worker %s connected (%d slots)", label, hello.slots)
        worker.identity, worker.slots, worker.label, worker.worker_id = identity, hello.slots, label, hello.worker_id
        worker.pid = hello.pid
        worker.fd = fd
        worker.last_seen = time.monotonic()
        self.workers[identity] = worker
        self._send(identity, Welcome(self.spans_endpoint, self.llm_base_urls))

    def _on_done(self, worker: WorkerState, done: Done) -> None:
        attempt = self._round.running.get(done.rollout_id)
        if attempt is None or attempt.worker is not worker or attempt.number != done.attempt:
            self._reject(ProtocolError("stale", f"worker {worker.label} reported rollout {done.rollout_id!r} done, "
                                                "which is not running there (a late report of an attempt given up "
                                                "on, or a confused worker)"))
            return
        if worker.listed:
            worker.listed.discard(done.rollout_id)
        status, error, reward = RolloutStatus(done.status), done.error, done.reward
        missing = self._missing_spans(done.rollout_id) if status is RolloutStatus.SUCCEEDED else None
        if missing:
            status, error, reward = RolloutStatus.FAILED, f"the worker reported success, but {missing}", None
        self._finish(attempt, status, error, reward)

    def _missing_spans(self, rollout_id: str) -> str | None:
        """Why the store lacks spans of this rollout, or None when it has them all (or cannot tell)."""
        check = getattr(self.store, "missing_spans", None)  # a store without the check trusts the worker
        return check(rollout_id) if check is not None else None

    def _on_heartbeat(self, worker: WorkerState, beat: Heartbeat) -> None:
        """Fail at once the attempts the worker no longer runs, or never received (a lost ``Run``)."""
        if beat.rollouts is None:
            return
        worker.listed = set(beat.rollouts)
        for attempt in self._attempts_of(worker):
            if attempt.rollout_id in worker.listed:
                attempt.confirmed = True
                continue
            attempt.unlisted += 1
            if attempt.confirmed:
                self._finish(attempt, RolloutStatus.FAILED, f"worker {worker.label} no longer runs it and sent no "
                                                            "result (lost on the way, or the worker reconnected)")
            elif attempt.unlisted >= UNCONFIRMED_BEATS:
                self._finish(attempt, RolloutStatus.FAILED, f"worker {worker.label} never started it "
                                                            f"({UNCONFIRMED_BEATS} heartbeats did not list it: the "
                                                            "run message was lost)")

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
