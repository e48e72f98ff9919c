"""Agent workers: processes that take rollout assignments from the trainer and run the user's ``@lit.trace``
function on them, with ``lit.instrument()`` on.

    lit worker --connect tcp://trainer-host:7374 examples.calc.agent:calc_agent --processes 2 --concurrency 16

Each process holds one ZeroMQ DEALER socket to the trainer's dispatcher and runs up to ``concurrency`` rollouts at
once on an asyncio loop (a sync agent function runs in a thread). It says hello on connect (and again when the
trainer asks), sends a heartbeat every ``heartbeat_s``, runs what it is sent and reports each rollout done. The
messages are the typed, versioned ones of ``lit_sdk/protocol/dispatch.py``, documented in docs/protocol.md
("Dispatch"); a message that does not decode is logged and ignored.

A rollout's status is ``succeeded`` when the function returned, ``failed`` when it raised and ``timed_out`` when it
ran past ``timeout_s``. Before reporting, the worker flushes the rollout's spans, so the trainer finds them stored.
The reported reward is for display only: the trainer reads rewards from the spans.

Light like the rest of lit_sdk: no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import inspect
import logging
import os
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import zmq
import zmq.asyncio

from lit_sdk import _context
from lit_sdk.instrument import flush, instrument
from lit_sdk.processes import start_child, stop_children
from lit_sdk.protocol.codec import ProtocolError
from lit_sdk.protocol.dispatch import (
    TO_WORKER,
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

log = logging.getLogger("lit.worker")
DEFAULT_DISPATCH_ENDPOINT = "tcp://127.0.0.1:7374"
WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def load_target(target: str) -> Callable[..., Any]:
    """``module:function`` → the function; the current directory is importable, as with ``python -m``."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"the agent must be given as module:function (e.g. examples.calc.agent:calc_agent), "
                         f"got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import the agent module {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{module_name!r} has no function {attr!r}")
    return fn


def reachable(address: str, trainer_host: str) -> str:
    """Another of the trainer's services (collector, vLLM) as seen from this worker: a wildcard or loopback host
    in ``address`` means "the trainer's machine", so it becomes the host this worker reached the trainer at."""
    parts = urlsplit(address)
    host = parts.hostname or ""
    if host not in WILDCARD_HOSTS + LOOPBACK_HOSTS:
        return address
    target = "127.0.0.1" if trainer_host in LOOPBACK_HOSTS else trainer_host
    netloc = f"{target}:{parts.port}" if parts.port else target
    return urlunsplit(parts._replace(netloc=netloc))


