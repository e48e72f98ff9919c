"""The services a run starts together and stops together: the store and the collector (intake), the vLLM
server(s) (engine), the dispatcher and the local agent workers (rollouts). ``Services.rollouts`` runs a group of
rollouts per task on the workers and turns the ones that succeeded into episodes; a failed rollout gives no episode,
never a reward of 0, and neither does one whose spans are not all stored. The collector runs in a thread of its own:
``rollouts`` checks it while it waits, so that a collector that stopped (a full disk) stops the run with the cause
instead of letting every rollout come back empty.

With several vLLM servers (``inference.servers``) every rollout of one task goes to the same server, whose prefix
cache then holds the task's prompt for the whole group (``server_of``); the servers load at the same time.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from lit_sdk.protocol import security
from lit_sdk.processes import stop_children, wait_children
from lit_sdk.resources import LLM
from lit_sdk.worker import load_target, spawn
from lit_trainer.config import ConfigError, TrainConfig
from lit_trainer.engine.config import InferenceConfig
from lit_trainer.engine.server import InferenceServer, server_ports
from lit_trainer.intake.collector import Collector
from lit_trainer.intake.episodes import Episode, UnusableRollout, build_episode
from lit_trainer.intake.store import RolloutStatus, SqliteStore
from lit_trainer.progress import progress_bar
from lit_trainer.rollouts.dispatcher import Dispatcher, Outcome, RolloutRequest, group_of

WORKER_START_TIMEOUT_S = 180.0
WORKER_STOP_TIMEOUT_S = 15.0


@dataclass
class Services:
    """What rollouts need running: the store, the collector, the vLLM servers, the dispatcher and the local
    workers."""

    cfg: TrainConfig
    store: SqliteStore
    collector: Collector
    servers: list[InferenceServer]
    dispatcher: Dispatcher
    session: str
    _stack: contextlib.ExitStack

    def llm(self, temperature: float, server: int = 0) -> LLM:
        """What the agents of a rollout on vLLM server ``server`` get."""
        chosen = self.servers[server]
        return LLM(chosen.openai_url, chosen.model_name, api_key=chosen.api_key or "EMPTY",
                   temperature=temperature, max_tokens=self.cfg.agent.max_tokens)

    def check(self) -> None:
        """Raise if a service the rollouts need has stopped: the collector (``CollectorError``) or a vLLM server
        (``ServerDiedError``). Called while waiting for rollouts."""
        self.collector.check()
        for server in self.servers:
            server.check_alive()

    def restart_server(self, index: int = 0) -> None:
        """Start vLLM server ``index`` again after it died, on the same port (the workers record the calls to that
        URL), from the model of the config; the other servers are left alone. The caller pushes the policy's
        current weights into it."""
        old = self.servers[index]
        old.stop()
        print(f"lit: restarting vLLM on port {old.port}", file=sys.stderr, flush=True)
        self.servers[index] = InferenceServer(replace(self.cfg.inference, port=old.port), index=index).start()
        self._stack.callback(self.servers[index].stop)

    def rollouts(self, tasks: list[dict], group: int, temperature: float, step: int, label: str,
                 enough: Callable[[int], bool] | None = None) -> tuple[list[Episode], dict[str, float]]:
        """Run ``group`` rollouts of each task (with a progress bar), all of one task on one vLLM server
        (``server_of``); the episodes and the rollout metrics. ``enough`` (``Dispatcher.run``): told how many
        groups ended, it may end the wait before all did; the groups still running carry over to the next call,
        which returns them (``rollouts/carried_groups``: groups of an earlier step returned by this call,
        ``rollouts/groups_in_flight``: groups this call left running)."""
        llms = [self.llm(temperature, i) for i in range(len(self.servers))]
        requests = [RolloutRequest(f"{self.session}-{label}-t{t['id']}-g{g}", str(t["id"]), t,
                                   llms[server_of(k, len(tasks), step, len(llms))], step)
                    for k, t in enumerate(tasks) for g in range(group)]
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
        episodes, metrics = gather_episodes(self.store, outcomes, self.cfg.agent.agents, self.cfg.train.success_reward)
        if enough is not None:
            earlier = {group_of(o.request) for o in outcomes if o.request.step != step}
            metrics["rollouts/carried_groups"] = float(len(earlier))
            metrics["rollouts/groups_in_flight"] = float(len(set(map(group_of, self.dispatcher.carried))))
            metrics["rollouts/oldest_step"] = float(min((o.request.step for o in outcomes), default=step))
        return episodes, metrics


@contextlib.contextmanager
def services(cfg: TrainConfig, store_path: Path) -> Iterator[Services]:
    """Start everything rollouts need, and stop it all (workers, vLLM, collector) on the way out."""
    if not cfg.agent.function:
        raise ConfigError(f"{cfg.source or 'config'}: [agent] function is not set (module:function)")
    load_target(cfg.agent.function)  # a typo fails here, not in a worker's log
    keys = security.load_server_keys(cfg.security.keys_dir) if cfg.security.keys_dir else None
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(SqliteStore(store_path))
        stale = store.end_unfinished("the trainer stopped before this attempt ended")
        if stale:
            print(f"lit: {stale} rollout attempt(s) a stopped run left queued or running are marked failed",
                  file=sys.stderr)
        collector = stack.enter_context(Collector(store, cfg.collector.endpoint, keys=keys))
        servers = start_servers(cfg.inference, stack, cfg.model)
        dispatcher = stack.enter_context(Dispatcher(store, cfg.dispatch_endpoint.endpoint, collector.endpoint,
                                                    [s.openai_url for s in servers], cfg.dispatch, keys=keys))
        env = {**os.environ, "LIT_SPOOL_DIR": str(store_path.parent / "spool")}
        if cfg.security.keys_dir:
            env["LIT_KEYS_DIR"] = str(Path(cfg.security.keys_dir).expanduser())
        workers = [spawn(cfg.agent.function, dispatcher.endpoint, cfg.agent.concurrency, env)
                   for _ in range(cfg.agent.local_workers)]
        stack.callback(stop_workers, dispatcher, workers)
        print(f"lit: workers connect to {dispatcher.endpoint} ({len(workers)} local)", file=sys.stderr)
        dispatcher.wait_for_workers(cfg.agent.local_workers, WORKER_START_TIMEOUT_S)
        yield Services(cfg, store, collector, servers, dispatcher, uuid.uuid4().hex[:8], stack)


def start_servers(config: InferenceConfig, stack: contextlib.ExitStack, model: str) -> list[InferenceServer]:
    """Start ``config.servers`` vLLM servers, each stopped by ``stack``: all are launched from this thread (a
    server gets SIGTERM when the thread that launched it ends), then waited for, so that they load at once."""
    many = f"{config.servers} vLLM servers" if config.servers > 1 else "vLLM"
    print(f"lit: starting {many} on {model} (about a minute on CPU)", file=sys.stderr, flush=True)
    servers = []
    for index, port in enumerate(server_ports(config)):
        server = InferenceServer(replace(config, port=port), index=index)
        stack.callback(server.stop)
        servers.append(server.launch())
    return [server.wait_ready() for server in servers]


def server_of(k: int, tasks: int, step: int, servers: int) -> int:
    """The vLLM server of the ``k``-th of a step's ``tasks`` tasks: the tasks are dealt round-robin, each step
    going on from where the previous one stopped, so every server gets a step's tasks within one of each other,
    also when a step has fewer tasks than there are servers."""
    return (step * tasks + k) % servers


def gather_episodes(store: SqliteStore, outcomes: list[Outcome], agents: tuple[str, ...], success: float
                    ) -> tuple[list[Episode], dict[str, float]]:
    """Episodes of the succeeded rollouts (saved to the store), and counts; failures give no episode, and neither
    does a rollout whose spans are not all stored (``rollouts/unusable_incomplete``: the dispatcher retries those,
    this is the last guard). Tasks that carry a string ``"kind"`` also get ``accuracy/<kind>`` and
    ``reward/<kind>`` (``per_kind``)."""
    episodes: list[Episode] = []
    returns_of: dict[str, float] = {}
    unusable: collections.Counter[str] = collections.Counter()
    for outcome in outcomes:
        if outcome.status is not RolloutStatus.SUCCEEDED:
            continue
        if store.missing_spans(outcome.rollout_id) is not None:
            unusable["incomplete"] += 1
            continue
        result = build_episode(store.spans_of_rollout(outcome.rollout_id), agents or None)
        if isinstance(result, UnusableRollout):
            unusable[result.reason.name.lower()] += 1
            continue
        store.save_episode(outcome.rollout_id, result.to_dict(), result.episode_return)
        episodes.append(result)
        returns_of[outcome.rollout_id] = result.episode_return
    returns = [e.episode_return for e in episodes]
    n = len(outcomes)
    metrics = {
        "rollouts/requested": float(n),
        "rollouts/succeeded": float(sum(o.status is RolloutStatus.SUCCEEDED for o in outcomes)),
        "rollouts/failed": float(sum(o.status is not RolloutStatus.SUCCEEDED for o in outcomes)),
        "rollouts/retried": float(sum(o.attempts > 1 for o in outcomes)),
        "rollouts/unusable": float(sum(unusable.values())),
        **{f"rollouts/unusable_{k}": float(v) for k, v in unusable.items()},
        "episodes": float(len(episodes)),
        "reward/mean": sum(returns) / len(returns) if returns else float("nan"),
        "accuracy": sum(r >= success for r in returns) / n if n else float("nan"),
        "transitions/per_episode": sum(len(e.transitions) for e in episodes) / max(len(episodes), 1),
    }
    for key, value in per_kind(outcomes, returns_of, success).items():
        metrics.setdefault(key, value)  # a kind named "mean" does not replace reward/mean
    return episodes, metrics


def per_kind(outcomes: list[Outcome], returns_of: dict[str, float], success: float) -> dict[str, float]:
    """For each ``"kind"`` (a string field of the tasks, in order of first appearance): ``accuracy/<kind>`` over
    all its rollouts (failed or unusable ones count as wrong, like ``accuracy``) and ``reward/<kind>``, the mean
    return of its episodes (NaN without any, like ``reward/mean``). ``returns_of``: episode return by rollout id.
    Empty when no task has a kind."""
    groups: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        task = outcome.request.task
        kind = task.get("kind") if isinstance(task, dict) else None
        if isinstance(kind, str) and kind:
            groups.setdefault(kind, []).append(outcome)
    metrics: dict[str, float] = {}
    for kind, group in groups.items():
        returns = [returns_of[o.rollout_id] for o in group if o.rollout_id in returns_of]
        metrics[f"accuracy/{kind}"] = sum(r >= success for r in returns) / len(group)
        metrics[f"reward/{kind}"] = sum(returns) / len(returns) if returns else float("nan")
    return metrics


def stop_workers(dispatcher: Dispatcher, workers: list) -> None:
    """Ask every worker to stop (they deliver their last spans), give them 15 s, then end the local ones that do
    not (and whatever their agents left running in their process groups)."""
    dispatcher.close()
    wait_children(workers, WORKER_STOP_TIMEOUT_S)
    stop_children(workers, grace_s=5, name="agent workers")
