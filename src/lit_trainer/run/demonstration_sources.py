"""Where a run's demonstrations come from (``sft.source``, rollouts/demonstrations.py): the agent's rollouts with
the tasks' references, a teacher's rollouts, or an earlier run's store; collected once before the first step."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lit_trainer.intake.episodes import Episode, Transition
from lit_trainer.intake.rows import RolloutStatus
from lit_trainer.results.runs import Run
from lit_trainer.rollouts.demonstrations import SftConfig, demonstration, from_references, refuse_unfit
from lit_trainer.rollouts.guidance import reference_encoder, references_of
from lit_trainer.rollouts.runner import RolloutRunner
from lit_trainer.rollouts.teacher import collect as from_teacher
from lit_trainer.steps import demonstrations_label


def collect(sft: SftConfig, runner: RolloutRunner, tasks: list[dict], model_dir: Path, success_reward: float,
            context: int) -> tuple[list[Transition], dict[str, float]]:
    """The demonstrations of ``sft.source`` (module docstring) from the training ``tasks`` (the first
    ``sft.tasks``), and their metrics; ValueError when there are none, or one does not fit ``context``."""
    chosen = tasks[: sft.tasks] if sft.tasks else tasks
    metrics: dict[str, float] = {}
    if sft.source == "store":
        demos = from_store(sft.store, runner.agent.agents, success_reward)
    elif sft.source == "references":
        referenced = [task for task in chosen if task.get("reference") is not None]
        batch = runner.run(referenced, 1, runner.agent.val_temperature, 0, demonstrations_label(), version=0)
        demos = from_references(batch.episodes, references_of(referenced), reference_encoder(model_dir))
        metrics = {"sft/collect_rollouts": float(len(referenced)), "sft/collect_failed": float(len(batch.failures))}
    else:
        demos, metrics = from_teacher(runner, chosen, sft.teacher, runner.agent.val_temperature, success_reward,
                                      model_dir)
    if not demos:
        raise ValueError(f"sft.source = {sft.source!r} gave no demonstration (of the roles trained, "
                         f"agent.agents = {list(runner.agent.agents) or 'all'}): {NONE_WHY[sft.source]}")
    refuse_unfit(demos, context, sft.source)
    return demos, {**metrics, "sft/demonstrations_total": float(len(demos))}


NONE_WHY = {"store": "did the run in sft.store have training rollouts whose return reached train.success_reward?",
            "references": "did the agent's rollouts fail, or make no LLM call of a role its reference names? "
                          "lit show --run OUTPUT_DIR lists them",
            "teacher": "did the teacher's rollouts fail, or none reach train.success_reward?"}


def from_store(run_dir: str | Path, agents: Sequence[str], success_reward: float) -> list[Transition]:
    """Every call of a trained role (``agents``: all when empty) of the training rollouts an earlier run stored in
    ``run_dir`` whose return reaches ``success_reward``, as demonstrations."""
    run = Run(run_dir)
    try:
        demos: list[Transition] = []
        for step in range(1, (run.last_step() or 0) + 1):
            for row in run.rollouts(step):
                if row.status is not RolloutStatus.SUCCEEDED:
                    continue
                episode = run.episode(row.rollout_id)
                if isinstance(episode, Episode) and episode.episode_return >= success_reward:
                    demos += [demonstration(t) for t in episode.transitions if not agents or t.agent in agents]
        return demos
    finally:
        run.close()
