"""Run groups of rollouts on the agent workers and turn them into episodes: what one training step or one
validation asks of the rollouts.

``RolloutRunner.run`` hands ``group`` rollouts of each task to the workers (``Dispatcher``), every rollout of one
task to the same vLLM server, whose prefix cache then holds the task's prompt for the whole group, the least loaded
when the group's first rollout is handed out (``attempts.pick_server``);
it shows a progress bar, checks meanwhile that the collector and every server still run, and returns a
``RolloutBatch``: the episodes of the rollouts that succeeded, the rollout metrics, and the weight version the
engine held when the oldest of them was handed out. A failed rollout gives no episode, never a reward of 0, and
neither does one whose spans are not all stored. If a vLLM server dies meanwhile, it is started again with the
current weights and the rollouts run again (what was in flight is given up, groups carried over too, and nothing
of it is trained on), up to ``restarts`` times.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from lit_sdk.resources import LLM
from lit_trainer.engine.fleet import Fleet, first_line
from lit_trainer.engine.server import ServerDiedError
from lit_trainer.intake.collector import Collector
from lit_trainer.intake.episodes import Episode
from lit_trainer.intake.rows import RolloutStatus, Store
from lit_trainer.progress import progress_bar
from lit_trainer.rollouts.attempts import Outcome, RolloutRequest, group_of
from lit_trainer.rollouts.dispatcher import Dispatcher
from lit_trainer.rollouts.gather import gather_episodes
from lit_trainer.settings import at_least, check


@dataclass(frozen=True)
class AgentConfig:
    SECTION = "agent"
    RULES = {"local_workers": at_least(0, "(0: only workers started with `lit worker`)"),
             "concurrency": at_least(1, "(rollouts at once per worker)"), "temperature": at_least(0, "(0: greedy)"),
             "val_temperature": at_least(0, "(0: greedy)"), "max_tokens": at_least(1)}

    function: str = ""
    """The ``@lit.trace`` agent function as ``module:function``; it is called as ``fn(task, llm)``."""
    command: str = ""
    """Instead of ``function``, the program to run per rollout, in any language (``"node agent.mjs"``, from the folder
    the workers run in): the task as one JSON line on its stdin, the LLM endpoint in ``OPENAI_BASE_URL`` and the
    other variables of ``lit_sdk.command_agent.ENV``, its reward the last line of its stdout (a number or
    ``{"reward": <number>}``). Started by ``lit_sdk.command_agent``."""
    agents: tuple[str, ...] = ()
    """Names of the agents whose LLM calls are trained; empty: every agent."""
    local_workers: int = 1
    """Worker processes the trainer starts on this machine (0: only workers started with ``lit worker``)."""
    concurrency: int = 16
    """Concurrent rollouts per local worker process."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts."""
    val_temperature: float = 0.0
    """Sampling temperature of validation (0: greedy)."""
    max_tokens: int = 128
    """Most tokens per LLM call."""

    def __post_init__(self) -> None:
        if self.function and self.command:
            raise ValueError("agent.function and agent.command are both set: give one (agent.function: a @lit.trace "
                             "function as module:function; agent.command: a program to run per rollout)")
        check(self)


class RolloutsFailed(RuntimeError):
    """No rollout of a training step gave an episode (every one failed, or none had anything to train on):
    nothing can train, and the next step would fail the same way."""


@dataclass(frozen=True)
class RolloutBatch:
    """What a run of rollouts gave."""

    episodes: list[Episode]
    metrics: dict[str, float]
    dispatched_version: int
    """The weight version the engine held when the oldest of these rollouts was handed out: groups carried over
    from an earlier run are older than the run's own (``RolloutRequest.version``)."""
    failures: list[str] = field(default_factory=list)
    """Why each rollout that failed after every retry failed (its last attempt's error), in the order they ended."""
    unusable: dict[str, str] = field(default_factory=dict)
    """Why rollouts that succeeded gave no episode, by reason (``rollouts/unusable_<reason>``): its words and the
    first such rollout's detail (``gather_episodes``)."""
    outcomes: list[Outcome] = field(default_factory=list)
    """What became of each rollout, in the order they ended (a teacher's rollouts are read from them: they give no
    episode, ``rollouts/teacher.py``)."""

    def nothing_to_train(self) -> str | None:
        """When no rollout gave an episode (every one failed, or gave nothing to train on: no LLM call of the
        selected agents, no reward...): what to tell the user, with how many and the first of each cause; else
        None."""
        requested = int(self.metrics.get("rollouts/requested", 0))
        if not requested or self.episodes:
            return None
        first = self.failures[0] if self.failures else "no error was reported"
        failed = requested - int(self.metrics.get("rollouts/succeeded", 0))
        if failed >= requested:
            return f"all {requested} rollouts failed; the first: {first}"
        causes = [f"{int(self.metrics.get(f'rollouts/unusable_{key}', 0))} gave no episode: {why}"
                  for key, why in self.unusable.items()]
        if failed:
            causes.append(f"{failed} failed; the first: {first}")
        return f"none of the {requested} rollouts gave an episode to train on: {'; '.join(causes)}"


class RunStopping(RuntimeError):
    """Rollouts given up because the run is stopping (``RolloutRunner.stopping``)."""


