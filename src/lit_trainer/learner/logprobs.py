"""Per-token logprobs of a micro-batch under the policy, computed only where the loss reads them.

Position t of a row holds log p_T(token t | tokens < t), with p_T = softmax(logits / T) at the row's sampling
temperature T (the distribution vLLM sampled from and returned logprobs of), and 0 wherever ``response_mask`` is 0.
The straightforward way (``plain_token_logprobs``) runs the whole model on every padded row and takes a (B, T, V)
fp32 log-softmax, of which the loss reads only the response positions; on a 49k-token vocabulary those logits and
their copies dominate the update's memory, and the rows of a GRPO group repeat one prompt. ``token_logprobs`` gives
the same values and the same gradients with less of both:

* Prompt sharing. Rows whose prompts (the tokens before their first response token) are equal form a group, packed
  into one sequence: the prompt once, then each row's response (less its last token, which predicts nothing). A
  4D attention mask lets each response see the prompt and itself only, and position ids restart every response
  where its prompt ends, so each token sees exactly the context it has in its own row: a group of 8 rollouts of one
  task runs its prompt once instead of 8 times. The hidden state of the prompt's last token predicts every row's
  first response token; its gradient is the sum over the rows, as in the plain path. Groups whose prompts start
  alike (an agent's system prompt, tools and worked examples, then each task's question) go one step further: one
  sequence holds the start they share once, then each group's rest of its prompt and its rows, each seeing the
  shared start, its own group's prompt and itself (the calc example's 8 groups: 567-token prompts of which about
  540 are common). ``batching.layout_tokens`` picks that layout when it computes fewer tokens than the groups
  padded apart.
* Head on response positions only. The decoder trunk gives hidden states; only those that predict a response
  token go through the LM head and the log-softmax, ``chunk_tokens`` positions at a time, each chunk recomputed in
  the backward pass (activation checkpointing), so at most one (chunk_tokens, V) block of logits lives at a time.
  The head and the log-softmax run in float32 even when the caller runs the decoder under bf16 autocast
  (``policy.precision``, learner/precision.py): autocast is off around them and a bfloat16 head is cast up. The
  plain path computes its head inside the model's forward, under the caller's autocast.

The micro-batch must be on the model's device (``Policy.place`` puts it there; a mismatch is a RuntimeError that says
so): the layout built from it is made on the CPU and moved there once.

``token_logprobs`` calls the model's submodules (``get_decoder()``, ``get_output_embeddings()``) instead of its
``forward``: a wrapper that works through ``forward`` would be bypassed. So a torch DDP/FSDP/DataParallel wrapper
or accelerate's mixed-precision autocast (which wraps ``forward``) makes ``token_logprobs`` fall back to the plain
path. lit's own multi-process update wraps nothing (learner/distributed.py), and its sharding puts FSDP2's hooks on
the decoder layers themselves (learner/sharding.py), which run however the layers are called: both keep this
path. A model whose head is more than a linear map (logit soft-capping or scaling) falls back too. Attention
kernels that cannot take a custom 4D mask (anything but ``sdpa`` and ``eager``) and sliding-window layers keep the
head-on-response-positions part and run every row whole. Works with
peft LoRA (the adapters sit inside the base model's modules), tied embeddings (lm_head is embed_tokens' weight: the
gradients add up in one tensor) and gradient checkpointing (no KV cache is involved, which gradient checkpointing
would turn off).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from lit_trainer.learner import precision
from lit_trainer.learner.batching import MicroBatch, common_prefix, layout_tokens

GREEDY_TEMPERATURE = 1e-5
"""At or below this temperature a call was greedy: vLLM then reports the logprobs of softmax(logits), T = 1."""
MASK_ATTENTIONS = ("sdpa", "eager")
"""Attention implementations that take the custom 4D mask of a packed group."""


def effective_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """(B,) sampling temperatures -> (B,) temperatures of the logprobs vLLM reported: greedy calls count as 1."""
    return torch.where(temperature <= GREEDY_TEMPERATURE, torch.ones_like(temperature), temperature)


def plain_token_logprobs(model: torch.nn.Module, batch: MicroBatch, *, with_entropy: bool = False,
                         entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference: the model's full forward on every padded row, a (B, T-1, V) log-softmax of the tempered
    logits, the response tokens picked out. Returns logprobs (B, T) and, with ``with_entropy``, the entropy (B, T)
    of the distribution each response token was drawn from; both 0 off the response. The entropy is a metric
    without gradient, unless ``entropy_grad`` (an entropy bonus, ``loss.entropy_coef``: it keeps an (N, V) copy
    for its backward)."""
    _check_device(batch, next(model.parameters()).device)
    input_ids = batch.input_ids  # (B, T)
    mask = batch.response_mask.bool()  # (B, T)
    temperature = effective_temperature(batch.temperature.float())  # (B,)
    logits = model(input_ids=input_ids, attention_mask=batch.attention_mask).logits  # (B, T, V)
    # The logits at position t-1 predict token t: drop the last position, shift the targets left by one.
    scaled = logits[:, :-1].float()  # (B, T-1, V)
    if bool((temperature != 1.0).any()):
        scaled = scaled / temperature[:, None, None]
    logp_all = torch.log_softmax(scaled, dim=-1)  # (B, T-1, V)
    picked = logp_all.gather(-1, input_ids[:, 1:, None])[..., 0]  # (B, T-1)
    logp = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)  # (B, T): token 0 has no prediction
    logp = torch.where(mask, logp, torch.zeros_like(logp))
    entropy = None
    if with_entropy or entropy_grad:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            rows = logp_all[mask[:, 1:]]  # (N, V): the distributions that produced response tokens
            entropy = logp.new_zeros(logp.numel()).masked_scatter(mask.reshape(-1), _entropy(rows)).view_as(logp)
    return logp, entropy


