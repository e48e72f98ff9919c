"""Demonstrations from a teacher end to end (``rollouts/teacher.py``): the calc example's AutoGen agent, unchanged,
runs in a real local worker against a teacher through lit's gateway, with the run's real services (vLLM on the
default model, dispatcher, collector, SQLite store). The teacher is a scripted OpenAI-compatible API
(tests/scripted_teacher.py), since a hosted one cannot be reached from the tests: it calls the calculator with the
task's right expression for some tasks and a wrong one for the others. Only the right ones give demonstrations, in
the served model's tokens."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from scripted_teacher import ScriptedTeacher

from examples.calc.agent import tool_call_text, with_numbers
from examples.calc.tasks import make_tasks
from lit_trainer.config import AgentConfig, TrainConfig
from lit_trainer.engine.config import InferenceConfig
from lit_trainer.engine.served_model import TOOL_TEMPLATE
from lit_trainer.rollouts.teacher import Teacher, collect
from lit_trainer.run.services import services

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).parents[2]
KEY_ENV = "LIT_TEST_TEACHER_KEY"


def test_the_teachers_successful_rollouts_become_demonstrations_in_the_served_models_tokens(
        prepared_model: Path, tmp_path: Path, short_temp: Path, monkeypatch: pytest.MonkeyPatch):
    from transformers import AutoTokenizer

    tasks = make_tasks("train", 4)
    wrong = {tasks[1]["id"], tasks[3]["id"]}
    by_question = {with_numbers(t["question"]): t for t in tasks}

    def reply(body: dict):
        task = by_question[body["messages"][-1]["content"]]
        return "calculator", {"expression": task["expression"] + ("+1" if task["id"] in wrong else "")}

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TMPDIR", str(short_temp))  # vLLM's sockets
    monkeypatch.setenv(KEY_ENV, "sk-teacher")
    cfg = TrainConfig(model=str(prepared_model),
                      agent=AgentConfig(function="examples.calc.agent:calc_agent", concurrency=4, max_tokens=64),
                      inference=InferenceConfig(model=str(prepared_model), cpu_kv_cache_gb=1, log_dir=str(tmp_path),
                                                extra_args=["--enforce-eager"]))
    with ScriptedTeacher(reply, key="sk-teacher") as api:
        teacher = Teacher(api.base_url, "big-model", KEY_ENV)
        with services(cfg, tmp_path / "lit.sqlite", tmp_path / "spool", tmp_path / "keys",
                      teachers=[teacher.upstream]) as svc:
            demonstrations, metrics = collect(svc.runner, tasks, teacher, 0.0, 1.0, prepared_model)

    assert metrics == {"sft/teacher_rollouts": 4.0, "sft/teacher_failed": 0.0, "sft/teacher_kept": 2.0,
                       "sft/teacher_demonstrations": 2.0, "sft/teacher_untokenizable": 0.0,
                       "sft/teacher_truncated": 0.0}
    assert len(api.requests) == 4 and all("return_token_ids" not in r and "logprobs" not in r for r in api.requests)
    assert all(h["authorization"] == "Bearer sk-teacher" for h in api.headers)
    assert sorted(d.task_id for d in demonstrations) == sorted(t["id"] for t in tasks if t["id"] not in wrong)
    tokenizer = AutoTokenizer.from_pretrained(prepared_model)
    tokenizer.chat_template = TOOL_TEMPLATE.read_text()  # what lit serves SmolLM2 with (its own has no tools)
    requests = {by_question[r["messages"][-1]["content"]]["id"]: r for r in api.requests}
    for demo in demonstrations:
        request, task = requests[demo.task_id], next(t for t in tasks if t["id"] == demo.task_id)
        assert demo.prompt_ids == tokenizer.apply_chat_template(request["messages"], tools=request["tools"],
                                                                add_generation_prompt=True)["input_ids"]
        assert tokenizer.decode(demo.response_ids) == tool_call_text(task["expression"]) + "<|im_end|>"
        assert (demo.agent, demo.index, demo.logprobs, demo.finish_reason) == ("calc", 0, None, "stop")
