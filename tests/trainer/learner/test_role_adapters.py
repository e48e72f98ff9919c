"""One LoRA adapter per role (a ``[roles]`` table) on a tiny real Llama: the micro-batches keep one adapter's rows
each, an update trains each adapter on its own role's rows only (one optimizer over all), each adapter computes
its own logprobs, and a checkpoint holds every adapter in ``adapters/<name>/`` and restores them all."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lit_trainer.algorithm.loss import LossConfig
from lit_trainer.intake.episodes import Transition
from lit_trainer.learner import checkpoint as ckpt
from lit_trainer.learner.batching import BatchingConfig, make_micro_batches
from lit_trainer.learner.policy import Policy, PolicyConfig
from lit_trainer.learner.schedule import UpdateConfig, run_update
from lit_trainer.results.runs import resolve_checkpoint

VOCAB = 64  # the tiny_model fixture's (conftest.py)
ROLES = {"writer": "writer", "rewriter": "rewriter"}


def calls(agents: list[str], seed: int = 3) -> list[Transition]:
    rng = random.Random(seed)
    return [Transition(prompt_ids=[rng.randrange(1, VOCAB) for _ in range(5)],
                       response_ids=[rng.randrange(1, VOCAB) for _ in range(4)],
                       logprobs=[-3.0] * 4, reward=None, agent=agent, rollout_id=f"r{i}", task_id="t", index=0,
                       span_id="s", finish_reason="stop")
            for i, agent in enumerate(agents)]


def adapter_weights(policy: Policy, name: str) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in policy.unwrapped().named_parameters() if f".{name}." in k}


@pytest.fixture(params=[False, True], ids=["", "kl"])
def policy(tiny_model: Path, request: pytest.FixtureRequest) -> Policy:
    """With a KL term too: its reference (the base, every adapter off) must leave every adapter trainable."""
    torch.manual_seed(0)
    return Policy(PolicyConfig(model=str(tiny_model), lora_rank=4, learning_rate=1e-2), adapters=ROLES,
                  reference=str(tiny_model) if request.param else None)


def loss_config(policy: Policy) -> LossConfig:
    return LossConfig(kl_beta=0.1 if policy.has_reference else 0.0)


def test_micro_batches_hold_one_adapters_rows_and_keep_their_indices():
    rows = calls(["writer", "rewriter", "writer", "checker"])
    batches = make_micro_batches(rows, [1.0, -1.0, 0.5, 2.0], BatchingConfig(), pad_id=0,
                                 adapter_of=lambda t: ROLES.get(t.agent))
    by_adapter = {mb.adapter: sorted(mb.index) for mb in batches}
    assert by_adapter == {"writer": [0, 2], "rewriter": [1], None: [3]}
    for mb in batches:  # each row's advantage is its own transition's
        assert mb.advantages.tolist() == [[1.0, -1.0, 0.5, 2.0][i] for i in mb.index]


def test_an_update_trains_each_adapter_on_its_own_roles_rows_only(policy: Policy):
    assert policy.adapter_names == ("writer", "rewriter")
    before = {name: adapter_weights(policy, name) for name in policy.adapter_names}
    assert all(p.requires_grad for name in before for p in policy.trainable)  # one optimizer trains them all
    pairs = [(t, 1.0 if i % 2 else -1.0) for i, t in enumerate(calls(["writer"] * 4))]
    for _ in range(2):  # B starts at 0: A moves from the second step on
        run_update(policy, pairs, UpdateConfig(), loss_config(policy), BatchingConfig(), pad_id=0, seed=0)
    writer, rewriter = adapter_weights(policy, "writer"), adapter_weights(policy, "rewriter")
    assert all(not torch.equal(writer[k], before["writer"][k]) for k in writer), "the writer's adapter trains"
    assert all(torch.equal(rewriter[k], before["rewriter"][k]) for k in rewriter), "the rewriter's does not move"

    # each micro-batch is computed by its rows' agent's adapter: the writer's now differs from the rewriter's (still
    # the base model's, its B being 0)
    rows = calls(["writer", "rewriter"], seed=9)
    batches = make_micro_batches(rows, [0.0, 0.0], BatchingConfig(), 0, adapter_of=lambda t: ROLES[t.agent])
    with torch.no_grad():
        logps = {mb.adapter: policy.token_logprobs(mb)[0] for mb in batches}
        with policy.unwrapped().disable_adapter():
            base = {mb.adapter: policy.token_logprobs(mb)[0] for mb in batches}
    torch.testing.assert_close(logps["rewriter"], base["rewriter"])
    assert (logps["writer"] - base["writer"]).abs().max() > 1e-3


def test_a_row_of_no_trained_role_is_refused(policy: Policy):
    [mb] = make_micro_batches(calls(["checker"]), [1.0], BatchingConfig(), 0)
    with pytest.raises(ValueError, match="no role's adapter"):
        policy.token_logprobs(mb)


def test_the_checkpoint_holds_every_adapter_and_restores_them(policy: Policy, tiny_model: Path, tmp_path: Path):
    pairs = [(t, 1.0 if i % 2 else -1.0) for i, t in enumerate(calls(["writer", "rewriter"] * 2))]
    for _ in range(2):
        run_update(policy, pairs, UpdateConfig(), loss_config(policy), BatchingConfig(), pad_id=0, seed=0)
    ckpt.save(tmp_path, policy, tiny_model, ckpt.TrainState(step=2))
    found = resolve_checkpoint(tmp_path)
    assert sorted(found.adapter_folders()) == ["rewriter", "writer"]
    assert all((folder / "adapter_config.json").exists() for folder in found.adapter_folders().values())
    assert found.adapter_dir is None and not (found.model_dir / "model.safetensors").exists()

    torch.manual_seed(7)
    fresh = Policy(replace(policy.config), adapters=ROLES, reference=str(tiny_model) if policy.has_reference else None)
    assert ckpt.restore(found, fresh).step == 2
    for name in ROLES.values():
        saved, restored = adapter_weights(policy, name), adapter_weights(fresh, name)
        assert saved.keys() == restored.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)

    other = Policy(replace(policy.config), adapters={"writer": "writer"})
    with pytest.raises(ValueError, match="resume with the run's"):
        ckpt.restore(found, other)


def test_a_checkpoint_of_a_role_that_never_called_resumes_with_its_adapter_fresh(policy: Policy, tiny_model: Path,
                                                                                   tmp_path: Path):
    """The rewriter never called before the checkpoint: AdamW holds no state of its adapter, and the resumed run
    starts it fresh, then trains it on its first calls."""
    writer_only = [(t, 1.0 if i % 2 else -1.0) for i, t in enumerate(calls(["writer"] * 2))]
    run_update(policy, writer_only, UpdateConfig(), loss_config(policy), BatchingConfig(), pad_id=0, seed=0)
    ckpt.save(tmp_path, policy, tiny_model, ckpt.TrainState(step=1))
    fresh = Policy(replace(policy.config), adapters=ROLES, reference=str(tiny_model) if policy.has_reference else None)
    ckpt.restore(resolve_checkpoint(tmp_path), fresh)
    before = adapter_weights(fresh, "rewriter")
    both = [(t, 1.0 if i % 2 else -1.0) for i, t in enumerate(calls(["writer", "rewriter"] * 2))]
    for _ in range(2):
        run_update(fresh, both, UpdateConfig(), loss_config(fresh), BatchingConfig(), pad_id=0, seed=0)
    after = adapter_weights(fresh, "rewriter")
    assert any(not torch.equal(after[k], before[k]) for k in after)
