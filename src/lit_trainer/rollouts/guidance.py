"""Off-policy guidance (LUFFY's idea, in its simplest form): a group whose every rollout failed teaches GRPO nothing
(equal returns, advantages 0), however often the task comes back. When the task carries a ``reference``, the
response a correct agent gives to its first LLM call, ``guide`` adds one episode to that group: the first call's
prompt, as the engine saw it in one of the group's own rollouts, with the reference's tokens as the response, and a
return of ``success_reward``. The group's returns then differ: the reference gets a positive advantage and the
failed rollouts a negative one, so the policy is pulled towards the reference and away from its own mistakes.

The added episode's call was not sampled: it has no behaviour logprobs (``Transition.guided``). The learner gives
it the trainer's own logprobs before the update (``learner/schedule.fill_guided_logprobs``), so its importance
ratio starts at 1 and its gradient is the advantage times ∇log π of the reference's tokens (its tokens count
with a gap of 0 in the trainer-vs-vLLM metrics, ``policy/vllm_logprob_gap``). Its return is not
checked by running the agent: the reference is the task author's word. Only the first call is guided: an agent that
makes several calls gets the reference as its first call's response, the rest of its episode left out. Validation
is never guided.

A task's ``reference`` is text: lit tokenizes it with the policy's tokenizer and ends it with the end-of-turn token
(``encode``), as the engine's own responses end. It must be exactly what the agent's LLM call would answer, in the
model's format (a tool call as the chat template renders one, for instance).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from lit_trainer.intake.episodes import Episode

GUIDED_SUFFIX = ":guided"
"""Appended to the rollout id of the episode a guided episode's prompt comes from: its own rollout id."""


def check_references(tasks: Iterable[dict]) -> str | None:
    """Why ``tasks`` (the training split) cannot be guided, in words; None when at least one task carries a
    ``reference`` and every reference given is a non-empty string."""
    count = 0
    for task in tasks:
        if "reference" not in task or task["reference"] is None:
            continue
        if not isinstance(task["reference"], str) or not task["reference"].strip():
            return (f"task {task['id']!r} has reference = {task['reference']!r}: a reference must be the text of "
                    "the agent's first LLM call's response (a non-empty string)")
        count += 1
    if not count:
        return ("rollouts.guidance is on but no training task has a 'reference' (the response a correct agent gives to "
                "its first LLM call): add one to the tasks, or set rollouts.guidance = false")
    return None


def reference_encoder(model_dir: str | Path) -> Callable[[str], list[int]]:
    """``guide``'s ``encode`` for the model in ``model_dir``: a reference's token ids under the model's tokenizer,
    without special tokens at the start, then its end-of-turn token (the tokenizer's ``eos_token``), as the
    engine's responses end."""
    tokenizer = tokenizer_with_end(model_dir)
    end = tokenizer.eos_token_id

    def encode(text: str) -> list[int]:
        return [*tokenizer.encode(text, add_special_tokens=False), int(end)]

    return encode


def tokenizer_with_end(model_dir: str | Path) -> Any:
    """The tokenizer of the model in ``model_dir``; ValueError when it has no end-of-turn token (``eos_token``),
    with which a reference or a demonstration must end as the engine's responses do."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.eos_token is None or tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer of {model_dir} has no eos_token, so lit cannot end a reference or a "
                         "demonstration as the engine ends a response: rollouts.guidance and [sft] need a model "
                         "with an end-of-turn token (set rollouts.guidance = false and leave [sft] out)")
    return tokenizer


def references_of(tasks: Iterable[dict]) -> dict[str, str]:
    """Each task's ``reference``, by task id, for the tasks that have one."""
    return {str(task["id"]): task["reference"] for task in tasks if task.get("reference") is not None}


def guide(episodes: Sequence[Episode], references: Mapping[str, str], encode: Callable[[str], list[int]],
          success_reward: float, min_group_size: int) -> tuple[list[Episode], dict[str, float]]:
    """The guided episodes of a step (module docstring): one for each group of ``episodes`` whose task has a
    reference in ``references`` (by task id), of at least ``min_group_size`` (and two) episodes, each with a return
    below ``success_reward``, in the order of the task ids. The prompt comes from the group's first episode by
    rollout id that has a transition. ``encode``: a reference's response token ids. Metrics: ``guidance/groups``
    (guided) and ``guidance/failed_groups`` (every rollout failed, guided or not: a task without a reference is
    not)."""
    by_task: dict[str, list[Episode]] = {}
    for episode in episodes:
        by_task.setdefault(episode.task_id, []).append(episode)
    guided: list[Episode] = []
    failed = 0
    for task_id, group in sorted(by_task.items()):
        if len(group) < max(min_group_size, 2) or max(e.episode_return for e in group) >= success_reward:
            continue
        failed += 1
        template = min((e for e in group if e.transitions), key=lambda e: e.rollout_id, default=None)
        if task_id not in references or template is None:
            continue
        rollout_id = template.rollout_id + GUIDED_SUFFIX
        call = replace(template.transitions[0], response_ids=encode(references[task_id]), logprobs=None,
                       reward=None, rollout_id=rollout_id, index=0, tool_errors=0, other_errors=0,
                       finish_reason="stop", guided=True)
        # the return as the traced function's: credit adds it at the (only) call, whatever the mode
        guided.append(Episode(rollout_id, task_id, template.attempt, [call], success_reward, success_reward))
    return guided, {"guidance/groups": float(len(guided)), "guidance/failed_groups": float(failed)}
