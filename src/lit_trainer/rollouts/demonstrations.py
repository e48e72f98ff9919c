"""Demonstrations: transitions (prompt ids, response ids) the policy is taught by supervised fine-tuning, for what
it cannot yet sample and so RL alone never reinforces (the ``[sft]`` section).

Where they come from (``sft.source``):

- ``references``: each training task's ``reference``, the answer a correct agent gives. Text: the response to the
  agent's first LLM call; a table ``{role: text}``: the response to the first call of each role named (the SQL
  writer's gold query, say). lit runs the agent once on each task, with the untrained model at
  ``agent.val_temperature``, to learn each call's prompt as the engine sees it (the agent's code is unchanged);
  the reference's tokens (``guidance.reference_encoder``) replace the model's answer.
- ``teacher``: the user's agent run against another OpenAI-compatible endpoint (``rollouts/teacher.py``); the
  calls of the rollouts whose return reaches ``train.success_reward``, in the trained model's tokens.
- ``store``: an earlier run's stored training rollouts (``sft.store``: its output folder) whose return reaches
  ``train.success_reward``: every call of a trained role, as the engine recorded it. The earlier run must have
  served the same model (its token ids are that model's).

A demonstration teaches only a trained role (``agent.agents``) and must fit ``inference.max_model_len``, else it
is refused at load with its position. They are collected once, before the first step
(``run/demonstration_sources.py``), into the run's ``demonstrations.jsonl``, which ``--resume`` reads back instead
of collecting again.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lit_trainer.intake.episodes import Episode, Transition
from lit_trainer.rollouts.teacher import Teacher
from lit_trainer.settings import at_least, check, one_of

SOURCES = ("", "references", "teacher", "store")


@dataclass(frozen=True)
class SftConfig:
    """Supervised fine-tuning on demonstrations: a warm-start before RL, and a term beside it."""

    SECTION = "sft"
    RULES = {"source": one_of(SOURCES, "('': no demonstrations)"), "steps": at_least(0, "(0: no SFT phase)"),
             "batch_size": at_least(1), "learning_rate": at_least(0, "(0: policy.learning_rate)"),
             "weight": at_least(0, "(0: no SFT term during RL)"), "tasks": at_least(0, "(0: every training task)")}

    source: str = ""
    """Where the demonstrations come from: ``references`` (each training task's reference answer), ``teacher`` (your
    agent run against another endpoint) or ``store`` (an earlier run's successful rollouts); '': none."""
    steps: int = 0
    """The first this many of ``train.steps`` are SFT steps: one optimizer step each on ``batch_size``
    demonstrations (token-level NLL of their response tokens, taken in order, reshuffled each pass), then the weight
    sync, validation and checkpoints as for an RL step. The RL steps follow. ``train.steps`` = ``sft.steps``:
    SFT only."""
    batch_size: int = 32
    """Demonstrations per SFT step, and per RL step for the SFT term (``weight``)."""
    learning_rate: float = 0.0
    """The SFT steps' learning rate (constant); 0: ``policy.learning_rate``."""
    weight: float = 0.0
    """During RL, each step's loss adds this times the NLL of ``batch_size`` demonstrations (one optimizer step for
    both). 0: RL alone after the SFT steps."""
    tasks: int = 0
    """Demonstrations are collected from the first this many training tasks (references, teacher); 0: all."""
    teacher_url: str = ""
    """``teacher``: the OpenAI-compatible base URL of the teacher (``https://api.example.com/v1``)."""
    teacher_model: str = ""
    """``teacher``: the model name the teacher's requests carry."""
    teacher_api_key_env: str = ""
    """``teacher``: the environment variable holding its API key (it stays in the trainer); '': none is sent."""
    store: str = ""
    """``store``: an earlier run's ``train.output_dir``, whose successful training rollouts are demonstrations."""

    def __post_init__(self) -> None:
        check(self)
        needs = {"teacher": ("teacher_url", "teacher_model"), "store": ("store",)}.get(self.source, ())
        for key in needs:
            if not getattr(self, key).strip():
                raise ValueError(f"sft.source = {self.source!r} needs sft.{key}")
        if not self.source and (self.steps or self.weight):
            raise ValueError("sft.steps and sft.weight train on demonstrations: set sft.source to 'references', "
                             "'teacher' or 'store', or leave them at 0")
        if self.source and not (self.steps or self.weight):
            raise ValueError(f"sft.source = {self.source!r} collects demonstrations nothing trains on: set sft.steps "
                             "(an SFT phase before RL) or sft.weight (an SFT term during RL)")

    @property
    def on(self) -> bool:
        return bool(self.source)

    @property
    def teacher(self) -> Teacher | None:
        """The teacher of ``source = "teacher"``; None for the other sources."""
        return Teacher(self.teacher_url, self.teacher_model, self.teacher_api_key_env) if self.source == "teacher" \
            else None


def check_task_references(tasks: Sequence[dict], agents: Sequence[str]) -> str | None:
    """Why the training ``tasks`` cannot give demonstrations from their ``reference`` (with the task's position), or
    None. A reference is text, or a table of texts by role; a role must be trained (``agents``: all when empty)."""
    count = 0
    for position, task in enumerate(tasks, 1):
        reference = task.get("reference")
        if reference is None:
            continue
        where = f"training task {position} (id {task.get('id')!r})"
        texts = reference if isinstance(reference, dict) else {"": reference}
        for role, text in texts.items():
            if not isinstance(text, str) or not text.strip():
                return f"{where} has reference {reference!r}: each must be a non-empty text, in the model's format"
            if role and agents and role not in agents:
                return (f"{where} has a reference for role {role!r}, which is not trained (agent.agents = "
                        f"{list(agents)}): add it to agent.agents or drop that reference")
        count += 1
    if not count:
        return ("sft.source = 'references' but no training task has a 'reference' (the answer a correct agent gives: "
                "text, or a table {role: text}): add them to the tasks, or choose another sft.source")
    return None


def from_references(episodes: Iterable[Episode], references: Mapping[str, Any],
                    encode: Callable[[str], list[int]]) -> list[Transition]:
    """A demonstration per reference of each episode's task: the first call (of its role, for a table) with the
    reference's tokens as the response."""
    demos: list[Transition] = []
    for episode in episodes:
        reference = references.get(episode.task_id)
        texts = reference if isinstance(reference, dict) else {"": reference} if reference else {}
        for role, text in texts.items():
            call = next((t for t in episode.transitions if not role or t.agent == role), None)
            if call is not None:
                demos.append(demonstration(call, encode(text)))
    return demos


def demonstration(call: Transition, response_ids: list[int] | None = None) -> Transition:
    """``call`` as a demonstration: its prompt, ``response_ids`` (default its own), no behaviour logprobs."""
    response = list(call.response_ids if response_ids is None else response_ids)
    return replace(call, response_ids=response, logprobs=None, reward=None, tool_errors=0, other_errors=0,
                   finish_reason="stop", temperature=1.0, sampling_unsupported="", weight_version=None, guided=False)


def refuse_unfit(demos: Sequence[Transition], context: int, source: str) -> None:
    """ValueError naming the first demonstration longer than ``context`` (``inference.max_model_len``) tokens."""
    for position, t in enumerate(demos, 1):
        length = len(t.prompt_ids) + len(t.response_ids)
        if length > context:
            raise ValueError(f"demonstration {position} from sft.source = {source!r} (task {t.task_id!r}, role "
                             f"{t.agent!r}) is {length} tokens, over inference.max_model_len = {context}: raise it, "
                             "or shorten that task's reference")


def batch_of(n: int, size: int, step: int, seed: int) -> list[int]:
    """The indices of the demonstrations (of ``n``) that SFT step ``step`` (from 1) trains on: ``size`` of them,
    taken in order from a shuffle of all ``n`` that changes each pass (seeded by ``seed`` and the pass), so every
    demonstration comes once per pass; fewer only when ``n < size``."""
    if n == 0:
        return []
    size = min(size, n)
    out: list[int] = []
    for k in range((step - 1) * size, step * size):
        order = list(range(n))
        random.Random(seed * 1_000_003 + k // n).shuffle(order)
        out.append(order[k % n])
    return out


def step_batch(demos: Sequence[Transition], size: int, step: int, seed: int) -> list[Transition]:
    """The demonstrations step ``step`` trains on (``batch_of``): an SFT step's, or an RL step's SFT term's."""
    return [demos[i] for i in batch_of(len(demos), size, step, seed)]


def save(path: Path, demos: Sequence[Transition]) -> None:
    """Write ``demos`` to ``path`` (JSON lines), atomically."""
    staging = path.with_name(f".tmp-{path.name}")
    with staging.open("w") as f:
        for t in demos:
            f.write(json.dumps({"task_id": t.task_id, "agent": t.agent, "rollout_id": t.rollout_id, "index": t.index,
                                "span_id": t.span_id, "prompt_ids": t.prompt_ids, "response_ids": t.response_ids})
                    + "\n")
    staging.replace(path)


def load(path: Path) -> list[Transition]:
    """The demonstrations ``save`` wrote to ``path``."""
    demos = []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        demos.append(Transition(d["prompt_ids"], d["response_ids"], None, None, d["agent"], d["rollout_id"],
                                d["task_id"], d["index"], d["span_id"], finish_reason="stop"))
    return demos