def token_logprobs(model: torch.nn.Module, batch: MicroBatch, *, with_entropy: bool = False,
                   entropy_grad: bool = False, chunk_tokens: int = 1024) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``plain_token_logprobs``'s logprobs (B, T) and entropy (B, T) or None, equal up to fp32 reassociation, with
    the same gradients, computed with each shared prompt once and the LM head on response positions only (module
    docstring). ``model``: a Hugging Face causal LM or a peft model around one; any other wrapper falls back to the
    plain path. At most ``chunk_tokens`` positions of logits (chunk_tokens, V) exist at a time."""
    assert chunk_tokens > 0, f"chunk_tokens must be > 0, got {chunk_tokens}"
    parts = _trunk_and_head(model)
    if parts is None:
        return plain_token_logprobs(model, batch, with_entropy=with_entropy, entropy_grad=entropy_grad)
    trunk, head, share = parts
    device = head.weight.device
    _check_device(batch, device)
    layout = pack_rows(batch) if share else _unpacked_rows(batch)
    if layout.source.numel() == 0:  # no response token: nothing to gain, and the plain path gives the zeros
        return plain_token_logprobs(model, batch, with_entropy=with_entropy, entropy_grad=entropy_grad)
    layout = layout.to(device)
    if share:
        attention = _group_mask(layout.segment, layout.group, head.weight.dtype, trunk.config._attn_implementation)
    else:
        attention = batch.attention_mask  # (B, T): the model builds its causal padding mask
    hidden = trunk(input_ids=layout.input_ids, attention_mask=attention, position_ids=layout.position_ids,
                   use_cache=False).last_hidden_state  # (G, L, H)
    states = hidden.reshape(-1, hidden.shape[-1]).index_select(0, layout.source)  # (N, H)
    temperature = effective_temperature(batch.temperature.float())  # (B,)
    picked, entropy = _head_logprobs(head, states, layout.target, temperature[layout.dest // batch.input_ids.shape[1]],
                                     chunk_tokens, with_entropy or entropy_grad, entropy_grad)  # (N,), (N,) or None
    dest = layout.dest  # (N,)
    numel = batch.input_ids.numel()
    logp = picked.new_zeros(numel).index_copy(0, dest, picked).view_as(batch.input_ids)  # (B, T)
    if entropy is not None:
        entropy = entropy.new_zeros(numel).index_copy(0, dest, entropy).view_as(batch.input_ids)  # (B, T)
    return logp, entropy


@dataclass(frozen=True)
class PackedRows:
    """What the trunk runs on and where its outputs go: G sequences of length L (the packed prompt groups, or the
    rows themselves), and for each of the N response tokens the hidden state that predicts it."""

    input_ids: torch.Tensor  # (G, L) long
    position_ids: torch.Tensor  # (G, L) long: each token's position in its own row
    segment: torch.Tensor  # (G, L) long: -1 prompt, b the response of row b, < -1 padding (one value per position)
    group: torch.Tensor  # (G, L) long: the prompt group a token belongs to, -1 the start every group shares, < -1 pad
    source: torch.Tensor  # (N,) long: flat index into the trunk's (G * L) hidden states
    target: torch.Tensor  # (N,) long: the response token it predicts
    dest: torch.Tensor  # (N,) long: flat index of that token into the micro-batch's (B * T)

    def to(self, device: torch.device) -> PackedRows:
        return PackedRows(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


def _check_device(batch: MicroBatch, device: torch.device) -> None:
    """The micro-batch must be where the model computes (``Policy.place`` puts it there)."""
    if batch.input_ids.device != device:
        raise RuntimeError(f"the micro-batch is on {batch.input_ids.device} and the model on {device}: move it "
                           "with MicroBatch.to (Policy.place does)")


def prompt_lengths(batch: MicroBatch) -> torch.Tensor:
    """(B,) each row's prompt length: the position of its first response token (its length when it has none)."""
    response = batch.response_mask.bool()  # (B, T)
    lengths = batch.attention_mask.sum(dim=1)  # (B,)
    first = response.int().argmax(dim=1)  # (B,)
    return torch.where(response.any(dim=1), first, lengths)


