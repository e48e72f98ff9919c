"""Transitions → padded tensors, packed into micro-batches under a token budget.

Each transition becomes one row ``prompt_ids + response_ids``, right-padded. All per-token tensors are in *token
space*: position t describes token ``input_ids[t]``, so ``old_logprobs[b, t]`` is the behaviour policy's logprob of
that token given the tokens before it, and ``response_mask[b, t]`` is 1 exactly where ``input_ids[b, t]`` is a
response token. Prompt tokens and padding are masked: only the tokens the policy chose are trained on. (The policy
shifts logits by one to produce the same token-space logprobs; see ``policy.token_logprobs``.)

A prompt longer than ``max_prompt_tokens`` is rejected with a message, unless ``truncate_prompt_left`` is set, in
which case its oldest tokens are dropped (the behaviour logprobs then no longer describe exactly this context: that
is why it is opt-in). The training loop first passes a step's transitions through ``keep_usable``, which skips and
counts the ones that cannot be trained on (``unusable``: that prompt, missing logprobs...), so that one bad
transition never aborts a run. Token ids and numbers in, tensors out.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lit_trainer.intake.episodes import Transition

log = logging.getLogger("lit")


@dataclass(frozen=True)
class BatchingConfig:
    max_tokens_per_micro_batch: int = 2048
    """Budget of one micro-batch: rows x padded length stays at or under it (a single longer row gets its own)."""
    max_prompt_tokens: int = 1536
    """Longest prompt accepted; longer ones are rejected unless ``truncate_prompt_left``."""
    truncate_prompt_left: bool = False
    """Drop the oldest prompt tokens beyond ``max_prompt_tokens`` instead of rejecting the transition."""

    def __post_init__(self) -> None:
        if self.max_tokens_per_micro_batch < 2:
            raise ValueError("BatchingConfig.max_tokens_per_micro_batch must be at least 2")
        if self.max_prompt_tokens < 1:
            raise ValueError("BatchingConfig.max_prompt_tokens must be at least 1")


class PromptTooLong(ValueError):
    """A transition's prompt is over ``BatchingConfig.max_prompt_tokens``."""


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long: 1 for real tokens
    response_mask: torch.Tensor  # (B, T) float: 1 for response tokens
    old_logprobs: torch.Tensor  # (B, T) float: behaviour logprobs at response positions, 0 elsewhere
    advantages: torch.Tensor  # (B,) float
    index: list[int]
    """Which of the input transitions each row is (for metrics and debugging)."""

    @property
    def n_response_tokens(self) -> int:
        return int(self.response_mask.sum().item())


def make_micro_batches(
    transitions: Sequence[Transition],
    advantages: Sequence[float] | torch.Tensor,
    config: BatchingConfig,
    pad_id: int,
) -> list[MicroBatch]:
    """Pack transitions (with one advantage each) into micro-batches; rows of similar length go together."""
    assert len(transitions) == len(advantages), f"{len(transitions)} transitions, {len(advantages)} advantages"
    rows = [_row(t, config) for t in transitions]
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    batches, current, longest = [], [], 0
    for i in order:
        length = len(rows[i][0])
        if current and max(longest, length) * (len(current) + 1) > config.max_tokens_per_micro_batch:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        batches.append(current)
    adv = torch.as_tensor(advantages, dtype=torch.float32)  # (N,)
    return [_collate(group, rows, adv, pad_id) for group in batches]


def unusable(t: Transition, config: BatchingConfig) -> str | None:
    """Why ``t`` cannot be trained on, as a metric name, or None: ``empty`` (no prompt or no response tokens),
    ``no_logprobs`` (its engine returned no behaviour logprobs), ``logprobs_length`` (not one per response token),
    ``prompt_too_long`` (over ``max_prompt_tokens`` without ``truncate_prompt_left``)."""
    if not t.response_ids or not t.prompt_ids:
        return "empty"
    if t.logprobs is None:
        return "no_logprobs"
    if len(t.logprobs) != len(t.response_ids):
        return "logprobs_length"
    if len(t.prompt_ids) > config.max_prompt_tokens and not config.truncate_prompt_left:
        return "prompt_too_long"
    return None


def explain(t: Transition, reason: str, config: BatchingConfig) -> str:
    """``unusable``'s reason in words, naming the transition and what to change."""
    where = f"transition {t.rollout_id}#{t.index}"
    return {
        "empty": f"{where} has an empty prompt or response",
        "no_logprobs": f"{where} has no behaviour logprobs: its engine did not return them (lit asks vLLM for them; "
                       "check that the agent's calls go to the lit-managed server)",
        "logprobs_length": f"{where} has {len(t.logprobs or [])} behaviour logprobs for {len(t.response_ids)} "
                           "response tokens",
        "prompt_too_long": f"{where} has a {len(t.prompt_ids)}-token prompt, over BatchingConfig.max_prompt_tokens="
                           f"{config.max_prompt_tokens}; raise it, or set truncate_prompt_left = true to drop the "
                           "oldest tokens",
    }[reason]


def keep_usable(pairs: Sequence[tuple[Transition, float]], config: BatchingConfig
                ) -> tuple[list[tuple[Transition, float]], collections.Counter[str]]:
    """The (transition, advantage) pairs that can be trained on, and how many of the others were skipped, by
    ``unusable``'s reason. One bad transition costs itself, never the step: the first of each reason is logged."""
    kept: list[tuple[Transition, float]] = []
    skipped: collections.Counter[str] = collections.Counter()
    for t, advantage in pairs:
        reason = unusable(t, config)
        if reason is None:
            kept.append((t, advantage))
            continue
        if not skipped[reason]:
            log.warning("lit: skipping a transition this step (update/skipped_%s): %s", reason, explain(t, reason,
                                                                                                      config))
        skipped[reason] += 1
    return kept, skipped


def _row(t: Transition, config: BatchingConfig) -> tuple[list[int], int, list[float]]:
    """(ids, where the response starts, behaviour logprobs of the response)."""
    reason = unusable(t, config)
    if reason is not None:
        raise (PromptTooLong if reason == "prompt_too_long" else ValueError)(explain(t, reason, config))
    prompt = list(t.prompt_ids)[-config.max_prompt_tokens :]
    return prompt + list(t.response_ids), len(prompt), list(t.logprobs or [])


def _collate(group: list[int], rows: list, adv: torch.Tensor, pad_id: int) -> MicroBatch:
    width = max(len(rows[i][0]) for i in group)
    n = len(group)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)  # (B, T)
    attention = torch.zeros((n, width), dtype=torch.long)  # (B, T)
    response = torch.zeros((n, width), dtype=torch.float32)  # (B, T)
    old = torch.zeros((n, width), dtype=torch.float32)  # (B, T)
    for b, i in enumerate(group):
        ids, start, logprobs = rows[i]
        input_ids[b, : len(ids)] = torch.tensor(ids)
        attention[b, : len(ids)] = 1
        response[b, start : len(ids)] = 1.0
        old[b, start : len(ids)] = torch.tensor(logprobs)
    return MicroBatch(input_ids, attention, response, old, adv[group], list(group))
