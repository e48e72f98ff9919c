"""The policy on the real SmolLM2 with the LightningRL loss: token-space logprobs, one optimizer step, LoRA, and the
vLLM logprob gap. (The objective's math is tested by hand in test_loss.py; these tests are about the update.)"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from lit_trainer.algorithm.loss import LossConfig, step_loss
from lit_trainer.engine.logprob_check import trainer_logprobs
from lit_trainer.intake.episodes import Transition
from lit_trainer.learner.batching import BatchingConfig, MicroBatch, make_micro_batches
from lit_trainer.learner.policy import Policy, PolicyConfig

pytestmark = pytest.mark.slow
PROMPTS = [[1, 4093, 314, 216, 28, 476, 28, 47], [1, 504, 3575, 282, 4649, 314], [1, 22, 1232, 33, 2]]
RESPONSES = [[216, 30, 2], [7042, 30, 2], [1232, 33]]


def step(policy: Policy, micro_batches: list[MicroBatch], config: LossConfig | None = None) -> dict[str, float]:
    """One update with the LightningRL loss, normalised over the whole step as ``lit train`` does."""
    return policy.update(micro_batches, step_loss(config or LossConfig(), micro_batches))


def batches(policy: Policy, advantages: list[float], old: list[list[float]] | None = None) -> list[MicroBatch]:
    old = old or [[-1.0] * len(r) for r in RESPONSES]
    rows = zip(PROMPTS, RESPONSES, old, strict=True)
    ts = [Transition(p, r, lp, None, "a", "r", "t", i, "s") for i, (p, r, lp) in enumerate(rows)]
    return make_micro_batches(ts, advantages, BatchingConfig(max_tokens_per_micro_batch=24), pad_id=2)


def response_logprobs(policy: Policy) -> list[list[float]]:
    with torch.no_grad():
        model = policy.unwrapped()
        return [trainer_logprobs(model, p, r).tolist() for p, r in zip(PROMPTS, RESPONSES, strict=True)]


def test_token_logprobs_match_an_independent_computation(prepared_model):
    policy = Policy(PolicyConfig(model=str(prepared_model)))
    expected = response_logprobs(policy)
    with torch.no_grad():
        for mb in batches(policy, [0.0, 0.0, 0.0]):
            logp, entropy = policy.token_logprobs(mb, with_entropy=True)
            assert logp.shape == entropy.shape == mb.input_ids.shape
            for row, i in enumerate(mb.index):
                got = logp[row][mb.response_mask[row].bool()]
                assert_close(got, torch.tensor(expected[i]), atol=1e-4, rtol=0)
            # Entropy where a response token was drawn (from the distribution at the position before), 0 elsewhere.
            logits = policy.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits  # (B, T, V)
            direct = torch.distributions.Categorical(logits=logits[:, :-1].float()).entropy()  # (B, T-1)
            mask = mb.response_mask.bool()
            assert_close(entropy[mask], direct[mask[:, 1:]], atol=1e-4, rtol=1e-4)
            assert (entropy[~mask] == 0).all()


def test_one_update_changes_every_weight_and_raises_a_rewarded_response(prepared_model):
    policy = Policy(PolicyConfig(model=str(prepared_model), learning_rate=1e-4))
    before_params = [p.detach().clone() for p in policy.trainable]
    before = response_logprobs(policy)
    # Behaviour logprobs = the policy's own: ratio 1, an on-policy step.
    metrics = step(policy, batches(policy, [1.0, -1.0, 0.0], old=before))
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert metrics["loss/clip_frac"] == 0.0 and metrics["policy/vllm_logprob_gap"] < 1e-4
    assert metrics["policy/response_tokens"] == 8.0 and metrics["policy/grad_norm"] > 0
    changed = [not torch.equal(b, p.detach()) for b, p in zip(before_params, policy.trainable, strict=True)]
    assert all(changed), f"{changed.count(False)} of {len(changed)} trainable tensors did not change"
    after = response_logprobs(policy)
    assert sum(after[0]) > sum(before[0]), "the positively rewarded response did not become more likely"
    assert sum(after[1]) < sum(before[1]), "the negatively rewarded response did not become less likely"


def test_lora_trains_adapters_only(prepared_model):
    policy = Policy(PolicyConfig(model=str(prepared_model), lora_rank=4, learning_rate=1e-3))
    names = [n for n, p in policy.unwrapped().named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    frozen = {n: p.detach().clone() for n, p in policy.unwrapped().named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in policy.unwrapped().named_parameters() if p.requires_grad}
    # LoRA's B matrices start at zero, so A gets no gradient on the first step; two steps move every adapter.
    for _ in range(2):
        step(policy, batches(policy, [1.0, -1.0, 0.5], old=response_logprobs(policy)))
    after = dict(policy.unwrapped().named_parameters())
    assert all(torch.equal(frozen[n], after[n].detach()) for n in frozen), "a frozen base weight changed"
    unchanged = [n for n in adapters if torch.equal(adapters[n], after[n].detach())]
    assert unchanged == [], f"adapters that did not train: {unchanged[:3]}"
    # Defect 3: the weight sync used to raise here; it now gets the base weights with the adapter merged in.
    merged = policy.state_dict()
    assert set(merged) == set(Policy(PolicyConfig(model=str(prepared_model))).unwrapped().state_dict())
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           frozen["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])


def test_vllm_logprob_gap_measures_the_behaviour_policy_distance(prepared_model):
    policy = Policy(PolicyConfig(model=str(prepared_model), learning_rate=1e-9, max_grad_norm=0))
    own = response_logprobs(policy)
    same = step(policy, batches(policy, [0.0, 0.0, 0.0], old=own))
    assert same["policy/vllm_logprob_gap"] < 1e-4
    shifted = [[x - 0.5 for x in row] for row in own]
    off = step(policy, batches(policy, [0.0, 0.0, 0.0], old=shifted))
    assert off["policy/vllm_logprob_gap"] == pytest.approx(0.5, abs=1e-3)


def test_gradient_checkpointing_gives_the_same_logprobs_and_still_trains(prepared_model):
    plain = Policy(PolicyConfig(model=str(prepared_model)))
    checkpointed = Policy(PolicyConfig(model=str(prepared_model), gradient_checkpointing=True, learning_rate=1e-4))
    mb = batches(plain, [1.0, -1.0, 0.0])[0]
    with torch.no_grad():
        assert_close(checkpointed.token_logprobs(mb)[0], plain.token_logprobs(mb)[0], atol=1e-5, rtol=0)
    before = [p.detach().clone() for p in checkpointed.trainable]
    own = response_logprobs(checkpointed)
    step(checkpointed, batches(checkpointed, [1.0, -1.0, 0.0], old=own))
    assert all(not torch.equal(b, p.detach()) for b, p in zip(before, checkpointed.trainable, strict=True))