def pack_rows(batch: MicroBatch) -> PackedRows:
    """Group the rows by prompt and pack each group into one sequence: its prompt, then every row's response but
    the last token. Position t-1 of a row predicts its token t; for t-1 in the prompt that is the group's last
    prompt token, shared by all of the group's rows. When the groups' prompts start alike (an agent's system
    prompt and worked examples) and one sequence is cheaper than the groups padded apart (``batching.layout_tokens``,
    the rule the micro-batches were made by), every group goes into one sequence that holds the common start once,
    then each group's rest of its prompt and its rows. Rows without response tokens are left out."""
    ids, lengths, starts = _checked_rows(batch)
    response = batch.response_mask.bool().tolist()
    width = batch.input_ids.shape[1]
    groups: dict[tuple[int, ...], list[int]] = {}
    for b in range(len(ids)):
        if starts[b] < lengths[b]:
            groups.setdefault(tuple(ids[b][: starts[b]]), []).append(b)
    costs = [len(prompt) + sum(lengths[b] - 1 - len(prompt) for b in rows) for prompt, rows in groups.items()]
    common = common_prefix(list(groups))
    together = layout_tokens(costs, common)[1]
    start = common if together else 0  # each prompt's first token that its group's part of a sequence holds
    sequences: list[tuple[list[int], list[int], list[int], list[int]]] = []  # tokens, positions, segments, groups
    if together:
        sequences.append((list(next(iter(groups))[:common]), list(range(common)), [-1] * common, [-1] * common))
    source, target, dest = [], [], []
    for g, (prompt, rows) in enumerate(groups.items()):
        p = len(prompt)
        if not together:
            sequences.append(([], [], [], []))
        tokens, positions, segments, owners = sequences[-1]
        seq = len(sequences) - 1
        last = len(tokens) + p - 1 - start if p - 1 >= start else p - 1  # where the prompt's last token is packed
        tokens += prompt[start:]
        positions += range(start, p)
        segments += [-1] * (p - start)
        owners += [g] * (p - start)
        for b in rows:
            at = len(tokens)  # the packed position of this row's token p (its first response token)
            tokens += ids[b][p : lengths[b] - 1]
            positions += range(p, lengths[b] - 1)
            segments += [b] * (lengths[b] - 1 - p)
            owners += [g] * (lengths[b] - 1 - p)
            for t in range(p, lengths[b]):
                if response[b][t]:  # predicted at row position t - 1: the prompt's last token, or in the segment
                    source.append((seq, last if t == p else at + t - 1 - p))
                    target.append(ids[b][t])
                    dest.append(b * width + t)
    return _stack(sequences, source, target, dest)


