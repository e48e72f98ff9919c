"""``lit train``: the training loop, top to bottom.

One step: sample ``tasks_per_step`` tasks (the same ones for the same seed and step, also after ``--resume``) →
run ``group_size`` rollouts of each on the agent workers → episodes rebuilt from the stored spans (``rollouts/``) →
prepare (LightningRL: credit → group advantages; what is trained on) → update (the optimizer step(s) of
``[update]``) → push the weights into vLLM → check the sync when due (``pipeline.py``) → log → validate and
checkpoint when due. Generation and training alternate: vLLM idles during the update and the trainer idles during
the rollouts, so on a 2-core machine neither slows the other. With ``train.max_staleness`` > 0 they overlap instead
(``rollouts/feed.py``: the next step's rollouts run during this step's update), for machines where vLLM and the
trainer have hardware of their own. Under ``torchrun --nproc_per_node N`` the main process runs all this and the
others take their share of each update (``follow``); with ``policy.shard`` they also join every other use of the
weights (gathering them for a push, scoring the sync check, writing a checkpoint: ``together``).

Rollouts that fail after every retry give no episode, never a reward of 0; a task left with fewer than
``min_group_size`` episodes is skipped. A step none of whose rollouts gave an episode stops the run with the cause
(``RolloutBatch.nothing_to_train``): the next step would fail the same way.
"""

from __future__ import annotations

import contextlib
import functools
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from lit_trainer import pipeline
from lit_trainer.config import ConfigError, TrainConfig, changed_settings, override_key
from lit_trainer.engine.fleet import SERVING_DTYPES
from lit_trainer.evaluation import validate
from lit_trainer.intake.store import Store
from lit_trainer.learner import checkpoint as ckpt
from lit_trainer.learner import distributed
from lit_trainer.metrics import STEP_LINE_LEGEND, MetricsLog, check_wandb_login, memory_gb, plot_curve, step_line
from lit_trainer.metrics import read as read_metrics
from lit_trainer.models import check_context, check_model_folder, resolve_model
from lit_trainer.progress import quiet_library_bars
from lit_trainer.rollouts.curriculum import Curriculum, check_rest_by
from lit_trainer.rollouts.feed import StepFeed, StepPlan
from lit_trainer.rollouts.guidance import check_references, guide, reference_encoder, references_of
from lit_trainer.rollouts.runner import RolloutsFailed
from lit_trainer.rollouts.tasks import load_tasks
from lit_trainer.runs import Checkpoint, RunFolder
from lit_trainer.services import check_agent, check_ports, services

T = TypeVar("T")


def run(cfg: TrainConfig, resume: bool = False) -> dict[str, Any]:
    """Train as ``cfg`` says; the last validation's metrics. The main process holds the output folder meanwhile
    (``RunFolder.in_use``): a second ``lit train`` on it stops at once."""
    quiet_library_bars()
    out = RunFolder(cfg.train.output_dir)
    out.create()
    main = distributed.is_launch_main()  # under torchrun the other processes write nothing there
    with out.in_use("lit train") if main else contextlib.nullcontext():
        try:
            return _run(cfg, resume, out)
        except KeyboardInterrupt:
            if main:
                print(f"lit: {_how_to_go_on(out, cfg)}", file=sys.stderr)
            raise


def _how_to_go_on(out: RunFolder, cfg: TrainConfig) -> str:
    """What an interrupted run's user can do next."""
    latest = out.latest_checkpoint()
    if latest is None:
        return (f"stopped before the first checkpoint: `{_command(cfg, 'train')}` starts again in {out.dir} (what "
                f"this run logged is set aside there, not deleted)")
    return (f"stopped: `{_command(cfg, 'train', '--resume')}` continues from the last checkpoint, step {latest.step} "
            f"({latest.path}); the steps after it train again")


def _changed_since(out: RunFolder, settings: dict[str, Any], shown: int = 8) -> str:
    """The ``settings`` (``TrainConfig.to_dict()``) of this run that differ from those the folder's
    ``config.json`` recorded, in words ("" when none, or when there is no readable record)."""
    try:
        before = out.saved_config()
    except (OSError, ValueError):
        return ""
    changed = changed_settings(before, settings) if isinstance(before, dict) else []
    more = f"; and {len(changed) - shown} more" if len(changed) > shown else ""
    return "; ".join(changed[:shown]) + more


