"""One policy per role end to end in ``lit train``, nothing stood in (real vLLM serving LoRA adapters, worker, ZeroMQ,
SQLite): a three-agent rollout (``rollout_agents.three_role_parity``: writer, rewriter, checker, each named by a
nested ``@lit.trace(agent=...)``, all calling the one ``llm.model`` they were given) with a ``[roles]`` table:
the writer and the rewriter each train an adapter of their own, the checker is served by the base model, and a
``judge`` that no rollout has is reported after the first step. Two steps train, with a KL term to the base,
truncated importance sampling and asynchronous rollouts (each step's rollouts run during the update before); each
adapter is pushed into vLLM after each update and checked against the trainer's logprobs; every call in the store
was answered by its agent's adapter (the engine's own answer names it) at a version the staleness allows; the
checkpoint holds both adapters, ``--resume`` trains step 3, and ``lit eval`` serves the checkpoint's adapters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TESTS = Path(__file__).parents[1]

CONFIG = """
model = "{model}"
[agent]
function = "rollout_agents:three_role_parity"
concurrency = 8
max_tokens = 12
temperature = 0.7
[data]
tasks = "rollout_agents:parity_tasks"
train_size = 20
val_size = 4
[train]
steps = 2
val_every = 0
checkpoint_every = 0
check_sync_every = 1
output_dir = "{out}"
[rollouts]
tasks_per_step = 2
group_size = 4
max_staleness = 1
[update]
recompute_old_logprobs = true
[loss]
kl_beta = 0.05
is_correction = "truncate"
[policy]
learning_rate = 1e-3
lora_rank = 8
[roles]
writer = "own"
rewriter = "own"
checker = "base"
judge = "own"
[inference]
cpu_kv_cache_gb = 1
extra_args = ["--enforce-eager"]
"""
SERVED = {"writer": "policy-writer", "rewriter": "policy-rewriter", "checker": "policy"}


def _lit(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(TESTS), "CI": "true"}
    return subprocess.run([sys.executable, "-m", "lit_trainer.cli", *args], env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.timeout(1200)  # three vLLM starts: about 3 min alone
def test_two_roles_train_their_own_adapters_served_by_name_checkpointed_resumed_and_evaluated(
        prepared_model: Path, tmp_path: Path):
    out = tmp_path / "run"
    config = tmp_path / "config.toml"
    config.write_text(CONFIG.format(model=prepared_model, out=out))
    first = _lit("train", str(config))
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    assert ("lit: warning: the [roles] table trains ['judge'], but no call of the first step came from it"
            in first.stderr), first.stderr[-3000:]
    resumed = _lit("train", str(config), "train.steps=3", "--resume")
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]

    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert r["role/writer/calls"] > 0 and r["role/rewriter/calls"] > 0 and r["role/judge/calls"] == 0, r
        assert r["update/skipped_wrong_adapter"] == 0, r
        if "time/update" in r:  # each adapter's push reached vLLM: its logprobs are the trainer's
            assert r["role/writer/sync_logprob_gap"] < 0.02 and r["role/rewriter/sync_logprob_gap"] < 0.02, r
            assert "loss/kl" in r and "mismatch/k3" in r, r
    assert any("time/update" in r for r in train)
    served_by_role(out / "lit.sqlite")

    checkpoint = out / "checkpoints" / "step-000003"
    assert sorted(p.name for p in (checkpoint / "adapters").iterdir() if p.is_dir()) == ["judge", "rewriter", "writer"]
    evaluated = _lit("eval", str(config), "--checkpoint", str(out), "--output", str(tmp_path / "eval.json"))
    assert evaluated.returncode == 0, (evaluated.stdout + evaluated.stderr)[-3000:]
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["step"] == 3 and result["tasks"] == 4 and result["rollouts/failed"] == 0
    served_by_role(Path(result["output_dir"]) / "eval.sqlite", evaluation=True)


def served_by_role(store_path: Path, evaluation: bool = False) -> None:
    """Every LLM call of the store was answered by its agent's adapter (the checker's by the base model), as the
    engine's answer recorded by lit's gateway names it; a training step's calls at the weight version of the step
    before it, or the one before that (``rollouts.max_staleness = 1``)."""
    from lit_sdk import semconv as sc
    from lit_trainer.intake.store import SqliteStore
    from lit_trainer.steps import kind_of

    seen = set()
    with SqliteStore(store_path) as store:
        for step in range(4):
            for row in store.rollouts_of_step(step):
                if kind_of(row.rollout_id) != ("validation" if evaluation else "training"):
                    continue
                for span in store.spans_of_rollout(row.rollout_id):
                    if span.name != sc.ENGINE_CALL_SPAN:
                        continue
                    agent, model = span.attributes[sc.AGENT_NAME], span.attributes[sc.LLM_MODEL]
                    assert model == SERVED[agent], (row.rollout_id, agent, model)
                    seen.add(agent)
                    if not evaluation:  # training step s = step + 1
                        assert int(span.attributes[sc.LLM_WEIGHT_VERSION]) in (step, step - 1), span.attributes
    assert seen == set(SERVED), seen
