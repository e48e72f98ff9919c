"""Agent workers: processes that take rollout assignments from the trainer and run the user's ``@lit.trace``
function on them, with ``lit.instrument()`` on.

    lit worker --connect tcp://trainer-host:7374 examples.calc.agent:calc_agent --processes 2 --concurrency 16
    lit worker --connect tcp://trainer-host:7374 --command "node examples/js_calc/agent.mjs"

An agent that is a program, in any language (``--command``), runs once per rollout as ``command_agent`` runs it:
the task on its stdin, the reward the last line of its stdout.

Each process holds one ZeroMQ DEALER socket to the trainer's dispatcher and runs up to ``concurrency`` rollouts at
once on an asyncio loop. It says hello on connect (and again when the trainer asks) with a ``worker_id`` that stays
the same when its socket reconnects, sends a heartbeat every ``heartbeat_s`` listing the rollouts it runs (so the
trainer learns at once of a ``Run`` or ``Done`` lost on the way), runs what it is sent and reports each rollout
done. The messages are the typed, versioned ones of ``lit_sdk/protocol/dispatch.py``, documented in
docs/protocol.md ("Dispatch"); a message that does not decode is logged and ignored.

A sync agent function runs in a pool of ``concurrency`` threads of its own, and its timeout starts when it starts,
not when it is queued. A Python thread cannot be killed: a sync call that times out is reported ``timed_out`` but
keeps its thread, so a new call waits for a free one and the process never runs more than ``concurrency`` agent
threads; the heartbeat lists the timed-out call until its thread ends, so the trainer counts its slot busy.

A rollout's status is ``succeeded`` when the function returned, ``failed`` when it raised and ``timed_out`` when it
ran past ``timeout_s``. Before reporting, the worker flushes the rollout's spans, so the trainer finds them stored;
a rollout that returned is reported ``failed`` instead when its spans were not all delivered within
``flush_timeout_s``, or when spans of this process were dropped or refused by the collector while it ran. The
reported reward is for display only: the trainer reads rewards from the spans.

Light like the rest of lit_sdk: no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import inspect
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import zmq
import zmq.asyncio

from lit_sdk import _context
from lit_sdk.command_agent import check_command, command_agent
from lit_sdk.instrument import flush, instrument
from lit_sdk.processes import TERMINATED, interrupts_held, sigterm_as_interrupt, start_child, stop_children
from lit_sdk.protocol import security
from lit_sdk.protocol.codec import ProtocolError
from lit_sdk.protocol.dispatch import (
    MAX_ERROR_CHARS,
    MAX_HOST_CHARS,
    MAX_LISTED,
    MAX_SLOTS,
    TO_WORKER,
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
from lit_sdk.resources import LLM
from lit_sdk.targets import load_agent

log = logging.getLogger("lit.worker")
DEFAULT_DISPATCH_ENDPOINT = "tcp://127.0.0.1:7374"
WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "")


AGENT_THREADS = "lit-agent"
"""The name prefix of the threads that run sync agent functions."""
NO_ANSWER_S = 10.0
"""A worker that no trainer has answered for this long says so (and again after twice as long, and so on)."""


def check_endpoint(endpoint: str) -> None:
    """ValueError naming the fix unless ``endpoint`` is a ZeroMQ address a worker can connect to: ``tcp://HOST:PORT``
    or ``ipc://PATH`` (what ``lit train`` prints as "workers connect to ...")."""
    parts = urlsplit(endpoint)
    try:
        port = parts.port
    except ValueError:
        port = None
    if (parts.scheme == "tcp" and parts.hostname and port) or (parts.scheme == "ipc" and len(endpoint) > 6):
        return
    why = "not an http:// URL" if parts.scheme in ("http", "https") else "with its host and port"
    raise ValueError(f"--connect {endpoint!r} is not the trainer's dispatch endpoint: give it as tcp://HOST:PORT "
                     "(lit train prints it at start: 'lit: workers connect to tcp://...'; the port is that of "
                     f"dispatch_endpoint.endpoint), {why}")


