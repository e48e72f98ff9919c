"""``lit train``: the training loop, top to bottom.

One step: sample ``tasks_per_step`` tasks (the same ones for the same seed and step, also after ``--resume``) →
run ``group_size`` rollouts of each on the agent workers → episodes rebuilt from the stored spans (``rollouts/``) →
prepare (LightningRL: credit → group advantages; what is trained on) → update (the optimizer step(s) of
``[update]``) → push the weights into vLLM → check the sync when due (``pipeline.py``) → log → validate and
checkpoint when due. Generation and training alternate: vLLM idles during the update and the trainer idles during
the rollouts, so on a 2-core machine neither slows the other. With ``rollouts.max_staleness`` > 0 they overlap instead
(``rollouts/feed.py``: the next step's rollouts run during this step's update), for machines where vLLM and the
trainer have hardware of their own. Under ``torchrun --nproc_per_node N`` the main process runs all this and the
others join what needs them (``trainers.py``). The checks made before the model loads are in ``preflight.py``.

Rollouts that fail after every retry give no episode, never a reward of 0; a task left with fewer than
``min_group_size`` episodes is skipped. A step none of whose rollouts gave an episode stops the run with the cause
(``RolloutBatch.nothing_to_train``): the next step would fail the same way.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from lit_trainer.config import TrainConfig, TrainLoopConfig, changed_settings, override_key
from lit_trainer.engine.fleet import SERVING_DTYPES
from lit_trainer.intake.episodes import Transition
from lit_trainer.intake.rows import Store
from lit_trainer.learner import checkpoint as ckpt
from lit_trainer.learner import distributed
from lit_trainer.learner.policy import Policy
from lit_trainer.progress import quiet_library_bars
from lit_trainer.results.memory_usage import memory_gb
from lit_trainer.results.metrics import STEP_LINE_LEGEND, MetricsLog, step_line
from lit_trainer.results.metrics import read as read_metrics
from lit_trainer.results.plots import plot_curve
from lit_trainer.results.runs import Checkpoint, RunFolder
from lit_trainer.rollouts import demonstrations
from lit_trainer.rollouts.curriculum import Curriculum
from lit_trainer.rollouts.demonstrations import step_batch
from lit_trainer.rollouts.feed import StepFeed, StepPlan
from lit_trainer.rollouts.guidance import guide, reference_encoder
from lit_trainer.rollouts.runner import RolloutBatch, RolloutsFailed
from lit_trainer.run import demonstration_sources, pipeline
from lit_trainer.run.evaluation import validate
from lit_trainer.run.preflight import Ready, preflight
from lit_trainer.run.services import Services, services
from lit_trainer.run.trainers import Trainers


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


def _run(cfg: TrainConfig, resume: bool, out: RunFolder) -> dict[str, Any]:
    ready = preflight(cfg, resume, out)
    if ready.base_dir is None:  # already trained to train.steps
        done = [r for r in read_metrics(out.metrics) if r["kind"] == "validation"]
        return done[-1] if done else {}
    torch.manual_seed(cfg.train.seed)
    roles = cfg.role_table
    trainers = Trainers(_policy(cfg, ready), SERVING_DTYPES.get(cfg.inference.dtype),
                        "cpu" if cfg.weight_sync.transport == "shm" else None,
                        served={a: roles.adapter_served_name(a) for a in roles.adapters} if roles else None)
    state = trainers.restore(ready.start)
    if not trainers.main:
        trainers.follow()
        return {}
    trainers.gather()  # sharded: the main process keeps a copy, for a vLLM started again
    settings = cfg.to_dict()
    if ready.start and (changed := _changed_since(out, settings)):
        print(f"lit: --resume with settings other than those of the run that stopped (its {out.config.name}): "
              f"{changed}", file=sys.stderr)
    out.save_config(settings)
    teachers = [cfg.sft.teacher.upstream] if cfg.sft.teacher else []
    with services(cfg, out.store, out.spool, out.keys, weights=trainers.latest, teachers=teachers,
                  version=state.weight_version) as svc:
        if ready.start or roles:  # the roles' adapters are vLLM's to load, the first time too (remote servers have
            # them: they got them when they joined)
            svc.fleet.push_weights(trainers.latest(), version=state.weight_version)
        if ready.start:
            print(f"lit: resumed from {ready.start.path} (step {state.step})", file=sys.stderr)
        if superseded := _supersede(out, svc.store, ready.start):
            print(f"lit: {superseded}", file=sys.stderr)
        log = MetricsLog(out.metrics, trainers.policy.accelerator, cfg.train.trackers, settings,
                         first_step=state.step + 1 if ready.start else 0,
                         wandb_id=_wandb_run(out, go_on=ready.start is not None and not superseded)
                         if "wandb" in cfg.train.trackers else None)
        last_val = _train(cfg, ready, state, trainers, svc, log)
        log.close()
    trainers.finish()
    _say_what_next(cfg, out)
    return last_val


def _policy(cfg: TrainConfig, ready: Ready) -> Policy:
    """The policy the run trains: from the model, or a full fine-tune's checkpoint (a LoRA policy resumes as the
    base model plus the checkpoint's adapter, which ``Trainers.restore`` loads); the KL reference is the initial
    weights. Before vLLM starts: one checkpoint of it fits on the disk, or it raises."""
    start = ready.start
    policy_cfg = replace(cfg.policy, model=str(start.model_dir)) if start and not cfg.policy.lora_rank else cfg.policy
    roles = cfg.role_table
    policy = Policy(policy_cfg, cfg.train.trackers, project_dir=str(ready.out.dir),
                    reference=str(ready.base_dir) if cfg.loss.kl_beta > 0 else None,
                    adapters=roles.adapter_map() if roles else None)
    room = ckpt.check_room(ready.out, ckpt.size_estimate(policy.memory.parameters, policy.memory.trained),
                           cfg.train.keep_checkpoints,
                           ckpt.saves_left(start.step if start else 0, cfg.train.steps, cfg.train.checkpoint_every))
    if room and policy.accelerator.is_main_process:
        print(f"lit: warning: {room}", file=sys.stderr)
    return policy


def _train(cfg: TrainConfig, ready: Ready, state: ckpt.TrainState, trainers: Trainers, svc: Services,
           log: MetricsLog) -> dict[str, Any]:
    """The steps from ``state`` to the end: rollouts, update, push, log, validation and checkpoints when due; the
    last validation's metrics."""
    train, last_val = cfg.train, {}
    if state.step == 0 and train.val_every:
        last_val = validate(svc.runner, ready.val_tasks, log, 0, state.minutes)
    curriculum = Curriculum(cfg.rollouts, train.success_reward) if cfg.rollouts.rest_after else None
    if curriculum:
        curriculum.load(state.curriculum)  # what rested when the checkpoint was written
    plan = StepPlan(cfg.rollouts, train.steps, train.seed, cfg.agent.temperature)
    encode = reference_encoder(ready.base_dir) if ready.references else None
    demos, state = _demonstrations(cfg, ready, svc, log, state)
    # leaving on an error, the rollouts running ahead end before the services stop under them (StepFeed.abort)
    with StepFeed(svc.runner, ready.train_tasks, plan, curriculum) as feed:
        print(f"lit: {STEP_LINE_LEGEND}", file=sys.stderr)
        while not _done(train, state):
            t0, restarts, step = time.perf_counter(), svc.fleet.restarts, state.step + 1
            phase = "sft" if step <= cfg.sft.steps else "rl"
            metrics = (_sft_step(cfg, step, demos, trainers, svc) if phase == "sft" else
                       _step(cfg, step, feed.take(state.step), trainers, svc, ready, encode, demos))
            minutes = state.minutes + (time.perf_counter() - t0) / 60
            state = ckpt.TrainState(step, minutes, str(step), curriculum.state() if curriculum else None, phase)
            metrics.update({"engine/restarts": float(svc.fleet.restarts - restarts),
                            "engine/serving": float(len(svc.fleet.serving)), "minutes": minutes,
                            **memory_gb(svc.fleet.pids)})
            log.log(step, metrics, kind="sft" if phase == "sft" else "train")
            print(step_line(step, train.steps, metrics), flush=True)
            if train.val_every and (step % train.val_every == 0 or _done(train, state)):
                feed.finish_ahead()  # validation needs the workers to itself
                last_val = validate(svc.runner, ready.val_tasks, log, step, minutes)
            if _done(train, state) or (train.checkpoint_every and step % train.checkpoint_every == 0):
                trainers.save(ready.out.dir, ready.base_dir, state, train.keep_checkpoints)
    return last_val


