"""``lit train``: the training loop, top to bottom.

One step: sample ``tasks_per_step`` tasks (the same ones for the same seed and step, also after ``--resume``) →
run ``group_size`` rollouts of each on the agent workers → rebuild episodes from the stored spans → LightningRL
(credit → group advantages → clipped token loss) → optimizer step(s) (``[update]``) → push the weights into vLLM → log →
validate and checkpoint when due. Generation and training alternate: vLLM idles during the update and the trainer
idles during the rollouts, so on a 2-core machine neither slows the other. With ``train.max_staleness`` > 0 they
overlap instead (``Rollouts``: the next step's rollouts run during this step's update), for machines where vLLM and
the trainer have hardware of their own. Under ``torchrun --nproc_per_node N`` the main process runs all this and
the others take their share of each update (``follow``).

Transitions whose advantage is 0 (a group where every rollout got the same return) add nothing to the policy
gradient and are not trained on (learner/schedule.py says when they are, and how they count in the normaliser).
Rollouts that fail after every retry give no episode, never a reward of 0; a task left with fewer than
``min_group_size`` episodes is skipped. A call sampled with settings lit cannot reproduce (top-p, top-k,
penalties) stops the run with a message: its importance ratios would be wrong.
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lit_trainer.algorithm.advantages import episode_advantages
from lit_trainer.config import ConfigError, TrainConfig
from lit_trainer.engine.logprob_check import check_logprobs
from lit_trainer.engine.server import ServerDiedError
from lit_trainer.engine.weight_sync import WeightSyncError
from lit_trainer.evaluate import validate
from lit_trainer.intake.episodes import Episode, Transition, unsupported_sampling
from lit_trainer.intake.store import AdvantageRow, Store
from lit_trainer.learner import checkpoint as ckpt
from lit_trainer.learner import distributed
from lit_trainer.learner.batching import keep_usable
from lit_trainer.learner.schedule import drop_stale, mask_overlong, run_update
from lit_trainer.metrics import MetricsLog, memory_gb, plot_curve, step_line
from lit_trainer.metrics import read as read_metrics
from lit_trainer.models import resolve_model
from lit_trainer.rollouts.tasks import load_tasks, sample_tasks
from lit_trainer.services import services
from lit_trainer.serving import Engine, first_line

MAX_ENGINE_RESTARTS = 3
"""How many times one step's rollouts start vLLM again after it died, before the run stops."""


