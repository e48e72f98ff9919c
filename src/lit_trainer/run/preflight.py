"""Before the model loads: every check that needs neither the weights nor vLLM, so that a mistake in the config, the
data, the agent, the model folder or the run folder fails in seconds (``lit train`` runs them first; ``lit train
--check`` runs them alone and prints what they found, the memory plan included)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from lit_trainer.config import ConfigError, TrainConfig
from lit_trainer.learner import checkpoint as ckpt
from lit_trainer.learner import distributed
from lit_trainer.models.folders import ModelError, check_context, check_model_folder, resolve_model
from lit_trainer.results.runs import Checkpoint, RunFolder
from lit_trainer.results.trackers import check_wandb_login
from lit_trainer.rollouts.curriculum import check_rest_by
from lit_trainer.rollouts.demonstrations import check_task_references
from lit_trainer.rollouts.guidance import check_references, reference_encoder, references_of
from lit_trainer.rollouts.tasks import load_tasks
from lit_trainer.run.services import check_agent, check_ports


@dataclass
class Ready:
    """What the checks found: what the run starts from."""

    out: RunFolder
    start: Checkpoint | None
    """The checkpoint a --resume continues from."""
    train_tasks: list
    val_tasks: list
    references: dict
    """Each training task's reference answer, with ``rollouts.guidance``."""
    base_dir: Path | None
    """The model's folder; None when the run is already trained to ``train.steps`` (nothing to load)."""

    def lines(self, cfg: TrainConfig) -> list[str]:
        """What ``lit train --check`` prints, one line each."""
        out, start = self.out, self.start
        if self.base_dir is None:
            return [f"run folder: {out.dir}, already trained to step {start.step}: nothing to train"]
        where = (f"resumes from step {start.step} ({start.path})" if start else
                 "starts at step 1" + (" (what it holds of a run with no checkpoint is set aside)"
                                       if out.metrics.exists() else ""))
        lines = [f"tasks: {len(self.train_tasks)} for training, {len(self.val_tasks)} held out",
                 (f"agent: {cfg.agent.command} (a program run per rollout; found)" if cfg.agent.command else
                  f"agent: {cfg.agent.function} (imports; @lit.trace; takes (task, llm))"),
                 f"model: {self.base_dir} (its config and tokenizer; vLLM's max_model_len fits it)",
                 f"run folder: {out.dir}: {where}",
                 f"addresses: the collector's {cfg.collector.endpoint}, the dispatcher's "
                 f"{cfg.dispatch_endpoint.endpoint}, vLLM's port {cfg.inference.port or '(a free one)'}: free now"]
        if "wandb" in cfg.train.trackers:
            lines.append("W&B: credentials found (or offline)")
        return [*lines, f"policy: {memory_of(cfg)}"]


def preflight(cfg: TrainConfig, resume: bool, out: RunFolder) -> Ready:
    """Every check made before the model loads; what the run starts from. The run folder is read, not written."""
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
        return Ready(out, start, [], [], {}, None)
    if (roles := cfg.role_table) is not None and not roles.adapters:
        raise ConfigError("the [roles] table trains no agent: give at least one agent \"own\" or \"shared\"")
    train_tasks, val_tasks = load_tasks(cfg.data)
    if cfg.rollouts.rest_after and (problem := check_rest_by(train_tasks, cfg.rollouts.rest_by)):
        raise ConfigError(problem)
    if cfg.rollouts.guidance and (problem := check_references(train_tasks)):
        raise ConfigError(problem)
    if cfg.sft.source == "references" and (problem := check_task_references(train_tasks, cfg.agent.agents)):
        raise ConfigError(problem)
    if cfg.sft.source == "store" and (problem := check_store(cfg.sft.store, cfg.model)):
        raise ConfigError(problem)
    if cfg.sft.teacher_api_key_env and cfg.sft.teacher and not os.environ.get(cfg.sft.teacher_api_key_env):
        raise ConfigError(f"sft.teacher_api_key_env = {cfg.sft.teacher_api_key_env!r}: that environment variable is "
                          "not set here; export the teacher's API key in it, or leave the setting empty for a "
                          "teacher that needs none")
    check_agent(cfg)  # importable, @lit.trace, (task, llm)
    if distributed.is_launch_main():  # the process that starts the services and whose tracker logs
        check_ports(cfg)  # a busy fixed port
        check_wandb_login(cfg.train.trackers)
    base_dir = resolve_model(cfg.model)
    check_model_folder(base_dir, weights=False)  # vLLM serves it with its tokenizer; the policy checks the weights
    check_context(base_dir, cfg.inference.max_model_len)
    if cfg.sft.source == "references" and (problem := check_reference_lengths(train_tasks, base_dir,
                                                                              cfg.inference.max_model_len)):
        raise ConfigError(problem)
    if start is not None and (problem := ckpt.other_model(start, base_dir)):
        raise ConfigError(problem)
    references = references_of(train_tasks) if cfg.rollouts.guidance else {}
    return Ready(out, start, train_tasks, val_tasks, references, base_dir)


def check_store(run_dir: str, model: str) -> str | None:
    """Why ``sft.store`` cannot give demonstrations to a run of ``model``, or None: it is a run that served the same
    model (its token ids are that model's)."""
    out = RunFolder(run_dir)
    if not out.store.is_file():
        return f"sft.store = {run_dir!r} is not a run's output folder: it has no {out.store.name}"
    try:
        served = out.saved_config().get("model")
    except (OSError, ValueError):
        served = None
    if served is not None and served != model:
        return (f"sft.store = {run_dir!r} is a run of the model {served!r}, not {model!r}: its token ids are that "
                "model's; give a run of this model")
    return None


def check_reference_lengths(tasks: list[dict], model_dir: Path, context: int) -> str | None:
    """The first training task whose reference alone does not fit ``context`` tokens (``inference.max_model_len``)
    under the model's tokenizer, with its position; None when all do."""
    encode = reference_encoder(model_dir)
    for position, task in enumerate(tasks, 1):
        reference = task.get("reference")
        texts = reference.values() if isinstance(reference, dict) else [reference] if reference else []
        for text in texts:
            if len(encode(text)) >= context:
                return (f"training task {position} (id {task.get('id')!r}) has a reference of {len(encode(text))} "
                        f"tokens, which with any prompt is over inference.max_model_len = {context}")
    return None


def memory_of(cfg: TrainConfig) -> str:
    """What one trainer process of this config would hold for the policy (``policy.memory_plan``), in words; with
    ``policy.shard``, also what each process of a sharded launch would."""
    import torch

    from lit_trainer.learner import memory, precision
    from lit_trainer.learner.policy import memory_plan

    try:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        used = precision.resolve(cfg.policy.precision, device)
        reference = cfg.loss.kl_beta > 0
        plan = memory_plan(cfg.policy, used, reference)
        processes = max(2, torch.cuda.device_count())  # what a sharded launch would likely use here
        sharded = memory_plan(cfg.policy, used, reference, processes, sharded=True) if cfg.policy.shard else None
    except (ModelError, ValueError, OSError) as exc:
        return f"the policy's memory is not known here: {str(exc).splitlines()[0]}"
    line = f"{plan.describe()}: one process on {device}, {used}"
    if sharded is not None:
        line += (f"\n# sharded (policy.shard) over {processes} processes: about {sharded.total / memory.GB:.2f} GB "
                 f"each, and {sharded.gathered / memory.GB:.2f} GB more in the main process")
    return line