def _unpacked_rows(batch: MicroBatch) -> PackedRows:
    """Every row as its own sequence (no prompt sharing), for attention kernels without custom masks."""
    ids, lengths, _ = _checked_rows(batch)
    sequences, source, target, dest = [], [], [], []
    width = batch.input_ids.shape[1]
    response = batch.response_mask.bool().tolist()
    for b in range(len(ids)):
        sequences.append((ids[b], list(range(len(ids[b]))), [b] * len(ids[b]), [b] * len(ids[b])))
        for t in range(1, lengths[b]):
            if response[b][t]:
                source.append((b, t - 1))
                target.append(ids[b][t])
                dest.append(b * width + t)
    return _stack(sequences, source, target, dest)


def _checked_rows(batch: MicroBatch) -> tuple[list[list[int]], list[int], list[int]]:
    """The rows' token ids, lengths and prompt lengths, after checking the layout ``batching`` makes: right
    padding, response tokens only among real tokens, and never at position 0 (which nothing predicts)."""
    attention = batch.attention_mask.bool()  # (B, T)
    response = batch.response_mask.bool()  # (B, T)
    lengths = attention.sum(dim=1)  # (B,)
    columns = torch.arange(attention.shape[1], device=attention.device)  # (T,)
    assert torch.equal(attention, columns[None, :] < lengths[:, None]), "rows must be right-padded"
    assert not (response & ~attention).any(), "response_mask marks padding"
    assert not response[:, 0].any(), "a response token at position 0 has no context to be predicted from"
    return batch.input_ids.tolist(), lengths.tolist(), prompt_lengths(batch).tolist()


def _stack(sequences: list[tuple[list[int], list[int], list[int], list[int]]], source: list[tuple[int, int]],
           target: list[int], dest: list[int]) -> PackedRows:
    """Right-pad the sequences (tokens, positions, segments, groups) to one length L and turn (sequence, position)
    sources into flat indices."""
    length = max((len(s[0]) for s in sequences), default=1)
    g = max(len(sequences), 1)
    input_ids = torch.zeros((g, length), dtype=torch.long)  # (G, L): padding is token 0, never read
    position_ids = torch.zeros((g, length), dtype=torch.long)  # (G, L)
    segment = -2 - torch.arange(length).repeat(g, 1)  # (G, L): each padding position its own segment
    group = segment.clone()  # (G, L): and its own group
    for i, (tokens, positions, segments, groups) in enumerate(sequences):
        n = len(tokens)
        input_ids[i, :n] = torch.tensor(tokens, dtype=torch.long)
        position_ids[i, :n] = torch.tensor(positions, dtype=torch.long)
        segment[i, :n] = torch.tensor(segments, dtype=torch.long)
        group[i, :n] = torch.tensor(groups, dtype=torch.long)
    flat = torch.tensor([s * length + p for s, p in source], dtype=torch.long)  # (N,)
    return PackedRows(input_ids, position_ids, segment, group, flat, torch.tensor(target, dtype=torch.long),
                      torch.tensor(dest, dtype=torch.long))


def _group_mask(segment: torch.Tensor, group: torch.Tensor, dtype: torch.dtype, attention: str) -> torch.Tensor:
    """(G, 1, L, L) attention mask of packed groups from their segments and groups (G, L): query q sees key k <= q
    when k is in the common start of every group (group -1), or in q's group and either its prompt (segment -1) or
    q's own segment. Every query sees at least itself, so no softmax row is empty."""
    length = segment.shape[1]
    positions = torch.arange(length, device=segment.device)  # (L,)
    causal = positions[None, :] <= positions[:, None]  # (L, L): [query, key]
    own_group = group[:, :, None] == group[:, None, :]  # (G, L, L)
    in_group = (segment[:, None, :] == -1) | (segment[:, :, None] == segment[:, None, :])  # (G, L, L)
    visible = (group[:, None, :] == -1) | (own_group & in_group)  # (G, L, L)
    allowed = (causal & visible)[:, None]  # (G, 1, L, L)
    if attention == "sdpa":
        return allowed  # True where attention is allowed
    # eager adds the mask to the attention scores
    return torch.zeros(allowed.shape, dtype=dtype, device=segment.device).masked_fill(~allowed,
                                                                                       torch.finfo(dtype).min)


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """The entropy (n,) of each distribution of log-probabilities (n, V)."""
    return -(logp.exp() * logp).sum(-1)