def _command(cfg: TrainConfig, verb: str, *args: str) -> str:
    """The ``lit VERB`` command line that reads this run's config as it was given, its file and its command-line
    overrides (an API key as ``***``), then ``args``; an override of a key that ``args`` set again is left out, and
    for ``lit eval`` one of ``train.output_dir`` (there it names the eval's own folder: the run's would be its
    target)."""
    again = {override_key(arg) for arg in args if "=" in arg and not arg.startswith("-")}
    if verb == "eval":
        again.add("train.output_dir")
    given = [item for item in cfg.shown_overrides() if override_key(item) not in again]
    return " ".join([_launcher(verb), shlex.join([verb, cfg.source or "CONFIG", *given, *args])])


def _launcher(verb: str) -> str:
    """How a suggested ``lit train`` starts: as this run was launched, with as many trainer processes (a sharded
    policy would not fit one process). ``lit eval`` runs no update: one process."""
    processes, local = distributed.launch_size()
    if verb != "train" or processes <= 1:
        return "lit"
    if processes == local:
        return f"torchrun --nproc_per_node {local} -m lit_trainer.cli"
    return "torchrun <this run's launch options, on each node> -m lit_trainer.cli"


@dataclass
class _Ready:
    """What the checks made before the model loads found (``_preflight``)."""

    start: Checkpoint | None
    """The checkpoint a --resume continues from."""
    train_tasks: list
    val_tasks: list
    references: dict
    base_dir: Path | None
    """The model's folder; None when the run is already trained to ``train.steps`` (nothing to load)."""


def _preflight(cfg: TrainConfig, resume: bool, out: RunFolder) -> _Ready:
    """Every check that needs neither the weights nor vLLM: what a mistake in the config, the data, the agent, the
    model folder or the run folder makes fail in seconds, not after the model and vLLM loaded (``lit train
    --check`` runs these alone)."""
    start = out.latest_checkpoint()
    if resume and start is None and distributed.is_launch_main():
        print(f"lit: --resume: no checkpoint in {out.dir} to resume from: training starts at step 1",
              file=sys.stderr)
    if start is not None and not resume:
        raise ConfigError(f"{out.dir} already holds checkpoints (latest: step {start.step}): continue it with "
                          "--resume, or choose another train.output_dir")
    if start is not None and start.step >= cfg.train.steps:
        print(f"lit: {out.dir} is already trained to step {start.step} of {cfg.train.steps}; raise train.steps to "
              "go on, or choose another train.output_dir", file=sys.stderr)
        return _Ready(start, [], [], {}, None)
    train_tasks, val_tasks = load_tasks(cfg.data)
    if cfg.train.rest_after and (problem := check_rest_by(train_tasks, cfg.train.rest_by)):
        raise ConfigError(problem)
    references = references_of(train_tasks) if cfg.train.guidance else {}
    if cfg.train.guidance and (problem := check_references(train_tasks)):
        raise ConfigError(problem)
    check_agent(cfg)  # importable, @lit.trace, (task, llm): before the model and vLLM load
    if distributed.is_launch_main():  # the process that starts the services and whose tracker logs
        check_ports(cfg)  # a busy fixed port
        check_wandb_login(cfg.train.trackers)
    base_dir = resolve_model(cfg.model)
    check_model_folder(base_dir, weights=False)  # vLLM serves it with its tokenizer; the policy checks the weights
    check_context(base_dir, cfg.inference.max_model_len)
    if start is not None and (problem := ckpt.other_model(start, base_dir)):
        raise ConfigError(problem)
    return _Ready(start, train_tasks, val_tasks, references, base_dir)