def _demonstrations(cfg: TrainConfig, ready: Ready, svc: Services, log: MetricsLog, state: ckpt.TrainState
                    ) -> tuple[list[Transition], ckpt.TrainState]:
    """The run's demonstrations (``[sft]``): those it collected before, or collected now (their minutes counted)
    and saved for a resume; and the state with those minutes."""
    if not cfg.sft.on:
        return [], state
    path = ready.out.demonstrations
    if ready.start and path.exists():  # a run started over collects them again: its config may have changed
        demos = demonstrations.load(path)
        print(f"lit: {len(demos)} demonstrations read back from {path}", file=sys.stderr)
        return demos, state
    t0 = time.perf_counter()
    demos, metrics = demonstration_sources.collect(cfg.sft, svc.runner, ready.train_tasks, ready.base_dir,
                                                   cfg.train.success_reward, cfg.inference.max_model_len)
    demonstrations.save(path, demos)
    seconds = time.perf_counter() - t0
    log.log(state.step, {**metrics, "time/collect": seconds}, kind="demonstrations")
    print(f"lit: {len(demos)} demonstrations from sft.source = {cfg.sft.source!r} in {seconds:.0f} s, saved to "
          f"{path}", file=sys.stderr)
    return demos, replace(state, minutes=state.minutes + seconds / 60)


