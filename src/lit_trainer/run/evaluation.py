"""Validation during training and ``lit eval``: one greedy rollout per held-out task, accuracy over all of them
(a failed rollout counts as wrong, and is reported), and per task kind when the tasks carry a ``"kind"``."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from lit_trainer.config import TrainConfig
from lit_trainer.learner import checkpoint as ckpt
from lit_trainer.models.folders import check_context, check_model_folder, resolve_model
from lit_trainer.progress import quiet_library_bars
from lit_trainer.results.metrics import MetricsLog
from lit_trainer.results.runs import Checkpoint, RunFolder, eval_folder, resolve_checkpoint
from lit_trainer.roles import Roles
from lit_trainer.rollouts.runner import RolloutRunner
from lit_trainer.rollouts.tasks import load_tasks
from lit_trainer.run.services import check_agent, services
from lit_trainer.steps import validation_label


def validate(runner: RolloutRunner, tasks: list[dict], log: MetricsLog, step: int, minutes: float,
             title: str = "") -> dict[str, float]:
    """One rollout per held-out task at ``agent.val_temperature`` (greedy by default); accuracy counts failed
    rollouts as wrong (and reports them), overall and per task kind (``accuracy/<kind>``, ``reward/<kind>``) when
    the tasks carry a ``"kind"``. ``title``: what the printed line says was validated (default: ``validation after
    step N``)."""
    t0 = time.perf_counter()
    batch = runner.run(tasks, 1, runner.agent.val_temperature, step, validation_label(step), version=step)
    metrics = batch.metrics
    metrics.update({"minutes": minutes, "time/validation": time.perf_counter() - t0})
    log.log(step, metrics, kind="validation")
    print(f"{title or f'validation after step {step}'}: {accuracy_line(metrics)} on {len(tasks)} held-out tasks "
          f"(failed {metrics['rollouts/failed']:.0f}, {metrics['time/validation']:.0f} s)", flush=True)
    if batch.failures:  # why, not only how many (a task's data the agent cannot read, say)
        first = batch.failures[0].strip().splitlines() or [""]
        print(f"lit: the first held-out rollout that failed: {first[-1][:300]}", file=sys.stderr, flush=True)
    return metrics


def accuracy_line(metrics: dict[str, float]) -> str:
    """``accuracy 0.516 (in_template 0.625, out_of_template 0.406)``: the accuracy, then that of each task kind
    (``accuracy/<kind>``) when the tasks have kinds."""
    kinds = [f"{key.removeprefix('accuracy/')} {value:.3f}" for key, value in metrics.items()
             if key.startswith("accuracy/")]
    return f"accuracy {metrics['accuracy']:.3f}" + (f" ({', '.join(kinds)})" if kinds else "")


def described(found: Checkpoint) -> tuple[str, str]:
    """How ``lit eval`` names a checkpoint, and its phase: ``sft`` (an SFT step's, said in the name), ``rl``, or
    ``unknown`` for a folder without a training state."""
    phase = ckpt.saved_state(found).phase if found.state_file.is_file() else "unknown"
    return f"checkpoint {found.path} (step {found.step}{', an SFT step' if phase == 'sft' else ''})", phase


def _frozen_roles(roles: Roles, found: Checkpoint) -> Roles:
    """The ``[roles]`` table with each trained adapter served from the checkpoint's folder of it."""
    folders = found.adapter_folders()
    missing = sorted(set(roles.adapters) - set(folders))
    if missing:
        raise ValueError(f"{found.path} holds no adapter {missing} of the [roles] table (it holds "
                         f"{sorted(folders) or 'none'}): evaluate it with the run's own config")
    return roles.frozen_into(folders)


def evaluate(cfg: TrainConfig, checkpoint: str | Path | None = None, output: Path | None = None,
             output_dir: str | Path | None = None) -> dict[str, Any]:
    """``lit eval``: validation of a checkpoint (a ``checkpoints/step-N`` folder or a run's output_dir: its
    latest) or of the base model when None; also written as JSON to ``output``. Its store, result and config go
    into ``output_dir``, by default beside the evaluated run (``runs.eval_folder``: ``RUN/eval/step-N``), where
    ``lit show --run`` opens them. The result holds the metrics and what was evaluated: ``model`` (the folder vLLM
    served), ``evaluated`` (in words), ``step`` (the checkpoint's, 0 for the base model), ``phase``
    (``described``; ``base`` for the base model), ``tasks`` and ``output_dir``."""
    quiet_library_bars()
    model, step, what, found, phase = cfg.model, 0, f"the base model {cfg.model}", None, "base"
    if checkpoint:
        found = resolve_checkpoint(checkpoint)
        step = found.step
        what, phase = described(found)
        if not cfg.roles:
            model = str(found.model_dir)
            cfg = replace(cfg, model=model, inference=replace(cfg.inference, model=model))
    if roles := cfg.role_table:  # the base model with the checkpoint's adapters, served as fixed ones
        served = _frozen_roles(roles, found) if found else roles.on_base()
        cfg = replace(cfg, roles=dict(served.table), agent=replace(cfg.agent, agents=()))
    run = RunFolder(output_dir or eval_folder(found, cfg.train.output_dir))
    if run.store.exists():  # a training run's store: lit show would open it, not the eval's
        raise ValueError(f"{run.dir} holds a training run ({run.store.name}): lit eval writes a folder of its own; "
                         "leave train.output_dir out (default: beside the evaluated run) or name another folder")
    cfg = replace(cfg, train=replace(cfg.train, output_dir=str(run.dir)))
    _, val_tasks = load_tasks(cfg.data)
    check_agent(cfg)
    served = resolve_model(model)
    check_model_folder(served)  # what vLLM serves: before it starts, in one line
    check_context(served, cfg.inference.max_model_len)
    run.create()
    with run.in_use("lit eval"):  # another lit eval of the same checkpoint stops at once
        run.save_config(cfg.to_dict())  # the model whose tokens lit show decodes
        log = MetricsLog(run.eval_metrics)
        with services(cfg, run.eval_store, run.spool, run.keys) as svc:
            metrics = validate(svc.runner, val_tasks, log, step, 0.0, title=what)
    result = {"model": model, "evaluated": what, "step": step, "phase": phase, "tasks": len(val_tasks),
              "output_dir": str(run.dir), **metrics}
    if output:
        output.write_text(json.dumps(result, indent=2))
    return result