def run(cfg: TrainConfig, resume: bool = False) -> dict[str, Any]:
    """Train as ``cfg`` says; the last validation's metrics."""
    from lit_trainer.learner.policy import Policy

    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = ckpt.latest(out)
    if start is not None and not resume:
        raise ConfigError(f"{out} already holds checkpoints (latest: step {start.step}): continue it with --resume, "
                          "or choose another train.output_dir")
    if start is not None and start.step >= cfg.train.steps:
        print(f"lit: {out} is already trained to step {start.step} of {cfg.train.steps}; raise train.steps to "
              "go on, or choose another train.output_dir", file=sys.stderr)
        done = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "validation"]
        return done[-1] if done else {}
    train_tasks, val_tasks = load_tasks(cfg.data)
    torch.manual_seed(cfg.train.seed)
    base_dir = resolve_model(cfg.model)
    # A LoRA policy resumes as the base model plus the checkpoint's adapter (ckpt.restore loads it).
    policy_cfg = replace(cfg.policy, model=str(start.model_dir)) if start and not cfg.policy.lora_rank else cfg.policy
    policy = Policy(policy_cfg, cfg.train.trackers, project_dir=str(out),
                    reference=str(base_dir) if cfg.loss.kl_beta > 0 else None)  # KL to the initial weights
    state = ckpt.restore(start, policy) if start else {"step": 0, "minutes": 0.0}
    if not policy.accelerator.is_main_process:
        return follow(policy, cfg)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2, default=str))
    with services(cfg, out / "lit.sqlite") as svc:
        engine = Engine(svc, policy, cfg)
        if start:
            engine.push_weights(policy.state_dict(), version=str(start.step))
            print(f"lit: resumed from {start.path} (step {start.step})", file=sys.stderr)
        log = MetricsLog(out / "metrics.jsonl", policy.accelerator, cfg.train.trackers, cfg.to_dict())
        step, minutes, last_val = state["step"], state["minutes"], {}
        if step == 0 and cfg.train.val_every:
            last_val = validate(svc, val_tasks, log, step, minutes)
        pad_id = _pad_id(policy)
        rollouts = Rollouts(svc, engine, cfg, train_tasks)
        while step < cfg.train.steps and not (cfg.train.max_minutes and minutes >= cfg.train.max_minutes):
            t0 = time.perf_counter()
            restarts = engine.restarts
            episodes, metrics, dispatched = rollouts.take(step)
            metrics.update(update_policy(policy, engine, svc.store, episodes, cfg, pad_id, step + 1, dispatched))
            metrics["engine/restarts"] = float(engine.restarts - restarts)
            step += 1
            minutes += (time.perf_counter() - t0) / 60
            metrics["minutes"] = minutes
            metrics.update(memory_gb([server.process.pid for server in svc.servers if server.process]))
            log.log(step, metrics)
            print(step_line(step, cfg.train.steps, metrics), flush=True)
            last_step = step >= cfg.train.steps or (cfg.train.max_minutes and minutes >= cfg.train.max_minutes)
            if cfg.train.val_every and (step % cfg.train.val_every == 0 or last_step):
                rollouts.finish_ahead()  # validation needs the workers to itself
                last_val = validate(svc, val_tasks, log, step, minutes)
            if last_step or (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0):
                ckpt.save(out, step, policy, base_dir, {"minutes": minutes, "data_position": step,
                                                        "weight_version": str(step)}, cfg.train.keep_checkpoints)
        rollouts.close()
        log.close()
        engine.close()
    distributed.broadcast(None)  # the other processes' follow() ends
    png = plot_curve(out / "metrics.jsonl", out / "curve.png", title=f"{cfg.agent.function} on {cfg.model}")
    if png:
        print(f"lit: curve written to {png}", file=sys.stderr)
    return last_val


def follow(policy: Any, cfg: TrainConfig) -> dict[str, Any]:
    """A process other than the main one (``torchrun --nproc_per_node N``): it takes its share of every update the
    main process broadcasts (``UpdateJob``), until the main process broadcasts None at the end of the run. The main
    process alone runs the services, syncs the weights and writes checkpoints; every process holds the same
    weights (learner/distributed.py)."""
    while (job := distributed.broadcast()) is not None:
        run_update(policy, job.pairs, cfg.update, cfg.loss, cfg.batching, job.pad_id, seed=job.seed,
                   trainer_logprobs={})
    return {}


@dataclass(frozen=True)
class UpdateJob:
    """What the other processes need of one training step's update: the same arguments as the main process's."""

    pairs: list[tuple[Transition, float]]
    pad_id: int
    seed: int