class RolloutRunner:
    """Runs rollouts on the workers of ``dispatcher``, against the servers of ``fleet``, and builds their episodes
    from ``store``; ``session`` makes the rollout ids of this run unique."""

    def __init__(self, store: Store, collector: Collector, fleet: Fleet, dispatcher: Dispatcher, agent: AgentConfig,
                 success_reward: float, session: str, vocab_size: int | None = None, context: int | None = None,
                 watch: Callable[[], None] | None = None) -> None:
        self.store, self.collector, self.fleet, self.dispatcher = store, collector, fleet, dispatcher
        self.agent, self.success_reward, self.session = agent, success_reward, session
        self.vocab_size, self.context = vocab_size, context
        """The served model's vocabulary, which every token id of an episode must be below, and the engine's
        ``max_model_len``, which no call is longer than (``build_episode``)."""
        self.watch = watch
        """Raises when the local agent workers' processes have not all stayed up (``services``)."""
        self.stopping = threading.Event()
        """Set when the run is stopping (``StepFeed.abort``): rollouts running in another thread then end at once
        (``RunStopping``), before the services they use are stopped under them."""

    def check(self) -> None:
        """Raise if a service the rollouts need has stopped: the collector (``CollectorError``: a full disk, say)
        or a vLLM server (``ServerDiedError``), so that the run stops with the cause instead of letting every
        rollout come back empty; and the local agent workers (``watch``). Called while waiting for rollouts."""
        if self.stopping.is_set():
            raise RunStopping("the run is stopping: the rollouts running ahead are given up")
        self.collector.check()
        if self.dispatcher.gateway is not None:
            self.dispatcher.gateway.check()
        self.fleet.check()
        if self.watch is not None:
            self.watch()

    def run(self, tasks: list[dict], group: int, temperature: float, step: int, label: str, version: int,
            enough: Callable[[int], bool] | None = None, restarts: int = 0, llm: LLM | None = None) -> RolloutBatch:
        """``group`` rollouts of each task, recorded under ``step`` (the store's count: steps.py); ``label`` names
        them (ids, progress bar: ``steps.training_label``, ``steps.validation_label``); ``version``: the weight
        version the engine holds as they are handed out. ``enough`` (``Dispatcher.run``): told how many groups
        ended, it may end the wait before all did; the groups still running carry over to the next call, which
        returns them (``rollouts/carried_groups``: groups of an earlier step returned by this call,
        ``rollouts/groups_in_flight``: groups this call left running).
        ``restarts``: how many times a vLLM server that died is started again and the rollouts run again before
        the error goes up; a remote server that stopped answering is dropped instead, and they run again on the
        others, however often. ``llm``: what every rollout calls instead of the fleet's servers (a teacher)."""
        tries = restarted = 0
        while True:
            seen = self.fleet.restarts
            try:
                attempt = f"{label}-restart{tries}" if tries else label
                return self._run(tasks, group, temperature, step, attempt, version, enough, llm)
            except ServerDiedError as exc:
                when = f"during the rollouts of step {step + 1} ({first_line(exc)}); the step's rollouts run again"
                tries += 1
                if self.fleet.drop_silent_remotes(when):
                    continue
                if restarted == restarts:
                    raise
                restarted += 1
                self.fleet.restart(when, seen)

    def _run(self, tasks: list[dict], group: int, temperature: float, step: int, label: str, version: int,
             enough: Callable[[int], bool] | None, llm: LLM | None = None) -> RolloutBatch:
        # each group goes to the least loaded server when its first rollout is handed out (pick_server)
        balanced = llm is None
        llm = llm or self.fleet.serving[0].llm(temperature, self.agent.max_tokens)
        requests = [RolloutRequest(f"{self.session}-{label}-t{t['id']}-g{g}", str(t["id"]), t, llm, step, version,
                                   balanced) for t in tasks for g in range(group)]
        carried = len(self.dispatcher.carried)
        bar = progress_bar(total=len(requests) + carried, desc=f"{label} rollouts", unit="rollout", leave=False)
        failed = 0

        def progress(outcome: Outcome) -> None:
            nonlocal failed
            failed += outcome.status is not RolloutStatus.SUCCEEDED
            bar.set_postfix(failed=failed, refresh=False)
            bar.update()

        self.check()
        with bar:
            outcomes = self.dispatcher.run(requests, progress, check=self.check, enough=enough)
        self.check()
        if self.dispatcher.gateway is not None:
            self.dispatcher.gateway.settle()  # the calls the engine served them are in the store
        episodes, metrics, unusable = gather_episodes(self.store, outcomes, self.agent.agents, self.success_reward,
                                                      self.vocab_size, self.context)
        if enough is not None:
            earlier = {group_of(o.request) for o in outcomes if o.request.step != step}
            metrics["rollouts/carried_groups"] = float(len(earlier))
            metrics["rollouts/groups_in_flight"] = float(len(set(map(group_of, self.dispatcher.carried))))
        dispatched = min((o.request.version for o in outcomes), default=version)
        failures = [o.errors[-1] if o.errors else o.status.value for o in outcomes
                    if o.status is not RolloutStatus.SUCCEEDED]
        return RolloutBatch(episodes, metrics, dispatched, failures, unusable, outcomes)