class Worker:
    """One worker process: ``asyncio.run(Worker(fn, connect).run())``."""

    def __init__(self, fn: Callable[..., Any], connect: str, concurrency: int = 8, heartbeat_s: float = 1.0):
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.fn = fn
        self.connect = connect
        self.concurrency = concurrency
        self.heartbeat_s = heartbeat_s
        self.trainer_host = urlsplit(connect).hostname or "127.0.0.1"
        self.running: dict[str, asyncio.Task] = {}
        self.completed = 0
        self._stop = asyncio.Event()

    async def run(self) -> int:
        """Serve until the trainer says ``stop`` (or the process is interrupted); the number of rollouts run."""
        ctx = zmq.asyncio.Context.instance()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(self.connect)
        await self._hello()
        beat = asyncio.create_task(self._heartbeat())
        try:
            while not self._stop.is_set():
                if not await self.sock.poll(200):
                    continue
                try:
                    message = decode_dispatch(await self.sock.recv(), accept=TO_WORKER)
                except ProtocolError as exc:
                    log.warning("lit worker: ignoring a bad message from the trainer (%s): %s", exc.kind, exc)
                    continue
                await self._handle(message)
        finally:
            beat.cancel()
            for task in self.running.values():
                task.cancel()
            await asyncio.gather(*self.running.values(), return_exceptions=True)
            self.sock.close()
        return self.completed

    async def _hello(self) -> None:
        await self.sock.send(encode_dispatch(Hello(self.concurrency, os.getpid(), socket.gethostname())))

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            await self.sock.send(encode_dispatch(Heartbeat(len(self.running))))

    async def _handle(self, message: ToWorker) -> None:
        if isinstance(message, Welcome):
            spans = reachable(message.spans_endpoint, self.trainer_host)
            urls = [reachable(u, self.trainer_host) for u in message.llm_base_urls]
            instrument(endpoint=spans, llm_base_urls=urls)
        elif isinstance(message, Run):
            self.running[message.rollout_id] = asyncio.create_task(self._rollout(message))
        elif isinstance(message, Who):
            await self._hello()
        elif isinstance(message, Stop):
            self._stop.set()

    async def _rollout(self, m: Run) -> None:
        rid, attempt = m.rollout_id, m.attempt
        llm = LLM.from_dict(m.llm)
        llm = LLM.from_dict({**llm.to_dict(), "base_url": reachable(llm.base_url, self.trainer_host)})
        status, reward, error = "succeeded", None, None
        try:
            with _context.assign(rid, m.task_id, attempt, m.weight_version):
                result = await asyncio.wait_for(self._call(m.task, llm), timeout=m.timeout_s)
            if isinstance(result, (int, float)) and not isinstance(result, bool):
                reward = float(result)
        except TimeoutError:
            status, error = "timed_out", f"the rollout ran past its timeout of {m.timeout_s:g} s"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the user's agent raised: report it, keep serving
            status = "failed"
            error = "".join(traceback.format_exception_only(type(exc), exc)).strip()[-2000:]
        finally:
            self.running.pop(rid, None)
        # The trainer reads the episode from the stored spans: deliver them before saying "done".
        await asyncio.to_thread(flush, 30.0)
        self.completed += 1
        await self.sock.send(encode_dispatch(Done(rid, attempt, status, reward, error)))

    async def _call(self, task: Any, llm: LLM) -> Any:
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(task, llm)
        return await asyncio.to_thread(self.fn, task, llm)


def serve(target: str, connect: str, concurrency: int) -> int:
    """Run one worker process until the trainer stops it."""
    fn = load_target(target)
    return asyncio.run(Worker(fn, connect, concurrency).run())


def spawn(target: str, connect: str, concurrency: int, env: dict[str, str] | None = None,
          die_with_parent: bool = True) -> subprocess.Popen:
    """Start one worker process (``python -m lit_sdk.worker``) in its own process group; on Linux it gets SIGTERM
    when the calling thread dies (``die_with_parent``). Stop it with ``lit_sdk.processes.stop_child``."""
    cmd = [sys.executable, "-m", "lit_sdk.worker", "--connect", connect, "--concurrency", str(concurrency), target]
    return start_child(cmd, env=env, die_with_parent=die_with_parent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lit worker", description="Run agent rollouts for a lit trainer.")
    parser.add_argument("target", help="the @lit.trace agent function, as module:function")
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
    if args.processes < 1 or args.concurrency < 1:
        parser.error("--processes and --concurrency must be at least 1")
    try:
        load_target(args.target)  # fail here, once, with a clear message
    except ValueError as exc:
        print(f"lit worker: error: {exc}", file=sys.stderr)
        return 1
    if args.processes == 1:
        with contextlib.suppress(KeyboardInterrupt):
            n = serve(args.target, args.connect, args.concurrency)
            log.info("lit worker: stopped by the trainer after %d rollouts", n)
        return 0
    children = [spawn(args.target, args.connect, args.concurrency) for _ in range(args.processes)]
    try:
        codes = [child.wait() for child in children]
    except KeyboardInterrupt:  # the children have their own process groups: Ctrl-C reached only this one
        stop_children(children, grace_s=10, name="lit worker processes")
        return 130
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
