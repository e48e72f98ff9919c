"""Demonstrations from a teacher and from an earlier run's store, through ``lit train`` (``[sft]``,
rollouts/teacher.py, run/demonstration_sources.py): the calc example's AutoGen agent, unchanged, runs in a real
local worker against a teacher through lit's gateway, with the run's real services (vLLM on the default model,
dispatcher, collector, SQLite store). The teacher is a scripted OpenAI-compatible API (tests/scripted_teacher.py),
since a hosted one cannot be reached from the tests: it calls the calculator with the task's right expression for
some tasks and a wrong one for the others. Only the right ones give demonstrations, in the served model's tokens;
step 1 trains on them (SFT), step 2 is RL with the SFT term, each synced and checkpointed. A second run takes its
demonstrations from the first run's store (``sft.source = "store"``): the training rollouts that reached the
success reward. (Reading demonstrations back on ``--resume`` and ``lit eval`` of the result run in
test_train_options.py's ``lora_kl``; ``lit eval``'s naming of an SFT checkpoint in test_evaluation.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from scripted_teacher import ScriptedTeacher

from examples.calc.agent import tool_call_text, with_numbers
from examples.calc.tasks import make_tasks
from lit_trainer.engine.served_model import TOOL_TEMPLATE
from lit_trainer.intake.store import SqliteStore
from lit_trainer.rollouts.demonstrations import load

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).parents[2]
KEY_ENV = "LIT_TEST_TEACHER_KEY"
CONFIG = """
model = "{model}"
[agent]
function = "examples.calc.agent:calc_agent"
concurrency = 8
max_tokens = 64
[data]
tasks = "examples.calc.tasks:make_tasks"
train_size = 4
val_size = 2
[train]
steps = 2
val_every = 0
checkpoint_every = 1
check_sync_every = 1
[rollouts]
tasks_per_step = 2
group_size = 4
[sft]
steps = 1
batch_size = 4
[inference]
cpu_kv_cache_gb = 1
log_dir = "{logs}"
extra_args = ["--enforce-eager"]
"""


def _lit(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "CI": "true"}
    done = subprocess.run([sys.executable, "-m", "lit_trainer.cli", *args], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done


def _records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


@pytest.mark.timeout(1200)
def test_a_teachers_right_rollouts_train_then_a_stored_runs_do(prepared_model: Path, tmp_path: Path,
                                                               short_temp: Path, monkeypatch: pytest.MonkeyPatch):
    from transformers import AutoTokenizer

    tasks = make_tasks("train", 4)
    wrong = {tasks[1]["id"], tasks[3]["id"]}
    by_question = {with_numbers(t["question"]): t for t in tasks}

    def reply(body: dict):
        task = by_question[body["messages"][-1]["content"]]
        return "calculator", {"expression": task["expression"] + ("+1" if task["id"] in wrong else "")}

    monkeypatch.setenv("TMPDIR", str(short_temp))  # vLLM's sockets
    monkeypatch.setenv(KEY_ENV, "sk-teacher")
    config = tmp_path / "config.toml"
    config.write_text(CONFIG.format(model=prepared_model, logs=tmp_path / "logs"))
    first = tmp_path / "teacher-run"
    with ScriptedTeacher(reply, key="sk-teacher") as api:
        options = [f"train.output_dir={first}", "sft.source='teacher'", "sft.weight=0.5", "sft.learning_rate=2e-5",
                   f"sft.teacher_url='{api.base_url}'", "sft.teacher_model='big-model'",
                   f"sft.teacher_api_key_env={KEY_ENV}"]
        _lit("train", str(config), *options)

    # captured: one teacher rollout per task, asked as a hosted API is asked, with the trainer's key
    assert len(api.requests) == 4 and all("return_token_ids" not in r and "logprobs" not in r for r in api.requests)
    assert all(h["authorization"] == "Bearer sk-teacher" for h in api.headers)
    [collected] = _records(first, "demonstrations")
    assert (collected["sft/teacher_kept"], collected["sft/demonstrations_total"]) == (2, 2), collected
    # filtered by reward, in the served model's tokens (lit serves SmolLM2 with its tool template)
    demos = load(first / "demonstrations.jsonl")
    assert sorted(d.task_id for d in demos) == sorted(t["id"] for t in tasks if t["id"] not in wrong)
    tokenizer = AutoTokenizer.from_pretrained(prepared_model)
    tokenizer.chat_template = TOOL_TEMPLATE.read_text()
    requests = {by_question[r["messages"][-1]["content"]]["id"]: r for r in api.requests}
    for demo in demos:
        request, task = requests[demo.task_id], next(t for t in tasks if t["id"] == demo.task_id)
        assert demo.prompt_ids == tokenizer.apply_chat_template(request["messages"], tools=request["tools"],
                                                                add_generation_prompt=True)["input_ids"]
        assert tokenizer.decode(demo.response_ids) == tool_call_text(task["expression"]) + "<|im_end|>"
    # trained on: step 1 on both demonstrations, step 2 RL beside the SFT term; each synced and checkpointed
    [sft] = _records(first, "sft")
    assert sft["step"] == 1 and sft["sft/demonstrations"] == 2 and sft["sft/nll"] > 0, sft
    assert sft["policy/learning_rate"] == 2e-5, sft  # sft.learning_rate; the RL step's is policy.learning_rate
    assert sft["sync/logprob_gap_max"] < 0.02, sft
    [rl] = _records(first, "train")
    assert rl["step"] == 2 and rl["sft/tokens"] > 0 and rl["sync/logprob_gap_max"] < 0.02, rl
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step-000001", "step-000002"]

    # the first run's step-2 rollouts that reached the success reward teach a second run
    with SqliteStore(first / "lit.sqlite") as store:
        right = [r for r in store.rollouts_of_step(1) if (e := store.get_episode(r.rollout_id)) and
                 e.episode_return >= 1.0]
    second = tmp_path / "store-run"
    _lit("train", str(config), f"train.output_dir={second}", "sft.source='store'", f"sft.store='{first}'",
         "train.steps=1")
    assert len(load(second / "demonstrations.jsonl")) == len(right) > 0
    [sft] = _records(second, "sft")
    assert sft["sft/demonstrations"] == min(len(right), 4) and (second / "checkpoints" / "step-000001").is_dir()