class Rollouts:
    """Each training step's rollouts. Synchronous (``train.max_staleness = 0``): run when the step asks for them.
    Asynchronous: as soon as a step has its rollouts, the next step's start in a background thread, so they run
    during this step's update and weight sync (the sync pauses them and they go on with the new weights); the
    next step then waits only for what is left of them (``time/rollout``). With ``train.min_step_groups``, it
    waits only until that many groups have ended, and takes every group that has: the others carry over, still
    running, into the next step's rollouts (``rollouts/carried_groups``, ``rollouts/groups_in_flight``), so that a
    slow group does not stall the step. A carried group's calls more than ``max_staleness`` versions older than
    the policy are not trained on (``drop_stale``), and a carried and a new group of the same task are one group
    for the advantages (the same prompt). The last step, and validation, wait for every group; a run stopped
    otherwise gives up the groups in flight (they fail in the store; ``--resume`` does not run them again). The
    thread's exception, if any, is raised in the loop by ``take``."""

    def __init__(self, svc: Any, engine: Engine, cfg: TrainConfig, tasks: list[dict]):
        self.svc, self.engine, self.cfg, self.tasks = svc, engine, cfg, tasks
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="lit-rollouts") if cfg.train.max_staleness else None
        self.ahead: tuple[int, Future] | None = None  # (step, its rollouts)
        self.finished: dict[int, tuple[list[Episode], dict[str, float]]] = {}
        self.dispatched_at: dict[int, int] = {}  # step -> the engine's version when its rollouts were handed out
        self.wanted = threading.Event()  # set while the loop waits for the rollouts running ahead

    def take(self, step: int) -> tuple[list[Episode], dict[str, float], int]:
        """Step ``step``'s (from 0) episodes and rollout metrics, and the engine's weight version when they were
        handed out; in asynchronous mode, also start step ``step + 1``'s."""
        t0 = time.perf_counter()
        if self.ahead is not None and self.ahead[0] == step:
            if step + 1 < self.cfg.train.steps:  # the last step waits for every group: none is left over
                self.wanted.set()  # groups not ended once enough have carry over (``_enough``)
            try:
                self.finish_ahead()
            finally:
                self.wanted.clear()
        if step in self.finished:
            episodes, metrics = self.finished.pop(step)
        else:  # the engine holds the weights of ``step`` updates
            self.dispatched_at[step] = step
            episodes, metrics = self._run(step)
        # groups carried over were handed out before this step's: the oldest step's version is the episodes' own
        oldest = int(metrics.pop("rollouts/oldest_step", step))
        dispatched = self.dispatched_at[oldest]
        metrics["time/rollout"] = time.perf_counter() - t0
        if self.pool is not None and step + 1 < self.cfg.train.steps:
            self.dispatched_at[step + 1] = step
            self.ahead = (step + 1, self.pool.submit(self._run, step + 1))
        return episodes, metrics, dispatched

    def finish_ahead(self) -> None:
        """Wait for the rollouts running ahead (their exception is raised here), and keep them for their step."""
        if self.ahead is not None:
            step, future = self.ahead
            self.ahead = None
            self.finished[step] = future.result()

    def close(self) -> None:
        """Wait for rollouts still running ahead (a run stopped by ``max_minutes``) and let go of the thread."""
        try:
            self.finish_ahead()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, step: int) -> tuple[list[Episode], dict[str, float]]:
        tasks = sample_tasks(self.tasks, self.cfg.train.seed, step, self.cfg.train.tasks_per_step)
        return step_rollouts(self.svc, self.engine, tasks, self.cfg, step,
                             self._enough if self.cfg.train.min_step_groups else None)

    def _enough(self, ended_groups: int) -> bool:
        """Whether the rollouts running ahead may stop waiting: the loop wants them, and ``min_step_groups``
        groups ended."""
        return self.wanted.is_set() and ended_groups >= self.cfg.train.min_step_groups


def step_rollouts(svc: Any, engine: Engine, tasks: list[dict], cfg: TrainConfig, step: int,
                  enough: Callable[[int], bool] | None = None) -> tuple[list[Episode], dict[str, float]]:
    """The rollouts of training step ``step`` (from 0); ``enough``: see ``Services.rollouts``. If vLLM dies
    meanwhile, it is started again with the policy's current weights and the step's rollouts run again (what was in
    flight, groups carried over too, is given up, and nothing of it is trained on), up to ``MAX_ENGINE_RESTARTS``
    times."""
    for restart in range(MAX_ENGINE_RESTARTS + 1):
        restarts = engine.restarts
        try:
            label = f"s{step}" + (f"-restart{restart}" if restart else "")
            return svc.rollouts(tasks, cfg.train.group_size, cfg.agent.temperature, step, label, enough)
        except ServerDiedError as exc:
            if restart == MAX_ENGINE_RESTARTS:
                raise
            engine.restart(f"during the rollouts of step {step + 1} ({first_line(exc)}); the step's rollouts run "
                           "again", restarts)
    raise AssertionError("unreachable")


