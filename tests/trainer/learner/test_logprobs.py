"""Logprobs with shared prompts and the LM head on response positions only: the same values, entropies and
gradients as the plain full-logits path, at every temperature, for a plain, a LoRA-wrapped and a tied-embedding
model. On tiny Llamas made here (random weights, real transformers and peft modules, fp32), so that it runs in
seconds."""

from __future__ import annotations

import random

import pytest
import torch
from torch.testing import assert_close

from lit_trainer.intake.episodes import Transition
from lit_trainer.learner import logprobs as lp
from lit_trainer.learner.batching import BatchingConfig, MicroBatch, make_micro_batches
from lit_trainer.learner.logprobs import pack_rows, plain_token_logprobs, token_logprobs

VOCAB = 96


def tiny_llama(tie: bool = False, attention: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie, attn_implementation=attention)
    return LlamaForCausalLM(config).float().train()


def lora(model: torch.nn.Module, modules: list[str]) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # init_lora_weights=False: B is random too, so every adapter gets a gradient
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=modules, init_lora_weights=False,
                                            task_type="CAUSAL_LM"))


def mixed_batch(seed: int = 3) -> MicroBatch:
    """One micro-batch of: a group of 3 rows sharing a prompt (response lengths 1, 4, 7), a group of 2 sharing
    another, a row whose prompt extends the first group's (a different group), and a lone row; temperatures
    0.7, 1.0 and 0 (greedy); rows of different lengths, so with padding."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    shared, other = ids(6), ids(3)
    rows = [(shared, 1, 0.7), (shared, 4, 1.0), (other, 5, 0.0), (shared, 7, 0.7), (shared + ids(1), 3, 1.0),
            (other, 2, 0.7), (ids(9), 4, 0.0)]
    ts = [Transition(prompt, ids(r), [-1.0] * r, None, "a", f"r{i}", "t", 0, "s", temperature=temp)
          for i, (prompt, r, temp) in enumerate(rows)]
    (mb,) = make_micro_batches(ts, [1.0] * len(ts), BatchingConfig(max_tokens_per_micro_batch=10_000), pad_id=0)
    return mb


def gradients(model: torch.nn.Module, fn, batch: MicroBatch, weights: torch.Tensor,
              entropy_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The logprobs and every trainable weight's gradient of Σ weights·logp (+ Σ entropy_weights·entropy)."""
    model.zero_grad(set_to_none=True)
    logp, entropy = fn(model, batch)
    objective = (weights * logp).sum()
    if entropy_weights is not None:
        objective = objective + (entropy_weights * entropy).sum()
    objective.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return logp.detach(), grads


def assert_same_gradients(model: torch.nn.Module, batch: MicroBatch, entropy: bool = False, **kwargs) -> None:
    """Both paths' logprobs and gradients agree; with ``entropy``, of an objective that weighs the entropies too."""
    weights = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(5))  # (B, T)
    entropy_weights = None
    if entropy:
        entropy_weights = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(6))  # (B, T)
    plain_logp, plain = gradients(model, lambda m, b: plain_token_logprobs(m, b, entropy_grad=entropy), batch,
                                  weights, entropy_weights)
    new_logp, new = gradients(model, lambda m, b: token_logprobs(m, b, entropy_grad=entropy, **kwargs), batch,
                              weights, entropy_weights)
    assert_close(new_logp, plain_logp, atol=1e-5, rtol=1e-5)
    assert plain.keys() == new.keys() and plain
    for name, expected in plain.items():
        assert expected.abs().max() > 0, f"{name} has no gradient: the test would prove nothing"
        assert_close(new[name], expected, atol=1e-5 * float(expected.abs().max()), rtol=1e-4, msg=name)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_logprobs_and_entropies_equal_the_plain_path_on_responses_and_are_zero_elsewhere(attention: str):
    model, batch = tiny_llama(attention=attention), mixed_batch()
    mask = batch.response_mask.bool()
    with torch.no_grad():
        expected, expected_entropy = plain_token_logprobs(model, batch, with_entropy=True)
        for chunk in (1024, 3):  # several head chunks give the same
            got, entropy = token_logprobs(model, batch, with_entropy=True, chunk_tokens=chunk)
            assert got.shape == entropy.shape == batch.input_ids.shape
            assert_close(got, expected, atol=1e-5, rtol=1e-5)
            assert_close(entropy, expected_entropy, atol=1e-5, rtol=1e-5)
            assert (got[~mask] == 0).all() and (entropy[~mask] == 0).all()
            assert (got[mask] < 0).all() and (entropy[mask] > 0).all()