def check(cfg: TrainConfig, resume: bool = False) -> list[str]:
    """``lit train --check``: the checks ``lit train`` makes before it loads the model and starts vLLM, alone (the
    run folder is read, not created); what they found, one line each. A mistake raises as it would in ``lit
    train``."""
    out = RunFolder(cfg.train.output_dir)
    ready = _preflight(cfg, resume, out)
    if ready.base_dir is None:
        return [f"run folder: {out.dir}, already trained to step {ready.start.step}: nothing to train"]
    where = (f"resumes from step {ready.start.step} ({ready.start.path})" if ready.start else
             "starts at step 1" + (" (what it holds of a run with no checkpoint is set aside)"
                                   if out.metrics.exists() else ""))
    lines = [f"tasks: {len(ready.train_tasks)} for training, {len(ready.val_tasks)} held out",
             (f"agent: {cfg.agent.command} (a program run per rollout; found)" if cfg.agent.command else
              f"agent: {cfg.agent.function} (imports; @lit.trace; takes (task, llm))"),
             f"model: {ready.base_dir} (its config and tokenizer; vLLM's max_model_len fits it)",
             f"run folder: {out.dir}: {where}",
             f"addresses: the collector's {cfg.collector.endpoint}, the dispatcher's "
             f"{cfg.dispatch_endpoint.endpoint}, vLLM's port {cfg.inference.port or '(a free one)'}: free now"]
    if "wandb" in cfg.train.trackers:
        lines.append("W&B: credentials found (or offline)")
    return lines