def update_policy(policy: Any, engine: Engine, store: Store, episodes: list[Episode], cfg: TrainConfig,
                  pad_id: int, step: int, dispatched: int | None = None) -> dict[str, float]:
    """LightningRL on the episodes of training step ``step`` (from 1), the optimizer steps, and the weight sync
    into ``engine`` (weight version ``step``); their metrics. Every transition's advantage goes to ``store`` (for
    ``lit show``), also of those then left out of the update. ``dispatched``: the engine's weight version when the
    episodes' rollouts were handed out (default ``step - 1``, synchronous); with ``train.max_staleness`` the calls
    sampled more than that many versions before the policy's are left out (``drop_stale``)."""
    version = str(step)
    groups = collections.Counter(e.task_id for e in episodes)
    kept = [e for e in episodes if groups[e.task_id] >= cfg.train.min_group_size]
    metrics: dict[str, float] = {"rollouts/small_groups_dropped": float(len(episodes) - len(kept))}
    if not kept:
        return metrics
    bad = unsupported_sampling(kept)
    if bad is not None:
        raise ConfigError(f"transition {bad.rollout_id}#{bad.index} (agent {bad.agent!r}) was sampled with "
                          f"{bad.sampling_unsupported}: lit computes the trainer's logprobs of softmax(logits / "
                          "temperature) only, so it cannot train on calls with top-p, top-k, min-p, penalties or a "
                          "logit bias. Remove them from the agent's LLM settings (temperature alone is supported)")
    advantages, adv_metrics = episode_advantages(kept, cfg.credit, cfg.advantages)
    metrics.update(adv_metrics)
    pairs = [(t, float(a)) for e, adv in zip(kept, advantages, strict=True)
             for t, a in zip(e.transitions, adv.tolist(), strict=True)]
    store.save_advantages(AdvantageRow(t.rollout_id, t.index, step, a) for t, a in pairs)
    pairs, skipped = keep_usable(pairs, cfg.batching)  # a bad transition costs itself, not the step
    metrics.update({f"update/skipped_{reason}": float(n) for reason, n in skipped.items()})
    if cfg.train.max_staleness:
        dispatched = step - 1 if dispatched is None else dispatched
        pairs, stale = drop_stale(pairs, step - 1, cfg.train.max_staleness, dispatched)
        metrics.update(stale)
    pairs, overlong = mask_overlong(pairs, cfg.update)
    metrics["update/overlong_masked"] = float(overlong)
    metrics["update/transitions"] = float(sum(1 for _, a in pairs if a != 0.0))
    if not pairs or (cfg.loss.kl_beta == 0 and not any(a != 0.0 for _, a in pairs)):
        return metrics  # all-correct or all-wrong groups (or only unusable transitions): nothing to learn from
    with engine.hold():  # no server is started again with weights half updated (asynchronous rollouts)
        t0 = time.perf_counter()
        trainer_logprobs: dict[int, list[float]] = {}
        job = distributed.broadcast(UpdateJob(pairs, pad_id, seed=cfg.train.seed * 100_003 + step))
        metrics.update(run_update(policy, job.pairs, cfg.update, cfg.loss, cfg.batching, pad_id, seed=job.seed,
                                  trainer_logprobs=trainer_logprobs))
        store.save_trainer_logprobs((pairs[i][0].rollout_id, pairs[i][0].index, values)
                                    for i, values in trainer_logprobs.items())
        metrics["time/update"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = engine.push_weights(policy.state_dict(), version=version)
        # None: vLLM had died and was started again with these weights (Engine); that took the time
        metrics["time/sync"] = report.total_s if report is not None else time.perf_counter() - t0
    every = cfg.train.check_sync_every
    if every and (version == "1" or int(version) % every == 0):  # every server: each got its own push
        gaps = {url: check_logprobs(url, cfg.inference.served_model_name, policy.unwrapped(),
                                    [t.prompt_ids for t, _ in pairs[:2]], cfg.weight_sync.logprob_tolerance,
                                    max_tokens=8) for url in engine.base_urls}
        worst = max(gaps, key=lambda url: gaps[url].max_abs)
        metrics["sync/logprob_gap_max"] = gaps[worst].max_abs
        metrics["sync/servers_checked"] = float(len(gaps))
        if not gaps[worst].ok:
            raise WeightSyncError(f"after the weight sync of step {version}, the logprobs of vLLM at {worst} differ "
                                  f"from the trainer's by up to {gaps[worst].max_abs:.4f} nats (tolerance "
                                  f"{gaps[worst].tolerance}): the new weights did not reach it. See its log; or set "
                                  "inference.dtype=float32")
    return metrics


def _pad_id(policy: Any) -> int:
    config = policy.unwrapped().config
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    return int(pad[0] if isinstance(pad, list) else pad or 0)