def _sft_step(cfg: TrainConfig, step: int, demos: list[Transition], trainers: Trainers, svc: Services
              ) -> dict[str, float]:
    """One SFT step: an optimizer step on a batch of demonstrations, the push into vLLM and the sync check when
    due; its metrics."""
    chosen = step_batch(demos, cfg.sft.batch_size, step, cfg.train.seed)
    job = pipeline.UpdateJob([], _pad_id(trainers.policy), seed=cfg.train.seed * 100_003 + step,
                             learning_rate=cfg.sft.learning_rate or cfg.policy.learning_rate, demos=chosen, sft=True)
    metrics = update_and_push(job, cfg, step, trainers, svc)
    pairs = [(t, 0.0) for t in chosen]
    return {**metrics, **pipeline.check(svc.fleet, trainers.policy, pairs, cfg, step, trainers.score)}


def _step(cfg: TrainConfig, step: int, batch: RolloutBatch, trainers: Trainers, svc: Services, ready: Ready,
          encode: Callable[[str], list[int]] | None, demos: list[Transition]) -> dict[str, float]:
    """One step after its rollouts: the episodes prepared (LightningRL), the update (with the SFT term on a batch
    of ``demos``, ``sft.weight``), the push into vLLM and the sync check when due; the step's metrics."""
    nothing = batch.nothing_to_train()
    if nothing:  # a broken agent, tasks it cannot run, a wrong agent.agents: stop now, not after N
        raise RolloutsFailed(f"step {step}: {nothing}. No step can train on that: fix the agent or the config (run "
                             "the agent on one task with lit_trainer.Playground: it shows the error, or the spans "
                             f"and the episode), then start again; every rollout is in {ready.out.store} (lit show "
                             f"--run {ready.out.dir})")
    episodes, guided = batch.episodes, {}
    if encode:  # a reference for each failed group whose task has one
        more, guided = guide(episodes, ready.references, encode, cfg.train.success_reward, cfg.rollouts.min_group_size)
        episodes = episodes + more
    if step == cfg.sft.steps + 1 and (silent := _silent_roles(cfg, episodes)):
        print(f"lit: warning: {silent}", file=sys.stderr)
    work = pipeline.prepare(episodes, cfg, step, batch.dispatched_version)
    svc.store.save_advantages(work.advantages)
    metrics = {**batch.metrics, **guided, **work.metrics}
    sft = step_batch(demos, cfg.sft.batch_size, step, cfg.train.seed) if cfg.sft.weight else []
    if work.trains or sft:
        job = pipeline.UpdateJob(work.pairs, _pad_id(trainers.policy), seed=cfg.train.seed * 100_003 + step,
                                 learning_rate=pipeline.learning_rate(cfg, step), demos=sft, sft_weight=cfg.sft.weight)
        metrics.update(update_and_push(job, cfg, step, trainers, svc))
        pairs = work.pairs or [(t, 0.0) for t in sft]
        metrics.update(pipeline.check(svc.fleet, trainers.policy, pairs, cfg, step, trainers.score))
    return metrics


