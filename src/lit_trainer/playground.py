"""Run an agent by hand, in this process, the way ``lit train``'s workers run it, and see what lit records.

    with lit_trainer.Playground(cfg) as pg:           # the store, the collector and vLLM; lit.instrument() on
        attempt = pg.run(calc_agent, task)            # one rollout: the agent's result, its spans, its episode
        attempt.episode.transitions[0].response_ids   # what training would use
        pg.show(attempt.rollout_id)                   # the rollout viewer

It starts what one rollout needs: a SQLite store, the collector on a loopback port, vLLM serving the config's model
and lit's gateway in front of it (which records every call of a rollout at the engine: streamed ones, the Responses
API, Anthropic's Messages, calls from programs), then instruments this process (``lit.instrument``) to send spans
there. The collector and vLLM have keys, as ``lit train`` makes them (``[security] keys_dir``, or the playground
folder's own ``keys``: ``services.with_keys``), so that no other user of the machine reaches them. ``run`` hands the
agent its rollout's own URL at the gateway, as a worker gets it, calls the agent exactly as a worker does
(``fn(task, llm)``, sync or async; from a notebook too, whose event loop is already running), waits until every span
and call of the rollout is stored, and rebuilds its episode.
Nothing is trained: ``lit_trainer.train`` starts its own services.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import secrets
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lit_sdk as lit
from lit_sdk.protocol import security
from lit_sdk.resources import LLM
from lit_trainer.config import TrainConfig
from lit_trainer.engine.server import InferenceServer
from lit_trainer.intake.collector import Collector
from lit_trainer.intake.episodes import Episode, UnusableRollout, build_episode
from lit_trainer.intake.gateway.server import Gateway
from lit_trainer.intake.rows import RolloutRow
from lit_trainer.intake.store import SqliteStore
from lit_trainer.results.runs import Run, RunFolder
from lit_trainer.run.services import with_keys

STORED_TIMEOUT_S = 30.0
"""How long ``run`` waits for the rollout's spans to be stored after the agent returned."""


@dataclass
class Attempt:
    """One rollout run by hand: what the agent returned (or raised), its spans and its episode."""

    rollout_id: str
    result: Any
    error: BaseException | None
    spans: list
    episode: Episode | UnusableRollout
    seconds: float

    @property
    def reward(self) -> float | None:
        return self.episode.episode_return if isinstance(self.episode, Episode) else None


class Playground:
    """vLLM and lit's intake for this process, with ``lit.instrument()`` pointed at them (module docstring)."""

    def __init__(self, cfg: TrainConfig, folder: str | Path | None = None):
        self.cfg = cfg
        self.folder = Path(folder or Path(cfg.train.output_dir) / "playground")
        self._stack = contextlib.ExitStack()
        self.store: SqliteStore | None = None
        self.server: InferenceServer | None = None
        self.gateway: Gateway | None = None
        self.collector: Collector | None = None

    def __enter__(self) -> Playground:
        run = RunFolder(self.folder)
        run.create("Playground folder")
        try:
            self._stack.enter_context(run.in_use("a Playground", "Playground folder"))
            run.save_config(self.cfg.to_dict())
            keys_dir, cfg = with_keys(self.cfg, run.keys)
            self.store = self._stack.enter_context(SqliteStore(run.store))
            collector = self.collector = self._stack.enter_context(
                Collector(self.store, "tcp://127.0.0.1:0", keys=security.load_server_keys(keys_dir)))
            print(f"lit: starting vLLM on {cfg.model} (about a minute on CPU)", file=sys.stderr, flush=True)
            # one server, with every core, whatever inference.servers a training config asks for
            self.server = self._stack.enter_context(InferenceServer(replace(cfg.inference, servers=1)))
            self.gateway = self._stack.enter_context(Gateway(self.store, [self.server.openai_url]))
            lit.instrument(endpoint=collector.endpoint, llm_base_urls=[self.server.openai_url, self.gateway.url],
                           spool_dir=run.spool, keys_dir=keys_dir)
            self._stack.callback(lit.uninstrument)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def llm(self, temperature: float | None = None) -> LLM:
        """What an agent gets as ``llm``: the served model's URL, name and key, and the sampling settings."""
        if self.server is None:
            raise RuntimeError("use the Playground in a with-block: `with Playground(cfg) as pg: ...`")
        return self.server.llm(self.cfg.agent.temperature if temperature is None else temperature,
                               self.cfg.agent.max_tokens)

    def run(self, agent: Callable[..., Any], task: dict[str, Any], temperature: float | None = None) -> Attempt:
        """One rollout of ``agent`` (an ``@lit.trace`` function ``fn(task, llm)``) on ``task``; raises nothing
        the agent raises (it is in ``Attempt.error``), only a failure of lit's (spans not stored in time)."""
        llm = self.llm(temperature)
        rollout_id, secret = f"playground-{uuid.uuid4().hex[:12]}", secrets.token_hex(16)
        assert self.store is not None and self.gateway is not None
        llm = replace(llm, base_url=self.gateway.rollout_url(llm.base_url, rollout_id, secret))
        # handed out as the dispatcher hands out an attempt: the collector stores only the spans of those
        self.store.add_rollouts([RolloutRow(rollout_id, str(task.get("id", "")), 0, secret=secret)])
        outcome: dict[str, Any] = {}

        def call() -> None:
            with lit.assign_rollout(rollout_id, str(task.get("id", "")), secret=secret):
                try:
                    value = agent(task, llm)
                    outcome["result"] = asyncio.run(value) if inspect.isawaitable(value) else value
                except BaseException as exc:  # the agent's own failure: reported, as a worker would
                    outcome["error"] = exc

        t0 = time.perf_counter()
        thread = threading.Thread(target=call, name="lit-playground-agent")  # a notebook's loop is running
        thread.start()
        thread.join()
        seconds = time.perf_counter() - t0
        self.gateway.settle(STORED_TIMEOUT_S)
        lit.flush(STORED_TIMEOUT_S)
        spans = self._wait_stored(rollout_id)
        agents = self.cfg.agent.agents or None
        return Attempt(rollout_id, outcome.get("result"), outcome.get("error"), spans,
                       build_episode(spans, agents), seconds)

    def _wait_stored(self, rollout_id: str) -> list:
        assert self.store is not None and self.collector is not None
        deadline = time.monotonic() + STORED_TIMEOUT_S
        while (missing := self.store.missing_spans(rollout_id)) is not None:
            self.collector.check()  # a collector that stopped (a full disk) says why, not a timeout
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout {rollout_id}: {missing} after {STORED_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        return self.store.spans_of_rollout(rollout_id)

    def show(self, rollout_id: str) -> Any:
        """The rollout viewer for one of this playground's rollouts (no advantages: nothing was trained)."""
        with Run(self.folder) as run:
            return run.show(rollout_id)