def reachable(address: str, trainer_host: str) -> str:
    """Another of the trainer's services (collector, vLLM) as seen from this worker: a wildcard or loopback host
    in ``address`` means "the trainer's machine", so it becomes the host this worker reached the trainer at."""
    parts = urlsplit(address)
    host = parts.hostname or ""
    if host not in WILDCARD_HOSTS and not security.is_loopback_host(host):
        return address
    target = "127.0.0.1" if security.is_loopback_host(trainer_host) else trainer_host
    netloc = f"{target}:{parts.port}" if parts.port else target
    return urlunsplit(parts._replace(netloc=netloc))


class Worker:
    """One worker process: ``asyncio.run(Worker(fn, connect).run())``."""

    def __init__(self, fn: Callable[..., Any], connect: str, concurrency: int = 8, heartbeat_s: float = 1.0,
                 flush_timeout_s: float = 30.0):
        if not 1 <= concurrency <= MAX_SLOTS:
            raise ValueError(f"concurrency must be between 1 and {MAX_SLOTS}, got {concurrency}")
        self.fn = fn
        self.connect = connect
        self.welcomed = False
        """Whether a trainer answered (its ``Welcome``)."""
        self.concurrency = concurrency
        self.heartbeat_s = heartbeat_s
        self.flush_timeout_s = flush_timeout_s
        """How long a rollout's spans may take to reach the collector before it is reported ``failed``."""
        self.trainer_host = urlsplit(connect).hostname or "127.0.0.1"
        self.worker_id = f"{socket.gethostname()[:64]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.running: dict[str, asyncio.Task] = {}
        """Rollouts from their ``Run`` until their ``Done`` is sent."""
        self.handed_back = 0
        """Rollouts this process was running when it was stopped by other than the trainer (Ctrl-C, SIGTERM, an
        error): its ``Bye`` tells the trainer, which runs them again at once rather than after this worker's
        silence."""
        self.terminated = False
        """Whether SIGTERM stopped it (``run`` then raises CancelledError)."""
        self.stuck: set[str] = set()
        """Timed-out sync calls whose thread has not ended: each holds a thread of the pool."""
        self.completed = 0
        self._lost = 0
        """Spans of this process dropped or refused by the collector, as of the last flush."""
        self._stop = asyncio.Event()
        self._instrumenting: asyncio.Future[Any] | None = None
        """``lit.instrument()`` for the trainer that welcomed this worker, in a thread: it imports the frameworks'
        instrumentors (about 3 s on a free core), and the loop goes on reading and sending heartbeats meanwhile, so
        that a busy machine does not make the trainer take the worker for dead. Rollouts start once it is done."""

    async def run(self) -> int:
        """Serve until the trainer says ``stop`` (or the process is interrupted); the number of rollouts run."""
        ctx = zmq.asyncio.Context()  # its own, terminated below: what is queued goes out before the process ends
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        monitor = security.guard_client(self.sock, self.connect, security.client_keys(), "lit worker")
        self.sock.connect(self.connect)
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix=AGENT_THREADS)
        await self._hello()
        next_beat = time.monotonic() + self.heartbeat_s
        waiting_since, said = time.monotonic(), 0
        self._stop_on_sigterm()
        reason = None
        try:
            while not self._stop.is_set():
                if await self.sock.poll(max(0, min(200, (next_beat - time.monotonic()) * 1000))):
                    await self._read_waiting()
                elif not self.welcomed and monitor and (refused := monitor.keys_refused()):
                    raise security.SecurityError(security.CLIENT_REFUSED.format(kind=refused))
                elif not self.welcomed and time.monotonic() - waiting_since >= NO_ANSWER_S * 2 ** said:
                    said += 1
                    log.warning("lit worker: no answer from a trainer at %s for %.0f s; is lit train running, "
                                "and is this its dispatch endpoint (it prints 'lit: workers connect to ...')? "
                                "Still trying", self.connect, time.monotonic() - waiting_since)
                if self._instrumenting is not None and self._instrumenting.done():
                    self._instrumenting.result()  # instrument() raised: the worker stops, loudly
                if time.monotonic() >= next_beat and not self._stop.is_set():
                    await self._heartbeat()
                    next_beat = time.monotonic() + self.heartbeat_s
        except asyncio.CancelledError:  # Ctrl-C (asyncio.run cancels on SIGINT), or SIGTERM
            reason = "SIGTERM" if self.terminated else "Ctrl-C"
            raise
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            running = len(self.running)
            for task in self.running.values():
                task.cancel()
            await asyncio.gather(*self.running.values(), return_exceptions=True)
            if reason is not None and self.welcomed:  # not the trainer's stop: it still counts on this process
                with contextlib.suppress(zmq.ZMQError):
                    await self.sock.send(encode_dispatch(Bye(reason[-MAX_ERROR_CHARS:])))
                    self.handed_back = running
            self._pool.shutdown(wait=False, cancel_futures=True)
            self.sock.close(linger=None if self.welcomed else 0)  # no trainer answered: nobody to wait for
            ctx.term()  # waits until what is still queued (a bye, the last Done) is sent, for up to LINGER (2 s)
        return self.completed

    def _stop_on_sigterm(self) -> None:
        """SIGTERM (``kill``, a container's stop, the trainer stopping its local workers) ends ``run`` as Ctrl-C
        does, through its clean-up; Python's default would end the process on the spot. Only in the main thread
        of a POSIX process (asyncio's signal handlers)."""
        main = asyncio.current_task()

        def terminate() -> None:
            self.terminated = True
            main.cancel()

        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, terminate)

    async def _hello(self) -> None:
        hello = Hello(self.concurrency, os.getpid(), socket.gethostname()[:MAX_HOST_CHARS], self.worker_id)
        await self.sock.send(encode_dispatch(hello))

    async def _read_waiting(self) -> None:
        """Read and handle every message waiting in the socket, in order."""
        while not self._stop.is_set():
            try:
                data = await self.sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = decode_dispatch(data, accept=TO_WORKER)
            except ProtocolError as exc:
                log.warning("lit worker: ignoring a bad message from the trainer (%s): %s", exc.kind, exc)
                continue
            await self._handle(message)

    async def _heartbeat(self) -> None:
        """List the rollouts this process runs, every ``Run`` that has reached its socket included: it reads them
        first. Sent from the loop that reads, never from a task of its own, so that a ``Run`` still waiting in the
        socket while agents keep the event loop busy is not reported missing (the trainer would take it for lost,
        retry it, and reject this run's ``Done``)."""
        await self._read_waiting()
        listed = sorted(self.running.keys() | self.stuck)[:MAX_LISTED]
        await self.sock.send(encode_dispatch(Heartbeat(len(listed), listed)))

    async def _handle(self, message: ToWorker) -> None:
        if isinstance(message, Welcome):
            self.welcomed = True
            spans = reachable(message.spans_endpoint, self.trainer_host)
            urls = [reachable(u, self.trainer_host) for u in message.llm_base_urls]
            self._instrumenting = asyncio.ensure_future(self._instrument(self._instrumenting, spans, urls))
        elif isinstance(message, Run):
            self.running[message.rollout_id] = asyncio.create_task(self._rollout(message))
        elif isinstance(message, Who):
            await self._hello()
        elif isinstance(message, Stop):
            self._stop.set()

    @staticmethod
    async def _instrument(before: asyncio.Future[Any] | None, spans: str, urls: list[str]) -> None:
        """``instrument()`` in a thread, after the one a previous ``Welcome`` started: the last trainer's wins."""
        if before is not None:
            await before
        await asyncio.to_thread(instrument, endpoint=spans, llm_base_urls=urls)

    async def _rollout(self, m: Run) -> None:
        lost_before = self._lost
        try:
            if self._instrumenting is not None:  # a Run follows its trainer's Welcome: its spans must be traced
                await asyncio.shield(self._instrumenting)
            status, reward, error = await self._run_agent(m)
            # The trainer reads the episode from the stored spans: deliver them before saying "done".
            undelivered = await self._flush(lost_before)
            if undelivered and status == "succeeded":
                status, reward, error = "failed", None, f"the agent returned, but {undelivered}"
            self.completed += 1
            await self.sock.send(encode_dispatch(Done(m.rollout_id, m.attempt, status, reward, error)))
        finally:
            self.running.pop(m.rollout_id, None)  # listed in heartbeats until its Done is sent

    async def _run_agent(self, m: Run) -> tuple[str, float | None, str | None]:
        """Call the agent function on the task: the rollout's status, reward and error."""
        llm = LLM.from_dict(m.llm)
        llm = LLM.from_dict({**llm.to_dict(), "base_url": reachable(llm.base_url, self.trainer_host)})
        try:
            with _context.assign(m.rollout_id, m.task_id, m.attempt, m.weight_version, m.secret):
                result = await self._call(m.rollout_id, m.task, llm, m.timeout_s)
        except TimeoutError:
            return "timed_out", None, f"the rollout ran past its timeout of {m.timeout_s:g} s"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the user's agent raised: report it, keep serving
            return "failed", None, "".join(traceback.format_exception_only(type(exc), exc)).strip()[-2000:]
        reward = float(result) if isinstance(result, (int, float)) and not isinstance(result, bool) else None
        return "succeeded", reward, None

    async def _flush(self, lost_before: int) -> str | None:
        """Wait until this process's spans are delivered; what went wrong, in words, or None."""
        counts = await asyncio.to_thread(flush, self.flush_timeout_s)
        if counts is None:  # not instrumented: no welcome yet
            return None
        lost = counts.dropped + counts.rejected
        self._lost = max(self._lost, lost)
        if lost > lost_before:
            return (f"spans of this process were dropped or refused by the collector while it ran "
                    f"({lost - lost_before} of them; see the worker's log)")
        if counts.timed_out:
            return (f"its spans were not all delivered within {self.flush_timeout_s:g} s (is the trainer's "
                    "collector reachable? the worker's flush_timeout_s sets the wait)")
        return None

    async def _call(self, rid: str, task: Any, llm: LLM, timeout_s: float) -> Any:
        if inspect.iscoroutinefunction(self.fn):
            return await asyncio.wait_for(self.fn(task, llm), timeout_s)
        loop = asyncio.get_running_loop()
        started = asyncio.Event()

        def call() -> Any:
            loop.call_soon_threadsafe(started.set)
            return self.fn(task, llm)

        thread = self._pool.submit(contextvars.copy_context().run, call)
        future = asyncio.wrap_future(thread)
        try:
            await started.wait()  # the timeout starts when the function does, not while it waits for a thread
            done, _ = await asyncio.wait({future}, timeout=timeout_s)
        finally:
            if not future.done() and not thread.cancel():  # running: a thread cannot be stopped
                self._hold_slot(rid, future)
        if not done:
            raise TimeoutError
        return future.result()

    def _hold_slot(self, rid: str, future: asyncio.Future) -> None:
        """Keep listing a timed-out sync call until its thread ends: it holds one of the pool's threads."""
        log.warning("lit worker: the sync agent call of rollout %s ran past its timeout; a thread cannot be "
                    "stopped, so it keeps one of the %d agent threads until it returns", rid, self.concurrency)
        self.stuck.add(rid)

        def release(f: asyncio.Future) -> None:
            self.stuck.discard(rid)
            if not f.cancelled():
                f.exception()  # already reported as the timeout: not "never retrieved"

        future.add_done_callback(release)


