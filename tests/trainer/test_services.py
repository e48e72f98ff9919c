"""What ``lit train`` and ``lit eval`` start before their first rollout (``services.py``): vLLM is launched first
and loads while the local workers start, say hello and are welcomed (they then set up their tracing), so that the
workers' start-up (imports, ``lit.instrument()``: seconds) is no longer added to vLLM's. The server is the stand-in
of test_server.py, started through lit's own start-up code, which comes up only once the dispatcher knows the
worker: a run that waited for vLLM before starting its workers would wait for ever (here, until the test's
timeout); the worker, the dispatcher, the collector and the store are real."""

from __future__ import annotations

import sys
from pathlib import Path

from lit_trainer.config import AgentConfig, TrainConfig
from lit_trainer.engine.config import InferenceConfig
from lit_trainer.rollouts.dispatcher import Dispatcher
from lit_trainer.services import services

TESTS = Path(__file__).parents[1]
STAND_IN = TESTS / "trainer" / "engine" / "_vllm_stand_in.py"


def test_the_workers_are_welcomed_while_vllm_loads(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 64}')
    welcomed = tmp_path / "welcomed"
    # vLLM's stand-in comes up once the test has seen the worker welcomed (the probes go to the real vLLM's python)
    from lit_trainer.engine.launch import vllm_python

    python = tmp_path / "fake-python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then exec {vllm_python(InferenceConfig())} "$@"; fi\n'
                      f'while [ ! -e {welcomed} ]; do sleep 0.1; done\nexec {sys.executable} {STAND_IN} "$@"\n')
    python.chmod(0o755)
    answer = Dispatcher.answer

    def answer_and_note(self, seconds):
        answer(self, seconds)
        if self.workers:
            welcomed.touch()

    monkeypatch.setattr(Dispatcher, "answer", answer_and_note)
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    cfg = TrainConfig(model=str(model), agent=AgentConfig(function="rollout_agents:returns_task_value"),
                      inference=InferenceConfig(model=str(model), python=str(python), log_dir=str(tmp_path),
                                                device="cpu", startup_timeout_s=120))
    with services(cfg, tmp_path / "lit.sqlite", tmp_path / "spool", tmp_path / "keys") as svc:
        assert welcomed.exists() and svc.fleet.servers[0].is_healthy() and len(svc.dispatcher.workers) == 1
