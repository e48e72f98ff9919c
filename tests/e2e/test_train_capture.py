"""Agents lit sees only at the engine, trained by ``lit train`` with nothing stood in (real vLLM, workers, ZeroMQ,
SQLite): the OpenAI Agents SDK's default agent (the Responses API) and a streamed LangChain chat in one Python
agent, and the Node.js calc agent (examples/js_calc), a program without a line of lit. Each trains a step, its
rollouts' every LLM call one transition with the engine's ids, and the weights reach vLLM (the sync check).
One step each: the test_train_options runs take every option through resume and eval, with the gateway in front
of vLLM there too."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import msgpack
import pytest
from test_train_options import CONFIG, _lit

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).parents[2]

ONE_STEP = ["train.steps=1", "rollouts.tasks_per_step=2", "rollouts.group_size=8", "agent.concurrency=16",
            "inference.extra_args=['--enforce-eager']"]
"""One step of 2 tasks x 8 rollouts: a group whose 8 rewards are all alike has nothing to train on, and with
rewards of about even odds both groups are so once in 16,000 runs (the calc agent, right about a third of the time
at first: 4 tasks, once in 90,000)."""
FRAMEWORKS = ["agent.function='rollout_agents:two_framework_parity'", "agent.max_tokens=12",
              "inference.cpu_kv_cache_gb=1", *ONE_STEP]
"""test_train_options' config (parity rewards) with this agent."""
JS = [*ONE_STEP, "rollouts.tasks_per_step=4", "train.val_every=0", "train.checkpoint_every=0",
      "train.check_sync_every=1", "data.train_size=20", "data.val_size=4"]


def _trained(out: Path, log: str) -> list[dict]:
    """Each step's metrics, once checked: every rollout succeeded, a step that updated also synced and vLLM serves
    the trainer's weights."""
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1], log[-3000:]
    for r in train:
        assert r["rollouts/failed"] == 0 and r["rollouts/unusable"] == 0, r
        assert ("time/update" in r) == ("sync/logprob_gap_max" in r), r
        if "time/update" in r:
            assert r["sync/logprob_gap_max"] < 0.02, r
    assert all(r.get("update/transitions") for r in train), "no group with differing rewards"
    return train


def _episodes(out: Path) -> list[dict]:
    with sqlite3.connect(out / "lit.sqlite") as db:
        return [msgpack.unpackb(row[0]) for row in db.execute("SELECT data FROM episodes")]


@pytest.mark.timeout(900)
def test_the_agents_sdk_default_agent_and_a_streamed_langchain_chat_train(prepared_model: Path, tmp_path: Path):
    out = tmp_path / "run"
    config = tmp_path / "config.toml"
    config.write_text(CONFIG.format(model=prepared_model, out=out, logs=tmp_path / "vllm-logs"))
    run = _lit("train", str(config), *FRAMEWORKS)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-3000:]
    _trained(out, log)
    episodes = _episodes(out)
    assert len(episodes) == 16  # 2 tasks x 8
    for episode in episodes:  # the Agents SDK's call (named by its agent) and LangChain's streamed one
        agents = [t["agent"] for t in episode["transitions"]]
        assert len(agents) == 2 and agents[0] == "writer", agents
        assert all(t["logprobs"] and len(t["logprobs"]) == len(t["response_ids"]) for t in episode["transitions"])


@pytest.mark.timeout(900)
def test_the_node_calc_agent_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    assert (ROOT / "examples/js_calc/node_modules/openai").is_dir(), \
        "examples/js_calc's npm packages are missing: bash run.sh test installs them (npm ci)"
    monkeypatch.chdir(ROOT)  # the example's command and tasks are found from the repository's root
    out = tmp_path / "run"
    run = _lit("train", "examples/js_calc/config.toml", f"train.output_dir='{out}'", f"inference.log_dir='{tmp_path}'",
                 *JS)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-3000:]
    _trained(out, log)
    episodes = _episodes(out)
    assert len(episodes) == 32  # 4 tasks x 8
    for episode in episodes:  # the program's streamed calls, seen at the engine only
        assert 1 <= len(episode["transitions"]) <= 2 and episode["final_reward"] in (0.0, 1.0)