def _run(cfg: TrainConfig, resume: bool, out: RunFolder) -> dict[str, Any]:
    from lit_trainer.learner.policy import Policy

    ready = _preflight(cfg, resume, out)
    start, train_tasks, val_tasks, references = ready.start, ready.train_tasks, ready.val_tasks, ready.references
    if ready.base_dir is None:  # already trained to train.steps
        done = [r for r in read_metrics(out.metrics) if r["kind"] == "validation"]
        return done[-1] if done else {}
    base_dir = ready.base_dir
    torch.manual_seed(cfg.train.seed)
    # A LoRA policy resumes as the base model plus the checkpoint's adapter (ckpt.restore loads it).
    policy_cfg = replace(cfg.policy, model=str(start.model_dir)) if start and not cfg.policy.lora_rank else cfg.policy
    encode = reference_encoder(base_dir) if references else None
    policy = Policy(policy_cfg, cfg.train.trackers, project_dir=str(out.dir),
                    reference=str(base_dir) if cfg.loss.kl_beta > 0 else None)  # KL to the initial weights
    room = ckpt.check_room(out, ckpt.size_estimate(policy.memory.parameters, policy.memory.trained),
                           cfg.train.keep_checkpoints,
                           ckpt.saves_left(start.step if start else 0, cfg.train.steps, cfg.train.checkpoint_every))
    if room and policy.accelerator.is_main_process:  # before vLLM starts: one checkpoint fits, or it raised
        print(f"lit: warning: {room}", file=sys.stderr)
    state = ckpt.restore(start, policy) if start else {"step": 0, "minutes": 0.0}
    if not policy.accelerator.is_main_process:
        follow(policy)
        distributed.leave()
        return {}
    settings = cfg.to_dict()
    if start and (changed := _changed_since(out, settings)):
        print(f"lit: --resume with settings other than those of the run that stopped (its {out.config.name}): "
              f"{changed}", file=sys.stderr)
    out.save_config(settings)
    # shm pushes from host memory: the gathered copy need not take room on the GPU
    weights = Weights(policy, SERVING_DTYPES.get(cfg.inference.dtype),
                      "cpu" if cfg.weight_sync.transport == "shm" else None)
    with services(cfg, out.store, out.spool, out.keys, weights=weights.latest) as svc:
        fleet, store = svc.fleet, svc.store
        if start:
            fleet.push_weights(weights.latest(), version=str(start.step))
            print(f"lit: resumed from {start.path} (step {start.step})", file=sys.stderr)
        if superseded := _supersede(out, store, start):
            print(f"lit: {superseded}", file=sys.stderr)
        log = MetricsLog(out.metrics, policy.accelerator, cfg.train.trackers, settings,
                         first_step=start.step + 1 if start else 0,
                         wandb_id=_wandb_run(out, go_on=start is not None and not superseded)
                         if "wandb" in cfg.train.trackers else None)
        step, minutes, last_val = state["step"], state["minutes"], {}
        if step == 0 and cfg.train.val_every:
            last_val = validate(svc.runner, val_tasks, log, step, minutes)
        pad_id = _pad_id(policy)
        curriculum = Curriculum(cfg.train.rest_by, cfg.train.rest_after, cfg.train.rest_steps,
                                cfg.train.success_reward, cfg.train.min_group_size) if cfg.train.rest_after else None
        if curriculum:
            curriculum.load(state.get("curriculum"))  # what rested when the checkpoint was written
        plan = StepPlan(cfg.train.steps, cfg.train.tasks_per_step, cfg.train.group_size, cfg.train.seed,
                        cfg.agent.temperature, cfg.train.max_staleness, cfg.train.min_step_groups,
                        cfg.train.extra_rollouts, cfg.train.min_group_size)
        # leaving on an error, the rollouts running ahead end before the services stop under them (StepFeed.abort)
        with StepFeed(svc.runner, train_tasks, plan, curriculum) as feed:
            print(f"lit: {STEP_LINE_LEGEND}", file=sys.stderr)
            while step < cfg.train.steps and not (cfg.train.max_minutes and minutes >= cfg.train.max_minutes):
                t0, restarts = time.perf_counter(), fleet.restarts
                batch = feed.take(step)
                step += 1
                nothing = batch.nothing_to_train()
                if nothing:  # a broken agent, tasks it cannot run, a wrong agent.agents: stop now, not after N
                    raise RolloutsFailed(f"step {step}: {nothing}. No step can train on that: fix the agent or the "
                                         "config (run the agent on one task with lit_trainer.Playground: it shows the "
                                         "error, or the spans and the episode), then start again; every rollout is in "
                                         f"{out.store} (lit show --run {out.dir})")
                episodes, guided = batch.episodes, {}
                if encode:  # a reference for each failed group whose task has one
                    more, guided = guide(episodes, references, encode, cfg.train.success_reward,
                                         cfg.train.min_group_size)
                    episodes = episodes + more
                work = pipeline.prepare(episodes, cfg, step, batch.dispatched_version)
                store.save_advantages(work.advantages)
                metrics = {**batch.metrics, **guided, **work.metrics}
                if work.trains:
                    with fleet.hold():  # no server is started again with weights half updated (async rollouts)
                        job = pipeline.UpdateJob(work.pairs, pad_id, seed=cfg.train.seed * 100_003 + step,
                                                 learning_rate=pipeline.learning_rate(cfg, step))
                        metrics.update(together(policy, pipeline.update, job, cfg, main_only={"store": store}))
                        metrics.update(pipeline.push(fleet, weights.gather(), step))
                    scorer = functools.partial(together, policy, pipeline.score)
                    metrics.update(pipeline.check(fleet, policy, work.pairs, cfg, step, scorer))
                metrics["engine/restarts"] = float(fleet.restarts - restarts)
                minutes += (time.perf_counter() - t0) / 60
                metrics["minutes"] = minutes
                metrics.update(memory_gb(fleet.pids))
                log.log(step, metrics)
                print(step_line(step, cfg.train.steps, metrics), flush=True)
                last_step = step >= cfg.train.steps or (cfg.train.max_minutes and minutes >= cfg.train.max_minutes)
                if cfg.train.val_every and (step % cfg.train.val_every == 0 or last_step):
                    feed.finish_ahead()  # validation needs the workers to itself
                    last_val = validate(svc.runner, val_tasks, log, step, minutes)
                if last_step or (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0):
                    together(policy, save_checkpoint, out.dir, step, base_dir, {
                        "minutes": minutes, "data_position": step, "weight_version": str(step),
                        "curriculum": curriculum.state() if curriculum else None}, cfg.train.keep_checkpoints)
        log.close()
    distributed.broadcast(None)  # the other processes' follow() ends
    distributed.leave()
    png = plot_curve(out.metrics, out.curve, title=f"{cfg.agent.function or cfg.agent.command} on {cfg.model}")
    if png:
        print(f"lit: curve written to {png}", file=sys.stderr)
    final = out.latest_checkpoint()
    if final is not None:
        print(f"lit: trained to step {final.step}: the model is {final.model_dir} (a Hugging Face folder). Next: "
              f"`{_command(cfg, 'eval', '--checkpoint', str(out.dir))}` evaluates it, "
              f"`{shlex.join(['lit', 'show', '--run', str(out.dir)])}` shows its rollouts, "
              f"`{_command(cfg, 'train', '--resume', f'train.steps={final.step * 2}')}` trains on", file=sys.stderr)
    return last_val


