"""``lit train``: the training loop, top to bottom.

One step: sample ``tasks_per_step`` tasks (the same ones for the same seed and step, also after ``--resume``) →
run ``group_size`` rollouts of each on the agent workers → rebuild episodes from the stored spans → LightningRL
(credit → group advantages → clipped token loss) → optimizer step(s) (``[update]``) → push the weights into vLLM → log →
validate and checkpoint when due. Generation and training alternate: vLLM idles during the update and the trainer
idles during the rollouts, so on a 2-core machine neither slows the other.

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
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from lit_trainer.algorithm.advantages import episode_advantages
from lit_trainer.config import ConfigError, TrainConfig
from lit_trainer.engine.logprob_check import check_logprobs
from lit_trainer.engine.server import ServerDiedError
from lit_trainer.engine.weight_sync import WeightSync, WeightSyncError
from lit_trainer.evaluate import validate
from lit_trainer.intake.episodes import Episode, unsupported_sampling
from lit_trainer.intake.store import AdvantageRow, Store
from lit_trainer.learner import checkpoint as ckpt
from lit_trainer.learner.batching import keep_usable
from lit_trainer.learner.schedule import mask_overlong, run_update
from lit_trainer.metrics import MetricsLog, memory_gb, plot_curve, step_line
from lit_trainer.metrics import read as read_metrics
from lit_trainer.models import resolve_model
from lit_trainer.rollouts.tasks import load_tasks, sample_tasks
from lit_trainer.services import services

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
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2, default=str))
    torch.manual_seed(cfg.train.seed)
    base_dir = resolve_model(cfg.model)
    # A LoRA policy resumes as the base model plus the checkpoint's adapter (ckpt.restore loads it).
    policy_cfg = replace(cfg.policy, model=str(start.model_dir)) if start and not cfg.policy.lora_rank else cfg.policy
    with services(cfg, out / "lit.sqlite") as svc:
        policy = Policy(policy_cfg, cfg.train.trackers, project_dir=str(out),
                        reference=str(base_dir) if cfg.loss.kl_beta > 0 else None)  # KL to the initial weights

        engine = Engine(svc, policy, cfg)
        state = ckpt.restore(start, policy) if start else {"step": 0, "minutes": 0.0}
        if start:
            engine.push_weights(policy.state_dict(), version=str(start.step))
            print(f"lit: resumed from {start.path} (step {start.step})", file=sys.stderr)
        log = MetricsLog(out / "metrics.jsonl", policy.accelerator, cfg.train.trackers, cfg.to_dict())
        step, minutes, last_val = state["step"], state["minutes"], {}
        if step == 0 and cfg.train.val_every:
            last_val = validate(svc, val_tasks, log, step, minutes)
        pad_id = _pad_id(policy)
        while step < cfg.train.steps and not (cfg.train.max_minutes and minutes >= cfg.train.max_minutes):
            t0 = time.perf_counter()
            tasks = sample_tasks(train_tasks, cfg.train.seed, step, cfg.train.tasks_per_step)
            restarts = engine.restarts
            episodes, metrics = step_rollouts(svc, engine, tasks, cfg, step)
            metrics["time/rollout"] = time.perf_counter() - t0
            metrics.update(update_policy(policy, engine, svc.store, episodes, cfg, pad_id, step + 1))
            metrics["engine/restarts"] = float(engine.restarts - restarts)
            step += 1
            minutes += (time.perf_counter() - t0) / 60
            metrics["minutes"] = minutes
            metrics.update(memory_gb(svc.server.process.pid if svc.server.process else None))
            log.log(step, metrics)
            print(step_line(step, cfg.train.steps, metrics), flush=True)
            last_step = step >= cfg.train.steps or (cfg.train.max_minutes and minutes >= cfg.train.max_minutes)
            if cfg.train.val_every and (step % cfg.train.val_every == 0 or last_step):
                last_val = validate(svc, val_tasks, log, step, minutes)
            if last_step or (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0):
                ckpt.save(out, step, policy, base_dir, {"minutes": minutes, "data_position": step,
                                                        "weight_version": str(step)}, cfg.train.keep_checkpoints)
        log.close()
        engine.close()
    png = plot_curve(out / "metrics.jsonl", out / "curve.png", title=f"{cfg.agent.function} on {cfg.model}")
    if png:
        print(f"lit: curve written to {png}", file=sys.stderr)
    return last_val


class Engine:
    """The vLLM server the loop trains, as the loop uses it: the policy's weights go in through ``push_weights``
    (``WeightSync``'s). vLLM dying is recovered from wherever it is noticed: it is started again on the same port
    with the policy's current weights (``restart``), and ``restarts`` counts how often."""

    def __init__(self, svc: Any, policy: Any, cfg: TrainConfig):
        self.svc, self.policy, self.cfg = svc, policy, cfg
        self.sync = WeightSync(svc.server.base_url, cfg.weight_sync)
        self.restarts = 0

    @property
    def base_url(self) -> str:
        return self.sync.base_url

    def push_weights(self, state: Any, version: str) -> Any:
        """``WeightSync.push_weights``; if vLLM has died (during the update, or during this push), it is started
        again with the policy's weights of ``version`` instead. The sync's report (None after a restart)."""
        try:
            self.svc.server.check_alive()
            return self.sync.push_weights(state, version=version)
        except (ServerDiedError, WeightSyncError) as exc:
            if not self.svc.server.exited(within_s=5.0):  # an error of a live server is no death: it stops the run
                raise
            self.restart(version, f"before the weights of step {version} reached it ({_first_line(exc)})")
            return None

    def restart(self, version: str, when: str) -> None:
        """Start vLLM again after it died ``when``, and push the policy's current weights into it as ``version``."""
        print(f"lit: vLLM died {when}; starting it again with the current weights", file=sys.stderr)
        self.sync.close()
        self.svc.restart_server()
        self.restarts += 1
        self.sync = WeightSync(self.svc.server.base_url, self.cfg.weight_sync)
        self.sync.push_weights(self.policy.state_dict(), version=version)

    def close(self) -> None:
        self.sync.close()


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def step_rollouts(svc: Any, engine: Engine, tasks: list[dict], cfg: TrainConfig, step: int
                  ) -> tuple[list[Episode], dict[str, float]]:
    """The rollouts of training step ``step`` (from 0). If vLLM dies meanwhile, it is started again with the
    policy's current weights and the step's rollouts run again (what was in flight is given up, and nothing of it
    is trained on), up to ``MAX_ENGINE_RESTARTS`` times."""
    for restart in range(MAX_ENGINE_RESTARTS + 1):
        try:
            label = f"s{step}" + (f"-restart{restart}" if restart else "")
            return svc.rollouts(tasks, cfg.train.group_size, cfg.agent.temperature, step, label)
        except ServerDiedError as exc:
            if restart == MAX_ENGINE_RESTARTS:
                raise
            engine.restart(str(step), f"during the rollouts of step {step + 1} ({_first_line(exc)}); the step's "
                           "rollouts run again")
    raise AssertionError("unreachable")


def update_policy(policy: Any, engine: Engine, store: Store, episodes: list[Episode], cfg: TrainConfig,
                  pad_id: int, step: int) -> dict[str, float]:
    """LightningRL on the episodes of training step ``step`` (from 1), the optimizer steps, and the weight sync
    into ``engine`` (weight version ``step``); their metrics. Every transition's advantage goes to ``store`` (for
    ``lit show``), also of those then left out of the update."""
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
    pairs, overlong = mask_overlong(pairs, cfg.update)
    metrics["update/overlong_masked"] = float(overlong)
    metrics["update/transitions"] = float(sum(1 for _, a in pairs if a != 0.0))
    if not pairs or (cfg.loss.kl_beta == 0 and not any(a != 0.0 for _, a in pairs)):
        return metrics  # all-correct or all-wrong groups (or only unusable transitions): nothing to learn from
    t0 = time.perf_counter()
    trainer_logprobs: dict[int, list[float]] = {}
    metrics.update(run_update(policy, pairs, cfg.update, cfg.loss, cfg.batching, pad_id,
                              seed=cfg.train.seed * 100_003 + step, trainer_logprobs=trainer_logprobs))
    store.save_trainer_logprobs((pairs[i][0].rollout_id, pairs[i][0].index, values)
                                for i, values in trainer_logprobs.items())
    metrics["time/update"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = engine.push_weights(policy.state_dict(), version=version)
    # None: vLLM had died and was started again with these weights (Engine); that took the time
    metrics["time/sync"] = report.total_s if report is not None else time.perf_counter() - t0
    every = cfg.train.check_sync_every
    if every and (version == "1" or int(version) % every == 0):
        gap = check_logprobs(engine.base_url, cfg.inference.served_model_name, policy.unwrapped(),
                             [t.prompt_ids for t, _ in pairs[:2]], cfg.weight_sync.logprob_tolerance, max_tokens=8)
        metrics["sync/logprob_gap_max"] = gap.max_abs
        if not gap.ok:
            raise WeightSyncError(f"after the weight sync of step {version}, vLLM's logprobs differ from the "
                                  f"trainer's by up to {gap.max_abs:.4f} nats (tolerance {gap.tolerance}): the new "
                                  "weights did not reach vLLM. See the vLLM log; or set inference.dtype=float32")
    return metrics


def _pad_id(policy: Any) -> int:
    config = policy.unwrapped().config
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    return int(pad[0] if isinstance(pad, list) else pad or 0)