def spawn(target: str, connect: str, concurrency: int, env: dict[str, str] | None = None,
          die_with_parent: bool = True, *, command: str = "") -> subprocess.Popen:
    """Start one worker process (``python -m lit_sdk.worker``) in its own process group, running the agent function
    ``target`` (module:function) or else, with ``target`` empty, the program ``command`` (``--command``); on Linux
    it gets SIGTERM when the calling thread dies (``die_with_parent``). Stop it with
    ``lit_sdk.processes.stop_child``."""
    if bool(target) == bool(command):
        raise ValueError(f"spawn takes an agent function or a command, exactly one; got {target!r} and {command!r}")
    agent = [f"--command={command}"] if command else [target]  # with "=": a command may start with "-"
    cmd = [sys.executable, "-m", "lit_sdk.worker", "--connect", connect, "--concurrency", str(concurrency), *agent]
    return start_child(cmd, env=env, die_with_parent=die_with_parent)


def _past_stuck_calls(code: int) -> int:
    """``code``, once the agents' threads have ended; when a sync agent call never returns (Python cannot stop a
    thread, and joins every one of them at exit, so the process would never end), the process ends here with
    ``code``, without waiting for it."""
    deadline = time.monotonic() + 1.0
    busy = [t for t in threading.enumerate() if t.name.startswith(AGENT_THREADS) and t.is_alive()]
    for thread in busy:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t for t in busy if t.is_alive()]
    if not stuck:
        return code
    log.warning("lit worker: %d sync agent call(s) never returned; exiting without them", len(stuck))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _watch_children(children: list[subprocess.Popen], poll_s: float = 0.5) -> list[int]:
    """Wait for every child and return their exit codes; one that exits with an error is reported as it does (its
    own lines above say why), while the others go on serving the trainer."""
    codes: dict[int, int] = {}
    while len(codes) < len(children):
        for child in children:
            code = child.poll()
            if code is None or child.pid in codes:
                continue
            codes[child.pid] = code
            if code:
                left = len(children) - len(codes)
                print(f"lit worker: process {child.pid} exited with code {code} (its lines above say why); "
                      f"{left} of {len(children)} go on", file=sys.stderr, flush=True)
        time.sleep(poll_s)
    return [codes[child.pid] for child in children]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lit worker", description="Run agent rollouts for a lit trainer.")
    parser.add_argument("target", nargs="?", default="", help="the @lit.trace agent function, as module:function")
    parser.add_argument("--command", default="",
                        help='instead of a function, a program to run per rollout (e.g. "node agent.mjs"): the task '
                             "as a JSON line on its stdin, its reward the last line of its stdout")
    parser.add_argument("--connect", default=os.environ.get("LIT_DISPATCH", DEFAULT_DISPATCH_ENDPOINT),
                        help="the trainer's dispatch endpoint (default $LIT_DISPATCH or %(default)s)")
    parser.add_argument("--processes", type=int, default=1, help="worker processes on this host (default 1)")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent rollouts per process (default 8)")
    args = parser.parse_args(argv)
    # lit's own messages only: agent frameworks log every LLM call at INFO (AutoGen's event logger does).
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("lit").addHandler(handler)
    logging.getLogger("lit").setLevel(logging.INFO)
    if args.processes < 1 or not 1 <= args.concurrency <= MAX_SLOTS:
        parser.error(f"--processes must be at least 1 and --concurrency between 1 and {MAX_SLOTS}")
    if bool(args.target) == bool(args.command):
        parser.error("give the agent as module:function or as --command \"PROGRAM ARGS\", exactly one of them")
    try:
        check_endpoint(args.connect)
        # fail here, once, with a clear message
        agent = load_agent(args.target) if args.target else command_agent(check_command(args.command, "--command"))
        security.check_connect(args.connect, security.client_keys(), "lit worker")
    except ValueError as exc:  # SecurityError included
        print(f"lit worker: error: {exc}", file=sys.stderr)
        return 1
    if args.processes == 1:
        worker = Worker(agent, args.connect, args.concurrency)
        try:
            n = asyncio.run(worker.run())
        except security.SecurityError as exc:  # the trainer refused its keys: trying on never helps
            print(f"lit worker: error: {exc}", file=sys.stderr)
            return 1
        except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C; SIGTERM (Worker._stop_on_sigterm)
            back = (f"; the {worker.handed_back} it was running went back to the trainer, which runs them again"
                    if worker.handed_back else "")
            print(f"lit worker: stopped by {'SIGTERM' if worker.terminated else 'Ctrl-C'} after "
                  f"{worker.completed} rollouts{back}", file=sys.stderr)
            return _past_stuck_calls(128 + signal.SIGTERM if worker.terminated else 130)
        log.info("lit worker: stopped by the trainer after %d rollouts", n)
        return _past_stuck_calls(0)
    children: list[subprocess.Popen] = []
    try:
        with sigterm_as_interrupt():
            for _ in range(args.processes):
                with interrupts_held():  # an interrupt inside Popen would leave a child that nothing stops
                    children.append(spawn(args.target, args.connect, args.concurrency, command=args.command))
            codes = _watch_children(children)
    except KeyboardInterrupt as exc:  # the children have their own process groups: Ctrl-C reached only this one
        # SIGTERM to each: each says bye to the trainer (its rollouts are retried elsewhere at once) and ends
        stop_children(children, grace_s=10, name="lit worker processes")
        terminated = exc.args == (TERMINATED,)
        print(f"lit worker: stopped by {'SIGTERM' if terminated else 'Ctrl-C'}, and its {len(children)} processes "
              "with it", file=sys.stderr)
        return 128 + signal.SIGTERM if terminated else 130
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
