"""``lit train`` and ``lit eval``: the training loop, and validation on the held-out split.

One step: sample ``tasks_per_step`` tasks (the same ones for the same seed and step, also after ``--resume``) →
run ``group_size`` rollouts of each on the agent workers → rebuild episodes from the stored spans → LightningRL
(credit → group advantages → clipped token loss) → one optimizer step → push the weights into vLLM → log →
validate and checkpoint when due. Generation and training alternate: vLLM idles during the update and the trainer
idles during the rollouts, so on a 2-core machine neither slows the other.

Transitions whose advantage is 0 (a group where every rollout got the same return) are left out of the update:
they add nothing to the gradient and would cost a forward and backward pass each. Rollouts that fail after every
retry give no episode, never a reward of 0; a task left with fewer than ``min_group_size`` episodes is skipped.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lit_sdk.resources import LLM
from lit_sdk.worker import load_target, spawn
from lit_trainer.learner import checkpoint as ckpt
from lit_trainer.algorithm.advantages import episode_advantages
from lit_trainer.algorithm.loss import policy_loss
from lit_trainer.learner.batching import MicroBatch, make_micro_batches
from lit_trainer.intake.collector import Collector
from lit_trainer.rollouts.dispatcher import Dispatcher, Outcome, RolloutRequest
from lit_trainer.intake.episodes import Episode, UnusableRollout, build_episode
from lit_trainer.engine.server import InferenceServer
from lit_trainer.engine.logprob_check import check_logprobs
from lit_trainer.metrics import MetricsLog, plot_curve, step_line
from lit_trainer.metrics import read as read_metrics
from lit_trainer.models import resolve_model
from lit_trainer.intake.store import RolloutStatus, SqliteStore
from lit_trainer.config import ConfigError, DataConfig, TrainConfig
from lit_trainer.engine.weight_sync import WeightSync, WeightSyncError

WORKER_START_TIMEOUT_S = 180.0


@dataclass
class Services:
    """What rollouts need running: the store, the collector, vLLM, the dispatcher and the local workers."""

    cfg: TrainConfig
    store: SqliteStore
    server: InferenceServer
    dispatcher: Dispatcher
    session: str

    def llm(self, temperature: float) -> LLM:
        return LLM(self.server.openai_url, self.server.model_name, temperature=temperature,
                   max_tokens=self.cfg.agent.max_tokens)

    def rollouts(self, tasks: list[dict], group: int, temperature: float, step: int, label: str
                 ) -> tuple[list[Episode], dict[str, float]]:
        """Run ``group`` rollouts of each task (with a progress bar); the episodes and the rollout metrics."""
        from tqdm import tqdm

        llm = self.llm(temperature)
        requests = [RolloutRequest(f"{self.session}-{label}-t{t['id']}-g{g}", str(t["id"]), t, llm, step)
                    for t in tasks for g in range(group)]
        bar = tqdm(total=len(requests), desc=f"{label} rollouts", unit="rollout", leave=False, disable=None)
        failed = 0

        def progress(outcome: Outcome) -> None:
            nonlocal failed
            failed += outcome.status is not RolloutStatus.SUCCEEDED
            bar.set_postfix(failed=failed, refresh=False)
            bar.update()

        with bar:
            outcomes = self.dispatcher.run(requests, progress)
        return gather_episodes(self.store, outcomes, self.cfg.agent.agents, self.cfg.train.success_reward)


@contextlib.contextmanager
def services(cfg: TrainConfig, store_path: Path) -> Iterator[Services]:
    """Start everything rollouts need, and stop it all (workers, vLLM, collector) on the way out."""
    if not cfg.agent.function:
        raise ConfigError(f"{cfg.source or 'config'}: [agent] function is not set (module:function)")
    load_target(cfg.agent.function)  # a typo fails here, not in a worker's log
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(SqliteStore(store_path))
        collector = stack.enter_context(Collector(store, cfg.collector.endpoint))
        print(f"lit: starting vLLM on {cfg.model} (about a minute on CPU)", file=sys.stderr, flush=True)
        server = stack.enter_context(InferenceServer(cfg.inference))
        dispatcher = stack.enter_context(Dispatcher(store, cfg.dispatch_endpoint.endpoint, collector.endpoint,
                                                    [server.openai_url], cfg.dispatch))
        env = {**os.environ, "LIT_SPOOL_DIR": str(store_path.parent / "spool")}
        workers = [spawn(cfg.agent.function, dispatcher.endpoint, cfg.agent.concurrency, env)
                   for _ in range(cfg.agent.local_workers)]
        stack.callback(_stop_workers, dispatcher, workers)
        print(f"lit: workers connect to {dispatcher.endpoint} ({len(workers)} local)", file=sys.stderr)
        dispatcher.wait_for_workers(cfg.agent.local_workers, WORKER_START_TIMEOUT_S)
        yield Services(cfg, store, server, dispatcher, uuid.uuid4().hex[:8])


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
    policy_cfg = replace(cfg.policy, model=str(start.model_dir)) if start else cfg.policy
    with services(cfg, out / "lit.sqlite") as svc:
        policy = Policy(policy_cfg, cfg.train.trackers, project_dir=str(out))

        sync = WeightSync(svc.server.base_url, cfg.weight_sync)
        state = ckpt.restore(start, policy) if start else {"step": 0, "minutes": 0.0}
        if start:
            sync.push_weights(policy.state_dict(), version=str(start.step))
            print(f"lit: resumed from {start.path} (step {start.step})", file=sys.stderr)
        log = MetricsLog(out / "metrics.jsonl", policy.accelerator, cfg.train.trackers, cfg.to_dict())
        step, minutes, last_val = state["step"], state["minutes"], {}
        if step == 0 and cfg.train.val_every:
            last_val = validate(svc, val_tasks, log, step, minutes)
        pad_id = _pad_id(policy)
        while step < cfg.train.steps and not (cfg.train.max_minutes and minutes >= cfg.train.max_minutes):
            t0 = time.perf_counter()
            tasks = sample_tasks(train_tasks, cfg.train.seed, step, cfg.train.tasks_per_step)
            episodes, metrics = svc.rollouts(tasks, cfg.train.group_size, cfg.agent.temperature, step, f"s{step}")
            metrics["time/rollout"] = time.perf_counter() - t0
            metrics.update(update_policy(policy, sync, episodes, cfg, pad_id, version=str(step + 1)))
            step += 1
            minutes += (time.perf_counter() - t0) / 60
            metrics["minutes"] = minutes
            log.log(step, metrics)
            print(step_line(step, cfg.train.steps, metrics), flush=True)
            last_step = step >= cfg.train.steps or (cfg.train.max_minutes and minutes >= cfg.train.max_minutes)
            if cfg.train.val_every and (step % cfg.train.val_every == 0 or last_step):
                last_val = validate(svc, val_tasks, log, step, minutes)
            if last_step or (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0):
                ckpt.save(out, step, policy, base_dir, {"minutes": minutes, "data_position": step,
                                                        "weight_version": str(step)}, cfg.train.keep_checkpoints)
        log.close()
        sync.close()
    png = plot_curve(out / "metrics.jsonl", out / "curve.png", title=f"{cfg.agent.function} on {cfg.model}")
    if png:
        print(f"lit: curve written to {png}", file=sys.stderr)
    return last_val


def update_policy(policy: Any, sync: Any, episodes: list[Episode], cfg: TrainConfig, pad_id: int,
                  version: str) -> dict[str, float]:
    """LightningRL on one step's episodes, the optimizer step, and the weight sync; their metrics."""
    groups = collections.Counter(e.task_id for e in episodes)
    kept = [e for e in episodes if groups[e.task_id] >= cfg.train.min_group_size]
    metrics: dict[str, float] = {"rollouts/small_groups_dropped": float(len(episodes) - len(kept))}
    if not kept:
        return metrics
    advantages, adv_metrics = episode_advantages(kept, cfg.credit, cfg.advantages)
    metrics.update(adv_metrics)
    pairs = [(t, float(a)) for e, adv in zip(kept, advantages, strict=True)
             for t, a in zip(e.transitions, adv.tolist(), strict=True) if a != 0.0]
    metrics["update/transitions"] = float(len(pairs))
    if not pairs:
        return metrics  # every group was all-correct or all-wrong: nothing to learn from this step
    t0 = time.perf_counter()
    batches = make_micro_batches([t for t, _ in pairs], [a for _, a in pairs], cfg.batching, pad_id)

    def loss_fn(logp: torch.Tensor, mb: MicroBatch, entropy: torch.Tensor | None):
        return policy_loss(logp, mb.old_logprobs, mb.advantages, mb.response_mask.bool(), cfg.loss, entropy=entropy)

    metrics.update(policy.update(batches, loss_fn))
    metrics["time/update"] = time.perf_counter() - t0
    metrics["time/sync"] = sync.push_weights(policy.state_dict(), version=version).total_s
    every = cfg.train.check_sync_every
    if every and (version == "1" or int(version) % every == 0):
        gap = check_logprobs(sync.base_url, cfg.inference.served_model_name, policy.unwrapped(),
                             [t.prompt_ids for t, _ in pairs[:2]], cfg.weight_sync.logprob_tolerance, max_tokens=8)
        metrics["sync/logprob_gap_max"] = gap.max_abs
        if not gap.ok:
            raise WeightSyncError(f"after the weight sync of step {version}, vLLM's logprobs differ from the "
                                  f"trainer's by up to {gap.max_abs:.4f} nats (tolerance {gap.tolerance}): the new "
                                  "weights did not reach vLLM. See the vLLM log; or set inference.dtype=float32")
    return metrics