def update_and_push(job: pipeline.UpdateJob, cfg: TrainConfig, step: int, trainers: Trainers, svc: Services
                    ) -> dict[str, float]:
    """The update, then its weights pushed into every server; the fleet held meanwhile (no server is started again
    with weights half updated: asynchronous rollouts), its local servers asleep during the update with
    ``inference.layout = "colocated"`` (``Fleet.asleep``)."""
    with svc.fleet.hold():
        with svc.fleet.asleep():
            metrics = trainers.update(job, cfg, svc.store)
        metrics.update(pipeline.push(svc.fleet, trainers.gather(), step))
    return metrics


def _silent_roles(cfg: TrainConfig, episodes: list[Any]) -> str:
    """The trained agents of the ``[roles]`` table that no call of the first step's rollouts came from, in words
    ("" when every one called): their adapters would train on nothing."""
    roles = cfg.role_table
    if roles is None:
        return ""
    seen = {t.agent for e in episodes for t in e.transitions}
    silent = [agent for agent in roles.trained_agents if agent not in seen]
    if not silent:
        return ""
    return (f"the [roles] table trains {silent}, but no call of the first step came from "
            f"{'it' if len(silent) == 1 else 'them'} (the trained agents that called: {sorted(seen) or 'none'}): "
            "an adapter trains on nothing until its agent calls. Is the name the one lit records? (lit show shows "
            "each call's agent)")


def _done(train: TrainLoopConfig, state: ckpt.TrainState) -> bool:
    """Whether the run has trained to ``train.steps``, or for ``train.max_minutes``."""
    return state.step >= train.steps or bool(train.max_minutes and state.minutes >= train.max_minutes)


def _say_what_next(cfg: TrainConfig, out: RunFolder) -> None:
    """The curve, and the commands that evaluate, show and go on with the trained run."""
    png = plot_curve(out.metrics, out.curve, title=f"{cfg.agent.function or cfg.agent.command} on {cfg.model}")
    if png:
        print(f"lit: curve written to {png}", file=sys.stderr)
    final = out.latest_checkpoint()
    if final is not None:
        model = (f"the adapters of the [roles] table are in {final.adapters_path} (peft's format, on {cfg.model})"
                 if cfg.roles else f"the model is {final.model_dir} (a Hugging Face folder)")
        print(f"lit: trained to step {final.step}: {model}. Next: "
              f"`{_command(cfg, 'eval', '--checkpoint', str(out.dir))}` evaluates it, "
              f"`{shlex.join(['lit', 'show', '--run', str(out.dir)])}` shows its rollouts, "
              f"`{_command(cfg, 'train', '--resume', f'train.steps={final.step * 2}')}` trains on", file=sys.stderr)


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


def _pad_id(policy: Policy) -> int:
    config = policy.unwrapped().config
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    return int(pad[0] if isinstance(pad, list) else pad or 0)
