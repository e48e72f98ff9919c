"""What ``lit train`` and ``lit eval`` start before their first rollout (``services.py``): vLLM is launched first
and loads while the local workers start, say hello and are welcomed (they then set up their tracing), so that the
workers' start-up (imports, ``lit.instrument()``: seconds) is no longer added to vLLM's. The server is the stand-in
of test_server.py, started through lit's own start-up code, which comes up only once the dispatcher knows the
worker: a run that waited for vLLM before starting its workers would wait for ever (here, until the test's
timeout); the worker, the dispatcher, the collector and the store are real."""

from __future__ import annotations

import sys
from pathlib import Path

from stand_in_vllm import STAND_IN, fake_model, fake_server

from lit_trainer.config import AgentConfig, TrainConfig
from lit_trainer.engine.config import InferenceConfig
from lit_trainer.rollouts.dispatcher import Dispatcher
from lit_trainer.services import services

TESTS = Path(__file__).parents[1]


def test_the_workers_are_welcomed_while_vllm_loads(tmp_path, monkeypatch):
    model = fake_model(tmp_path / "model")
    welcomed = tmp_path / "welcomed"  # vLLM's stand-in comes up once the test has seen the worker welcomed
    python = fake_server(tmp_path, f'while [ ! -e {welcomed} ]; do sleep 0.1; done\n'
                                   f'exec {sys.executable} {STAND_IN} "$@"')
    answer = Dispatcher.answer

    def answer_and_note(self, seconds):
        answer(self, seconds)
        if self.workers:
            welcomed.touch()

    monkeypatch.setattr(Dispatcher, "answer", answer_and_note)
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    cfg = TrainConfig(model=str(model), agent=AgentConfig(function="rollout_agents:returns_task_value"),
                      inference=InferenceConfig(model=str(model), python=str(python), log_dir=str(tmp_path),
                                                device="cpu", startup_timeout_s=120))
    with services(cfg, tmp_path / "lit.sqlite", tmp_path / "spool", tmp_path / "keys") as svc:
        assert welcomed.exists() and svc.fleet.servers[0].is_healthy() and len(svc.dispatcher.workers) == 1