def validate(svc: Services, tasks: list[dict], log: MetricsLog, step: int, minutes: float) -> dict[str, float]:
    """One greedy rollout per held-out task; accuracy counts failed rollouts as wrong (and reports them)."""
    t0 = time.perf_counter()
    _, metrics = svc.rollouts(tasks, 1, svc.cfg.agent.val_temperature, step, f"val{step}")
    metrics.update({"minutes": minutes, "time/validation": time.perf_counter() - t0})
    log.log(step, metrics, kind="validation")
    print(f"validation after step {step}: accuracy {metrics['accuracy']:.3f} on {len(tasks)} held-out tasks "
          f"(failed {metrics['rollouts/failed']:.0f}, {metrics['time/validation']:.0f} s)", flush=True)
    return metrics


def evaluate(cfg: TrainConfig, checkpoint: str | None, output: Path | None = None) -> dict[str, float]:
    """``lit eval``: validation of a checkpoint (or the base model when None), written as JSON to ``output``."""
    model = cfg.model
    if checkpoint:
        found = ckpt.resolve(checkpoint)
        model = str(found.model_dir)
        cfg = replace(cfg, model=model, inference=replace(cfg.inference, model=model))
    _, val_tasks = load_tasks(cfg.data)
    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(out / "eval.jsonl")
    with services(cfg, out / "eval.sqlite") as svc:
        metrics = validate(svc, val_tasks, log, 0, 0.0)
    result = {"model": model, "tasks": len(val_tasks), **metrics}
    if output:
        output.write_text(json.dumps(result, indent=2))
    return result


