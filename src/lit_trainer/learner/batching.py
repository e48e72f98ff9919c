"""Transitions → padded tensors, packed into micro-batches under a token budget.

Each transition becomes one row ``prompt_ids + response_ids``, right-padded. All per-token tensors are in *token
space*: position t describes token ``input_ids[t]``, so ``old_logprobs[b, t]`` is the behaviour policy's logprob of
that token given the tokens before it, and ``response_mask[b, t]`` is 1 exactly where ``input_ids[b, t]`` is a
response token. Prompt tokens and padding are masked: only the tokens the policy chose are trained on. (The policy
shifts logits by one to produce the same token-space logprobs; see ``policy.token_logprobs``.)

A prompt longer than ``max_prompt_tokens`` is rejected with a message, unless ``truncate_prompt_left`` is set, in
which case its oldest tokens are dropped (the behaviour logprobs then no longer describe exactly this context: that
is why it is opt-in). Token ids and numbers in, tensors out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lit_trainer.intake.episodes import Transition


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


def _row(t: Transition, config: BatchingConfig) -> tuple[list[int], int, list[float]]:
    """(ids, where the response starts, behaviour logprobs of the response)."""
    if not t.response_ids or not t.prompt_ids:
        raise ValueError(f"transition {t.rollout_id}#{t.index} has an empty prompt or response")
    if t.logprobs is None:
        raise ValueError(
            f"transition {t.rollout_id}#{t.index} has no behaviour logprobs: its engine did not return them "
            "(lit asks vLLM for them; check that the agent's calls go to the lit-managed server)"
        )
    prompt = list(t.prompt_ids)
    if len(prompt) > config.max_prompt_tokens:
        if not config.truncate_prompt_left:
            raise PromptTooLong(
                f"transition {t.rollout_id}#{t.index} has a {len(prompt)}-token prompt, over "
                f"BatchingConfig.max_prompt_tokens={config.max_prompt_tokens}; raise it, or set "
                "truncate_prompt_left = true to drop the oldest tokens"
            )
        prompt = prompt[-config.max_prompt_tokens :]
    return prompt + list(t.response_ids), len(prompt), list(t.logprobs)


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