def test_shared_prompts_run_once():
    batch = mixed_batch()
    packed = pack_rows(batch)
    # Groups: the 6-token prompt with responses 1, 4, 7; the 3-token one with 5, 2; the 7-token and 9-token rows.
    # Their prompts share no first token, and one unpadded sequence (44 tokens) is cheaper than 4 padded to 15.
    costs = [6 + 0 + 3 + 6, 3 + 4 + 1, 7 + 2, 9 + 3]
    assert packed.input_ids.shape == (1, sum(costs)) and int((packed.group == -1).sum()) == 0
    assert packed.source.numel() == batch.n_response_tokens


def alike_batch(seed: int = 4) -> MicroBatch:
    """Prompt groups that start alike, as an agent's calls do (system prompt and worked examples, then the task):
    a common 6-token start, then 2, 3 or 0 more tokens (the last group's prompt is the common start itself, so its
    first response token is predicted from inside the shared part); responses of 1-5 tokens, temperatures 0.7, 1
    and greedy."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    start = ids(6)
    prompts = [start + ids(2), start + ids(3), start]
    rows = [(prompts[0], 2, 0.7), (prompts[1], 5, 1.0), (prompts[0], 4, 0.7), (prompts[2], 3, 0.0),
            (prompts[1], 1, 1.0), (prompts[2], 5, 0.7)]
    ts = [Transition(prompt, ids(r), [-1.0] * r, None, "a", f"r{i}", "t", 0, "s", temperature=temp)
          for i, (prompt, r, temp) in enumerate(rows)]
    (mb,) = make_micro_batches(ts, [1.0] * len(ts), BatchingConfig(max_tokens_per_micro_batch=10_000), pad_id=0)
    return mb


def test_groups_that_start_alike_run_their_common_start_once():
    batch = alike_batch()
    packed = pack_rows(batch)
    # One sequence: the common start (6), then group 0 (2 more prompt tokens, responses of 2 and 4 less their last
    # tokens), group 1 (3; 5 and 1), group 2 (0; 3 and 5): 6 + 2 + 1 + 3 + 3 + 4 + 0 + 0 + 2 + 4 = 25 tokens
    # instead of 3 groups padded to 14.
    assert packed.input_ids.shape == (1, 25)
    assert packed.group[0, :6].tolist() == [-1] * 6 and packed.position_ids[0, :6].tolist() == list(range(6))
    assert packed.source.numel() == batch.n_response_tokens
    with torch.no_grad():
        for attention in ("sdpa", "eager"):
            model = tiny_llama(attention=attention)
            expected, expected_entropy = plain_token_logprobs(model, batch, with_entropy=True)
            got, entropy = token_logprobs(model, batch, with_entropy=True)
            assert_close(got, expected, atol=1e-5, rtol=1e-5)
            assert_close(entropy, expected_entropy, atol=1e-5, rtol=1e-5)
    assert_same_gradients(tiny_llama(), batch)
    checkpointed = tiny_llama()
    checkpointed.gradient_checkpointing_enable()
    assert_same_gradients(checkpointed, batch)


def test_groups_that_start_differently_and_cost_the_same_stay_apart_with_the_same_gradients():
    # Two groups of 4-token prompts (first tokens 1 and 2) with two 3-token responses each: 10 tokens each to
    # budget (pack_rows drops each response's last token: 8 packed), as one sequence 20 = 2 x 10 padded, so each
    # group keeps its own sequence.
    ts = [Transition([g, 5, 6, 7], [8 + g, 9, 10], [-1.0] * 3, None, "a", f"r{g}{k}", "t", 0, "s", temperature=0.7)
          for g in (1, 2) for k in range(2)]
    (batch,) = make_micro_batches(ts, [1.0] * 4, BatchingConfig(max_tokens_per_micro_batch=20), pad_id=0)
    packed = pack_rows(batch)
    assert packed.input_ids.shape == (2, 8) and int((packed.group == -1).sum()) == 0
    assert_same_gradients(tiny_llama(), batch)


def test_gradients_equal_the_plain_path():
    assert_same_gradients(tiny_llama(), mixed_batch(), chunk_tokens=5)


def test_the_entropy_is_a_metric_without_gradient_unless_asked_for():
    # The loss/entropy metric (policy.compute_entropy) costs no autograd graph; the bonus's entropy carries one.
    model, batch = tiny_llama(), mixed_batch()
    for fn in (plain_token_logprobs, lambda m, b, **kw: token_logprobs(m, b, chunk_tokens=5, **kw)):
        logp, metric = fn(model, batch, with_entropy=True)
        assert logp.requires_grad and not metric.requires_grad
        _, bonus = fn(model, batch, entropy_grad=True)
        assert bonus.requires_grad
        assert_close(bonus.detach(), metric)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_entropy_gradients_equal_the_plain_path(checkpointing: bool):
    # The entropy bonus (loss.entropy_coef) trains through the entropies: both paths give them the same gradient.
    model = tiny_llama()
    if checkpointing:
        model.gradient_checkpointing_enable()
    assert_same_gradients(model, mixed_batch(), entropy=True, chunk_tokens=5)


def test_an_entropy_gradient_raises_the_entropy():
    # One small step up the entropy's gradient, and nothing else, spreads the distributions: a sign check that
    # does not depend on the plain path.
    model, batch = tiny_llama(), mixed_batch()
    mask = batch.response_mask.bool()
    _, entropy = token_logprobs(model, batch, entropy_grad=True, chunk_tokens=5)
    before = float(entropy[mask].mean())
    entropy[mask].mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p += 0.05 * p.grad
        _, after = token_logprobs(model, batch, with_entropy=True)
    assert float(after[mask].mean()) > before


def test_gradients_equal_the_plain_path_with_tied_embeddings():
    model = tiny_llama(tie=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert_same_gradients(model, mixed_batch())


@pytest.mark.parametrize("modules", [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                     ["q_proj", "v_proj", "lm_head"]])
def test_gradients_equal_the_plain_path_with_lora(modules: list[str]):
    model = lora(tiny_llama(), modules)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert_same_gradients(model, mixed_batch())


def test_gradients_equal_the_plain_path_with_gradient_checkpointing():
    model = tiny_llama()
    model.gradient_checkpointing_enable()
    assert_same_gradients(model, mixed_batch())


def test_without_custom_masks_rows_run_whole_with_the_same_gradients(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(lp, "MASK_ATTENTIONS", ())  # as for an attention kernel that takes no 4D mask
    assert_same_gradients(tiny_llama(), mixed_batch())


def test_a_wrapped_model_falls_back_to_the_plain_path():
    model, batch = tiny_llama(), mixed_batch()
    wrapped = torch.nn.DataParallel(model)  # on CPU it just calls the module, like DDP's forward must be called
    assert lp._trunk_and_head(wrapped) is None
    with torch.no_grad():
        assert_close(token_logprobs(wrapped, batch)[0], plain_token_logprobs(model, batch)[0])


def test_temperature_divides_the_logits_and_greedy_counts_as_one():
    model = tiny_llama()
    prompt, response = [5, 9, 17, 3], [40, 41, 7]
    ts = [Transition(prompt, response, [-1.0] * 3, None, "a", "r", "t", 0, "s", temperature=temp)
          for temp in (0.5, 1.0, 0.0)]
    batches = [make_micro_batches([t], [1.0], BatchingConfig(), pad_id=0)[0] for t in ts]
    with torch.no_grad():
        half, one, greedy = (token_logprobs(model, b)[0][0, 4:] for b in batches)  # (3,): the response tokens
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, 3:-1]  # (3, V): predict them
    targets = torch.tensor(response)[:, None]
    assert_close(half, torch.log_softmax(logits / 0.5, -1).gather(-1, targets)[:, 0], atol=1e-5, rtol=1e-5)
    assert_close(one, torch.log_softmax(logits, -1).gather(-1, targets)[:, 0], atol=1e-5, rtol=1e-5)
    assert_close(greedy, one)
    assert (half - one).abs().max() > 1e-3


def test_effective_temperature():
    got = lp.effective_temperature(torch.tensor([0.0, 1e-6, 1e-5, 0.7, 1.0, 1.3]))
    assert got.tolist() == pytest.approx([1.0, 1.0, 1.0, 0.7, 1.0, 1.3])