def gather_episodes(store: SqliteStore, outcomes: list[Outcome], agents: tuple[str, ...], success: float
                    ) -> tuple[list[Episode], dict[str, float]]:
    """Episodes of the succeeded rollouts (saved to the store), and counts; failures give no episode."""
    episodes: list[Episode] = []
    unusable: collections.Counter[str] = collections.Counter()
    for outcome in outcomes:
        if outcome.status is not RolloutStatus.SUCCEEDED:
            continue
        result = build_episode(store.spans_of_rollout(outcome.rollout_id), agents or None)
        if isinstance(result, UnusableRollout):
            unusable[result.reason.name.lower()] += 1
            continue
        store.save_episode(outcome.rollout_id, result.to_dict(), result.episode_return)
        episodes.append(result)
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
    return episodes, metrics


def sample_tasks(tasks: list[dict], seed: int, step: int, n: int) -> list[dict]:
    """The tasks of one step: a function of (seed, step) only, so a resumed run sees the same data."""
    return random.Random(f"{seed}:{step}").sample(tasks, min(n, len(tasks)))


def load_tasks(data: DataConfig) -> tuple[list[dict], list[dict]]:
    """The train and validation tasks, from ``module:function`` or a folder of JSONL files."""
    if not data.tasks:
        raise ConfigError("[data] tasks is not set: give module:function or a folder with train.jsonl")
    if ":" in data.tasks:
        make = load_target(data.tasks)
        splits = make("train", data.train_size), make("validation", data.val_size)
    else:
        folder = Path(data.tasks)
        splits = tuple(_read_jsonl(folder / f"{name}.jsonl")[:size]
                       for name, size in (("train", data.train_size), ("validation", data.val_size)))
    for name, tasks in zip(("train", "validation"), splits, strict=True):
        ids = [t.get("id") if isinstance(t, dict) else None for t in tasks]
        if not tasks or None in ids or len(set(ids)) != len(ids):
            raise ConfigError(f"[data] {data.tasks}: the {name} split must be a non-empty list of dicts with "
                              "unique 'id' values")
    return list(splits[0]), list(splits[1])


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        raise ConfigError(f"[data] no {path.name} in {path.parent}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _pad_id(policy: Any) -> int:
    config = policy.unwrapped().config
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    return int(pad[0] if isinstance(pad, list) else pad or 0)


def _stop_workers(dispatcher: Dispatcher, workers: list) -> None:
    """Ask every worker to stop (they deliver their last spans), then end the local ones that do not."""
    dispatcher.close()
    deadline = time.monotonic() + 15
    for p in workers:
        with contextlib.suppress(Exception):
            p.wait(max(0.1, deadline - time.monotonic()))
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(5)
            except Exception:
                p.kill()
                p.wait()
