"""The services a run starts together and stops together: the store and the collector (intake), the vLLM fleet
(engine), the dispatcher and the local agent workers (rollouts), and the ``RolloutRunner`` that uses them. The
collector runs in a thread of its own; the runner checks it while it waits for rollouts."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import zmq

from lit_sdk.command_agent import check_command
from lit_sdk.processes import interrupts_held, stop_children, wait_children
from lit_sdk.protocol import security
from lit_sdk.targets import load_agent
from lit_sdk.worker import spawn
from lit_trainer.config import ConfigError, TrainConfig
from lit_trainer.engine.fleet import Fleet, Weights
from lit_trainer.engine.launch import InferenceError, pick_port, server_ports
from lit_trainer.intake.collector import Collector
from lit_trainer.intake.gateway.server import Gateway
from lit_trainer.intake.store import SqliteStore
from lit_trainer.models.folders import vocab_size
from lit_trainer.rollouts.dispatcher import Dispatcher, DispatchError
from lit_trainer.rollouts.runner import RolloutRunner

WORKER_START_TIMEOUT_S = 180.0
WORKER_STOP_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Services:
    """What a run has running: the store, the collector, the vLLM fleet, the dispatcher (with the local workers
    connected), and the runner that runs rollouts on them."""

    store: SqliteStore
    collector: Collector
    fleet: Fleet
    dispatcher: Dispatcher
    runner: RolloutRunner


def check_agent(cfg: TrainConfig) -> None:
    """ConfigError or ValueError, naming the fix, unless ``[agent] function`` names an importable ``@lit.trace``
    function that takes ``(task, llm)`` (``lit_sdk.targets.load_agent``), or ``[agent] command`` a program that
    can be found (``lit_sdk.command_agent.check_command``): checked before any model or server starts."""
    if cfg.agent.command:
        check_command(cfg.agent.command, "agent.command")
        return
    if not cfg.agent.function:
        raise ConfigError(f"{cfg.source or 'config'}: [agent] function is not set (module:function; or command, "
                          "a program to run per rollout)")
    load_agent(cfg.agent.function)


def check_ports(cfg: TrainConfig) -> None:
    """ConfigError naming the setting when an address the run will listen on cannot be bound now: the collector's
    and the dispatcher's endpoints (bound together: two spellings of one address show too) and vLLM's ports when
    ``inference.port`` fixes them; found in seconds, before the model loads, not after it. Port 0 (a free one,
    the default) always binds. Another process may still take an address before the run binds it: that bind
    fails with the same words."""
    with contextlib.ExitStack() as stack:
        for setting, endpoint in (("collector.endpoint", cfg.collector.endpoint),
                                  ("dispatch_endpoint.endpoint", cfg.dispatch_endpoint.endpoint)):
            sock = zmq.Context.instance().socket(zmq.ROUTER)
            sock.linger = 0
            stack.callback(sock.close)
            try:
                sock.bind(endpoint)
            except zmq.ZMQError as exc:
                busy = (": another process listens there (another lit train?)" if exc.errno == errno.EADDRINUSE
                        else f": {exc}")
                raise ConfigError(f"the run cannot listen on {endpoint} ({setting}){busy}. Stop it, or choose "
                                  "another port (tcp://127.0.0.1:0 picks a free one)") from None
        if cfg.inference.port:
            for port in server_ports(cfg.inference):
                try:
                    pick_port(replace(cfg.inference, port=port))
                except InferenceError as exc:
                    raise ConfigError(str(exc)) from None


def with_keys(cfg: TrainConfig, run_keys: Path) -> tuple[Path, TrainConfig]:
    """The keys folder a run's channels use, and ``cfg`` with vLLM's API key from it: ``[security] keys_dir``, or
    else the run's own folder ``run_keys`` (made 0700 on first use, kept for a resumed run). So the span and
    dispatch channels always take CURVE peers holding the client key only, and vLLM a bearer token: a user who
    cannot read the run folder gets no task, no rollout id and no API key, on a shared host's loopback too. vLLM
    keeps ``inference.api_key`` or ``api_key_file`` when one is set."""
    if cfg.security.keys_dir:
        return Path(cfg.security.keys_dir).expanduser(), cfg
    if not (run_keys / security.SERVER_SECRET).exists():
        security.generate_keys(run_keys)
    if cfg.inference.api_key or cfg.inference.api_key_file:
        return run_keys, cfg
    return run_keys, replace(cfg, inference=replace(cfg.inference, api_key_file=str(run_keys / security.API_KEY)))


@contextlib.contextmanager
def services(cfg: TrainConfig, store_path: Path, spool_dir: Path, keys_dir: Path, weights: Weights | None = None,
             teachers: Sequence[tuple[str, str]] = (), version: str = "0") -> Iterator[Services]:
    """Start everything rollouts need, and stop it all (workers, dispatcher, vLLM, collector, store) on the way
    out. ``weights``: what gives the policy's current weights when the fleet takes them (training), ``version``
    theirs (a resumed run's step); None: the fleet only serves (``lit eval``). Local workers spool undelivered
    spans into ``spool_dir``. The channels' keys: ``[security] keys_dir``, or the run's own in ``keys_dir``
    (``with_keys``). The caller has checked the agent (``check_agent``: ``preflight``, ``evaluate``).
    ``teachers``: the endpoints lit's gateway also serves rollouts from (``rollouts.teacher.Teacher.upstream``),
    for ``rollouts.teacher.collect``."""
    folder, cfg = with_keys(cfg, keys_dir)
    keys = security.load_server_keys(folder)
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(SqliteStore(store_path))
        stale = store.end_unfinished("the trainer stopped before this attempt ended")
        if stale:
            print(f"lit: {stale} rollout attempt(s) a stopped run left queued or running are marked failed",
                  file=sys.stderr)
        collector = stack.enter_context(Collector(store, cfg.collector.endpoint, keys=keys))
        fleet = Fleet(cfg.inference, cfg.weight_sync, weights, keys_dir=cfg.security.keys_dir, version=version)
        stack.callback(fleet.stop)
        fleet.launch()  # vLLM loads while the workers start: their URLs are known now (the remote ones' too)
        servers = [s.openai_url for s in fleet.servers]
        roles = cfg.role_table
        gateway = stack.enter_context(Gateway(store, servers, cfg.inference.host, teachers=teachers,
                                              routes=roles.routes() if roles else None,
                                              base_model=cfg.inference.served_model_name))
        dispatcher = stack.enter_context(Dispatcher(store, cfg.dispatch_endpoint.endpoint, collector.endpoint,
                                                    servers, cfg.dispatch, keys=keys, gateway=gateway,
                                                    serving=lambda: [s.openai_url for s in fleet.serving]))
        env = {**os.environ, "LIT_SPOOL_DIR": str(spool_dir), security.KEYS_ENV: str(folder)}
        workers: list = []
        stack.callback(stop_workers, dispatcher, workers)
        for _ in range(cfg.agent.local_workers):
            with interrupts_held():  # a Ctrl-C or SIGTERM inside Popen would leave a worker nothing stops
                workers.append(spawn(cfg.agent.function, dispatcher.endpoint, cfg.agent.concurrency, env,
                                     command=cfg.agent.command))
        print(f"lit: workers connect to {dispatcher.endpoint} ({len(workers)} local) with the keys in {folder} "
              f"({security.KEYS_ENV}={folder} lit worker ...)", file=sys.stderr)

        def watch() -> None:
            check_local_workers(workers)

        def meanwhile(seconds: float) -> None:  # the workers are welcomed and set up their tracing while vLLM loads
            watch()
            dispatcher.answer(seconds)

        fleet.wait_ready(meanwhile=meanwhile)
        dispatcher.wait_for_workers(cfg.agent.local_workers, WORKER_START_TIMEOUT_S, check=watch)
        runner = RolloutRunner(store, collector, fleet, dispatcher, cfg.agent, cfg.train.success_reward,
                               session=uuid.uuid4().hex[:8], vocab_size=vocab_size(cfg.inference.model),
                               context=cfg.inference.max_model_len, watch=watch)
        yield Services(store, collector, fleet, dispatcher, runner)


def check_local_workers(workers: list[subprocess.Popen]) -> None:
    """Raise DispatchError when a local agent worker process has exited: none does before the run stops it, so its
    agent's import failed, it was killed (out of memory?) or it crashed. Its own lines, above on the same
    terminal, say why; without this the run waited out the workers' start (180 s) or their silence."""
    for worker in workers:
        code = worker.poll()
        if code is None:
            continue
        how = f"exited with code {code}"
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            how = f"was killed by {name}" + (" (out of memory? the kernel's log says: dmesg | grep -i oom)"
                                             if code == -signal.SIGKILL else "")
        raise DispatchError(f"a local agent worker (pid {worker.pid}) {how}; its own lines above say why. "
                            "The run stops: its rollouts would wait for it")


def stop_workers(dispatcher: Dispatcher, workers: list) -> None:
    """Ask every worker to stop (they deliver their last spans), give those that said hello 15 s, then end the
    local ones that do not (and whatever their agents left running in their process groups). A local worker that
    never said hello (a run stopped while it started) holds no rollout: it is ended at once."""
    greeted = dispatcher.worker_pids()
    dispatcher.close()
    wait_children([worker for worker in workers if worker.pid in greeted], WORKER_STOP_TIMEOUT_S)
    stop_children(workers, grace_s=5, name="agent workers")
