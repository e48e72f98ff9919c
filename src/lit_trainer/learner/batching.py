"""Transitions → padded tensors, packed into micro-batches under a token budget.

Each transition becomes one row ``prompt_ids + response_ids``, right-padded. All per-token tensors are in *token
space*: position t describes token ``input_ids[t]``, so ``old_logprobs[b, t]`` is the behaviour policy's logprob of
that token given the tokens before it, and ``response_mask[b, t]`` is 1 exactly where ``input_ids[b, t]`` is a
response token. Prompt tokens and padding are masked: only the tokens the policy chose are trained on. (The policy
shifts logits by one to produce the same token-space logprobs; see ``logprobs.token_logprobs``.)

Rows with the same prompt (a GRPO group's rollouts of one task) go into the same micro-batch, next to each other:
``logprobs.token_logprobs`` runs such a prompt once for all of them. Groups are taken in the order of their
prompts, so groups whose prompts start alike (one agent's calls: its system prompt and worked examples, then the
task) share micro-batches, where the start they have in common runs once too (``layout_tokens``). The token budget
counts what that forward computes: the cheaper of the groups padded to the longest (each distinct prompt once plus
its rows' responses; a group of one row is just that row) and one sequence of the common start plus each group's
rest. A group over the budget is
cut into parts that fit, each running the prompt again; a group whose prompt with one response is already over it
stays whole (its parts would not fit either, and each would run a long prompt again), and so does a row alone: such
a micro-batch is ``over_budget``, and the policy runs it with gradient checkpointing to stay in memory.

The budget's default (0) is chosen for the device the learner computes on (``budget_for``): 2048 tokens on a CPU,
4096 on a GPU (with a 1.5B model in bf16, a 4096-token micro-batch's activations take about 16 GiB; the weights,
gradients and AdamW state another 23 GiB).

A prompt longer than ``max_prompt_tokens`` is rejected with a message, unless ``truncate_prompt_left`` is set, in
which case its oldest tokens are dropped (the behaviour logprobs then no longer describe exactly this context: that
is why it is opt-in). The training loop first passes a step's transitions through ``keep_usable``, which skips and
counts the ones that cannot be trained on (``unusable``: that prompt, missing logprobs...), so that one bad
transition never aborts a run. Token ids and numbers in, tensors out.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lit_trainer.intake.episodes import Transition
from lit_trainer.settings import Rule, at_least, check

log = logging.getLogger("lit")


@dataclass(frozen=True)
class BatchingConfig:
    SECTION = "batching"
    RULES = {"max_tokens_per_micro_batch": Rule(low=2, or_zero=True, why="(0: chosen for the device)"),
             "max_prompt_tokens": at_least(1)}

    max_tokens_per_micro_batch: int = 0
    """Budget of one micro-batch: its prompt groups x the longest group's tokens (the prompt once plus every row's
    response) stays at or under it; a group over the budget is split, and a group or a row that cannot be split to
    fit gets a micro-batch of its own, run with gradient checkpointing. 0: chosen for the device (2048 tokens on a
    CPU, 4096 on a GPU; module docstring)."""
    max_prompt_tokens: int = 1536
    """Longest prompt accepted; longer ones are rejected unless ``truncate_prompt_left``."""
    truncate_prompt_left: bool = False
    """Drop the oldest prompt tokens beyond ``max_prompt_tokens`` instead of rejecting the transition."""

    def __post_init__(self) -> None:
        check(self)


DEFAULT_BUDGETS = {"cpu": 2048, "cuda": 4096}
"""``max_tokens_per_micro_batch = 0`` on each kind of device (other kinds: the GPU's)."""


def budget_for(config: BatchingConfig, device_type: str) -> BatchingConfig:
    """``config`` with its token budget set: its own, or when that is 0, the default for ``device_type``."""
    if config.max_tokens_per_micro_batch:
        return config
    return dataclasses.replace(config, max_tokens_per_micro_batch=DEFAULT_BUDGETS.get(device_type,
                                                                                       DEFAULT_BUDGETS["cuda"]))


class PromptTooLong(ValueError):
    """A transition's prompt is over ``batching.max_prompt_tokens``."""


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long: 1 for real tokens
    response_mask: torch.Tensor  # (B, T) float: 1 for response tokens
    old_logprobs: torch.Tensor  # (B, T) float: behaviour logprobs at response positions, 0 elsewhere
    advantages: torch.Tensor  # (B,) float
    index: list[int]
    """Which of the input transitions each row is (for metrics and debugging)."""
    temperature: torch.Tensor = field(default=None)  # (B,) float
    """Each row's sampling temperature, as recorded (None: 1.0 for every row). Its logprobs are those of
    softmax(logits / temperature), except a greedy call's (<= 1e-5): those of T = 1
    (``logprobs.effective_temperature``)."""

    prox_logprobs: torch.Tensor | None = None  # (B, T) float
    """π_old's logprobs recomputed by the trainer (``update.recompute_old_logprobs``; learner/schedule.py), laid out
    like ``old_logprobs``; None: π_old is the behaviour policy."""
    over_budget: bool = False
    """Its forward computes more tokens than the budget (a prompt group or a row that could not be split to fit):
    the policy runs it with gradient checkpointing."""
    demonstrations: bool = False
    """Its rows are demonstrations (rollouts/demonstrations.py): trained by their NLL, with no behaviour logprobs."""
    adapter: str | None = None
    """The LoRA adapter every row of it is computed with (a ``[roles]`` table's; None: the one policy)."""

    def __post_init__(self) -> None:
        if self.temperature is None:
            self.temperature = torch.ones(self.input_ids.shape[0], dtype=torch.float32)  # (B,)
        assert self.temperature.shape == self.input_ids.shape[:1], (
            f"temperature has shape {tuple(self.temperature.shape)}, want ({self.input_ids.shape[0]},)")

    @property
    def n_response_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    def to(self, device: torch.device | str) -> MicroBatch:
        """The same micro-batch with every tensor on ``device`` (itself when they all are there already)."""
        tensors = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        device = torch.device(device)
        if all(t.device == device for t in tensors.values()):
            return self
        return dataclasses.replace(self, **{name: t.to(device) for name, t in tensors.items()})


def make_micro_batches(
    transitions: Sequence[Transition],
    advantages: Sequence[float] | torch.Tensor,
    config: BatchingConfig,
    pad_id: int,
    *,
    share_prompts: bool = True,
    adapter_of: Callable[[Transition], str | None] | None = None,
) -> list[MicroBatch]:
    """Pack transitions (with one advantage each) into micro-batches: rows with the same prompt together, groups in
    the order of their prompts. A group costs its prompt once plus its rows' responses (module docstring); a
    micro-batch costs its groups x its costliest group, or, packed as one sequence, the common start of their
    prompts once plus each group's rest (``layout_tokens``: the cheaper). ``share_prompts=False`` costs every row
    whole (rows x padded length), in order of length,
    for a forward pass that runs each row in full (``logprobs.plain_token_logprobs``). A budget of 0 is a CPU's
    (``budget_for``). ``adapter_of``: the adapter of each transition (one per role): a micro-batch holds one
    adapter's rows (``MicroBatch.adapter``)."""
    assert len(transitions) == len(advantages), f"{len(transitions)} transitions, {len(advantages)} advantages"
    if adapter_of is not None:
        keys = [adapter_of(t) for t in transitions]
        out = []
        for key in dict.fromkeys(keys):
            chosen = [i for i, k in enumerate(keys) if k == key]
            for mb in make_micro_batches([transitions[i] for i in chosen], [float(advantages[i]) for i in chosen],
                                         config, pad_id, share_prompts=share_prompts):
                mb.index, mb.adapter = [chosen[j] for j in mb.index], key
                out.append(mb)
        return out
    config = budget_for(config, "cpu")  # 0: run_update resolved it for the learner's device already, else a CPU's
    rows = [_row(t, config) for t in transitions]
    if share_prompts:
        units = _prompt_groups(rows, config.max_tokens_per_micro_batch)
    else:
        units = [[i] for i in range(len(rows))]
    prompts = [rows[unit[0]][0][: rows[unit[0]][1]] for unit in units]
    costs = [_cost(unit, rows) for unit in units]
    order = sorted(range(len(units)), key=lambda u: prompts[u] if share_prompts else costs[u])
    batches: list[tuple[list[int], int]] = []  # (rows, tokens its forward computes)
    current: list[int] = []  # units
    tokens = prefix = 0  # of the current micro-batch: its forward's tokens, its prompts' common prefix
    for u in order:
        if current:
            shared = min(prefix, common_prefix([prompts[current[0]], prompts[u]])) if share_prompts else 0
            with_u = layout_tokens([costs[v] for v in [*current, u]], shared, share_prompts)[0]
            if with_u > config.max_tokens_per_micro_batch:
                batches.append(([i for v in current for i in units[v]], tokens))
                current = []
        if not current:
            shared, with_u = len(prompts[u]), costs[u]
        current.append(u)
        tokens, prefix = with_u, shared
    if current:
        batches.append(([i for v in current for i in units[v]], tokens))
    adv = torch.as_tensor(advantages, dtype=torch.float32)  # (N,)
    return [_collate(group, rows, adv, pad_id, over_budget=tokens > config.max_tokens_per_micro_batch)
            for group, tokens in batches]


def common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """The length of the longest prefix every prompt starts with."""
    if not prompts:
        return 0
    n = min(len(p) for p in prompts)
    first = prompts[0]
    for i in range(n):
        if any(p[i] != first[i] for p in prompts[1:]):
            return i
    return n


def layout_tokens(costs: Sequence[int], prefix: int, share_prompts: bool = True) -> tuple[int, bool]:
    """Tokens the forward pass computes for prompt groups of ``costs`` tokens each (a group: its prompt once plus
    its rows' responses) whose prompts start with a common ``prefix`` of tokens, and whether it packs them into one
    sequence. Apart, each group is a sequence padded to the longest: groups x longest. Together, one sequence holds
    the common prefix once, then each group's rest of its prompt and its rows' responses: prefix + sum(cost -
    prefix). The cheaper layout is taken (``logprobs.pack_rows`` makes the same choice). Without ``share_prompts``
    each group is one row, padded."""
    apart = len(costs) * max(costs, default=0)
    if not share_prompts or len(costs) < 2:
        return apart, False
    together = prefix + sum(c - prefix for c in costs)
    return (together, True) if together < apart else (apart, False)


def _prompt_groups(rows: list, budget: int) -> list[list[int]]:
    """The rows' indices grouped by prompt, in input order; a group costlier than ``budget`` is cut into parts
    that fit (each part then runs its prompt once), with at least one row each, unless one of its rows alone is
    over the budget: then no part could fit, and the group stays whole (its prompt runs once)."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, (ids, start, _, _) in enumerate(rows):
        by_prompt.setdefault(tuple(ids[:start]), []).append(i)
    groups = []
    for members in by_prompt.values():
        if any(_cost([i], rows) > budget for i in members):
            groups.append(members)
            continue
        part: list[int] = []
        for i in members:
            if part and _cost([*part, i], rows) > budget:
                groups.append(part)
                part = []
            part.append(i)
        groups.append(part)
    return groups


def _cost(unit: list[int], rows: list) -> int:
    """Tokens the forward pass runs for rows sharing one prompt: the prompt once plus each row's response."""
    start = rows[unit[0]][1]
    return start + sum(len(rows[i][0]) - rows[i][1] for i in unit)


SAMPLING_FIX = ("lit computes the trainer's logprobs of softmax(logits / temperature) only, so it cannot train on "
                "calls with top-p, top-k, min-p, penalties or a logit bias. Remove them from the agent's LLM settings "
                "(temperature alone is supported)")


def unusable(t: Transition, config: BatchingConfig) -> str | None:
    """Why ``t`` cannot be trained on, as a metric name, or None: ``empty`` (no prompt or no response tokens),
    ``no_logprobs`` (its engine returned no behaviour logprobs), ``logprobs_length`` (not one per response token),
    ``prompt_too_long`` (over ``max_prompt_tokens`` without ``truncate_prompt_left``), ``sampling`` (sampled with
    settings beyond temperature, whose logprobs the trainer cannot compute)."""
    if not t.response_ids or not t.prompt_ids:
        return "empty"
    if t.sampling_unsupported:
        return "sampling"
    if t.logprobs is None and not t.guided:  # a guided response gets the trainer's own (schedule.py)
        return "no_logprobs"
    if t.logprobs is not None and len(t.logprobs) != len(t.response_ids):
        return "logprobs_length"
    if len(t.prompt_ids) > config.max_prompt_tokens and not config.truncate_prompt_left:
        return "prompt_too_long"
    return None


def explain(t: Transition, reason: str, config: BatchingConfig) -> str:
    """``unusable``'s reason in words, naming the transition and what to change."""
    where = f"transition {t.rollout_id}#{t.index}"
    return {
        "empty": f"{where} has an empty prompt or response",
        "sampling": f"{where} (agent {t.agent!r}) was sampled with {t.sampling_unsupported}: {SAMPLING_FIX}",
        "no_logprobs": f"{where} has no behaviour logprobs: its engine did not return them (lit asks vLLM for them; "
                       "check that the agent's calls go to the lit-managed server)",
        "logprobs_length": f"{where} has {len(t.logprobs or [])} behaviour logprobs for {len(t.response_ids)} "
                           "response tokens",
        "prompt_too_long": f"{where} has a {len(t.prompt_ids)}-token prompt, over batching.max_prompt_tokens="
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


def _row(t: Transition, config: BatchingConfig) -> tuple[list[int], int, list[float], float]:
    """(ids, where the response starts, behaviour logprobs of the response, sampling temperature)."""
    reason = unusable(t, config)
    if reason is not None:
        raise (PromptTooLong if reason == "prompt_too_long" else ValueError)(explain(t, reason, config))
    prompt = list(t.prompt_ids)[-config.max_prompt_tokens :]
    return prompt + list(t.response_ids), len(prompt), list(t.logprobs or []), float(t.temperature)


def _collate(group: list[int], rows: list, adv: torch.Tensor, pad_id: int, over_budget: bool) -> MicroBatch:
    width = max(len(rows[i][0]) for i in group)
    n = len(group)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)  # (B, T)
    attention = torch.zeros((n, width), dtype=torch.long)  # (B, T)
    response = torch.zeros((n, width), dtype=torch.float32)  # (B, T)
    old = torch.zeros((n, width), dtype=torch.float32)  # (B, T)
    temperature = torch.tensor([rows[i][3] for i in group], dtype=torch.float32)  # (B,)
    for b, i in enumerate(group):
        ids, start, logprobs, _ = rows[i]
        input_ids[b, : len(ids)] = torch.tensor(ids)
        attention[b, : len(ids)] = 1
        response[b, start : len(ids)] = 1.0
        old[b, start : len(ids)] = torch.tensor(logprobs)
    return MicroBatch(input_ids, attention, response, old, adv[group], list(group), temperature,
                      over_budget=over_budget)