def _head_logprobs(head: torch.nn.Module, states: torch.Tensor, target: torch.Tensor, temperature: torch.Tensor,
                   chunk_tokens: int, with_entropy: bool, entropy_grad: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tempered logprob of each target (N,) from its hidden state (N, H) with temperature (N,), and the
    distribution's entropy (N,) when asked, through the LM head ``chunk_tokens`` rows at a time. The entropy is a
    metric computed once without gradient, unless ``entropy_grad`` (an entropy bonus): then it carries its gradient
    and is recomputed with the chunk in the backward pass."""
    picked, entropies = [], []
    recompute = torch.is_grad_enabled() and (states.requires_grad or any(p.requires_grad for p in head.parameters()))
    logits_of = _float32_head(head)
    first_pass = [True]  # backward's recomputation of a chunk must not record the metric again

    def chunk(h: torch.Tensor, tgt: torch.Tensor, temp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with precision.float32_head(h.device):
            logits = logits_of(h)  # (n, V)
            if bool((temp != 1.0).any()):
                logits = logits / temp[:, None]
            logp = torch.log_softmax(logits, dim=-1)  # (n, V)
            if entropy_grad:
                return logp.gather(-1, tgt[:, None])[:, 0], _entropy(logp)  # (n,), (n,)
            if with_entropy and first_pass[0]:
                with torch.no_grad():
                    entropies.append(_entropy(logp))  # (n,)
            return logp.gather(-1, tgt[:, None])[:, 0], logp.new_zeros(0)  # (n,), (0,)

    for start in range(0, states.shape[0], chunk_tokens):
        end = start + chunk_tokens
        args = (states[start:end], target[start:end], temperature[start:end])
        first_pass[0] = True
        # Checkpointed: only the chunk's hidden states are kept for backward, not its (n, V) log-softmax.
        logp, entropy = checkpoint(chunk, *args, use_reentrant=False) if recompute else chunk(*args)
        first_pass[0] = False
        picked.append(logp)
        if entropy_grad:
            entropies.append(entropy)
    if not picked:
        empty = states.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(picked), (torch.cat(entropies) if with_entropy else None)


def _float32_head(head: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The LM head as a function of hidden states (n, H) -> float32 logits (n, V), computed in float32 (under bf16
    autocast too: ``precision.float32_head`` turns it off around the call). A plain linear head is applied to the
    float32 weight (a frozen bfloat16 head is cast once per call); any other head module (an adapter on it) runs
    as it is, its output cast."""
    if type(head) is not torch.nn.Linear:
        return lambda h: head(h.to(head.weight.dtype)).float()
    weight = head.weight.float()  # the parameter itself when float32: its gradient flows
    bias = head.bias.float() if head.bias is not None else None
    return lambda h: torch.nn.functional.linear(h.float(), weight, bias)


def _trunk_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, bool] | None:
    """(decoder trunk, LM head, whether prompt groups can be packed), or None when only the model's own forward
    computes its logits correctly (module docstring)."""
    wrappers = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
    if isinstance(model, wrappers) or type(model).__name__ == "FullyShardedDataParallel":
        return None
    if hasattr(model, "_original_forward"):  # accelerate wrapped forward (autocast): submodules would skip it
        return None
    base = model
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):  # a peft model
        if getattr(model.active_peft_config, "is_prompt_learning", False):  # virtual tokens added in forward
            return None
        base = model.get_base_model()
    head, trunk = base.get_output_embeddings(), base.get_decoder()
    config = base.config
    if head is None or trunk is base or not hasattr(head, "weight") or _scales_logits(config):
        return None
    return trunk, head, config._attn_implementation in MASK_ATTENTIONS and not _has_sliding_window(config)


def _scales_logits(config) -> bool:
    """Whether the model's forward does more to the head's output than returning it (Gemma's soft-capping,
    Cohere's and Granite's scales)."""
    return bool(getattr(config, "final_logit_softcapping", None)) or any(
        getattr(config, name, None) not in (None, 1, 1.0) for name in ("logit_scale", "logits_scaling"))


def _has_sliding_window(config) -> bool:
    """Whether some layer attends to a window only: the packed mask would have to encode it."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return any(kind != "full_attention" for kind in layer_types)
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True)