def _supersede(out: RunFolder, store: Store, start: Checkpoint | None) -> str:
    """Set aside what a stopped run left of the steps this run trains again (``RunFolder.supersede``); what was set
    aside, in words, or "" when nothing was."""
    records, rollouts = out.supersede(store, start.step if start else None)
    if not records and not rollouts:
        return ""
    which = (f"had logged steps after step {start.step}, which this run trains again" if start else
             "wrote no checkpoint, so this run starts it over")
    return (f"the run that stopped here {which}: its {records} metrics record(s) of them moved to "
            f"{out.superseded_metrics.name}, and its {rollouts} rollout(s) of them stay in the store, marked "
            "superseded (lit show lists a step's own only)")


def _wandb_run(out: RunFolder, go_on: bool) -> str:
    """The W&B run this run logs to (``RunFolder.wandb_run``), saying so when it is not the one the folder logged to
    before."""
    run_id, replaced = out.wandb_run(go_on)
    if replaced:
        print(f"lit: W&B: logging to a new W&B run, {run_id}: the folder's earlier one, {replaced}, holds steps this "
              "run trains again, and W&B keeps a step only once", file=sys.stderr)
    return run_id


def together(policy: Any, fn: Callable[..., T], *args: Any, main_only: dict[str, Any] | None = None) -> T:
    """``fn(policy, *args)`` in the main process and, where the other processes must join, in each of them too
    (they wait in ``follow``): always for the update (each takes its share), and for every use of the weights when
    they are sharded (each holds a part of them). ``main_only``: keyword arguments for the main process's call
    alone (the store)."""
    if policy.accelerator.num_processes > 1 and (policy.sharded or fn is pipeline.update):
        distributed.broadcast((fn, args))
    return fn(policy, *args, **(main_only or {}))


def follow(policy: Any) -> None:
    """A process other than the main one (``torchrun --nproc_per_node N``): it runs what the main process asks of
    every process (``together``: its share of each update; with the policy sharded, also the weights' gathering,
    the sync check's scoring and the checkpoint), until the main process broadcasts None at the end of the run.
    The main process alone runs the services and pushes the weights."""
    while (call := distributed.broadcast()) is not None:
        fn, args = call
        fn(policy, *args)


def save_checkpoint(policy: Any, output_dir: Path, step: int, base_dir: Path, extra: dict[str, Any],
                    keep: int) -> None:
    """``learner/checkpoint.save`` with the policy first, as ``together`` calls it."""
    ckpt.save(output_dir, step, policy, base_dir, extra, keep)


def _pad_id(policy: Any) -> int:
    config = policy.unwrapped().config
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    return int(pad[0] if isinstance(pad, list) else pad or 0)


class Weights:
    """The policy's whole weights, for the main process to push into vLLM. Unsharded they are the policy's own
    tensors. Sharded, every process takes part in gathering them (``gather``: at the start and for each push),
    cast to vLLM's serving ``dtype`` and moved to ``device`` (the CPU for the ``shm`` transport) as they come, and
    the main process keeps the last gathered: a vLLM started again between two pushes gets them (``latest``, from
    whatever thread notices the death) without the other processes, which may be anywhere in their loop then.
    That copy costs the main process one whole model in the serving dtype (learner/memory.py, ``gathered``)."""

    def __init__(self, policy: Any, dtype: torch.dtype | None, device: str | None) -> None:
        self.policy, self.dtype, self.device = policy, dtype, device
        self._last = self.gather() if policy.sharded else None

    def gather(self) -> dict[str, Any]:
        if not self.policy.sharded:
            return self.policy.state_dict()
        self._last = together(self.policy, pipeline.weights, self.dtype, self.device)
        return self._last

    def latest(self) -> dict[str, Any]:
        return self._last if self._last is not None else self.policy.state_dict()
