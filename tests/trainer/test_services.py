"""What ``lit train`` and ``lit eval`` start before their first rollout (``run/services.py``): vLLM is launched first
and loads while the local workers start, say hello and are welcomed (they then set up their tracing), so that the
workers' start-up (imports, ``lit.instrument()``: seconds) is no longer added to vLLM's. The server is the stand-in
of test_server.py, started through lit's own start-up code, which comes up only once the dispatcher knows the
worker: a run that waited for vLLM before starting its workers would wait for ever (here, until the test's
timeout); the worker, the dispatcher, the collector and the store are real."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from stand_in_vllm import STAND_IN, fake_model, fake_server

from lit_trainer.config import AgentConfig, TrainConfig
from lit_trainer.engine.config import InferenceConfig
from lit_trainer.rollouts.dispatcher import Dispatcher, DispatchError
from lit_trainer.run.services import services

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


def config(tmp_path, function: str) -> TrainConfig:
    model = fake_model(tmp_path / "model")
    python = fake_server(tmp_path, f'exec {sys.executable} {STAND_IN} "$@"')
    return TrainConfig(model=str(model), agent=AgentConfig(function=function),
                       inference=InferenceConfig(model=str(model), python=str(python), log_dir=str(tmp_path),
                                                 device="cpu", startup_timeout_s=120))


def test_a_local_worker_that_exits_at_start_stops_the_run_at_once(tmp_path, monkeypatch):
    """Hole: nothing watched the local workers' processes. One that exited at start (its agent failing where the
    worker runs) cost the whole vLLM load and then 180 s, ending in '0 of 1 workers connected', its own error
    scrolled away. Now the run stops as soon as the process has gone, with its exit code."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    started = time.monotonic()
    with pytest.raises(DispatchError, match=r"a local agent worker \(pid \d+\) exited with code 3; its own lines"):
        with services(config(tmp_path, "exits_in_workers:agent"), tmp_path / "lit.sqlite", tmp_path / "spool",
                      tmp_path / "keys"):
            pass
    assert time.monotonic() - started < 60


def test_a_local_worker_killed_mid_run_stops_the_run_and_says_how(tmp_path, monkeypatch):
    """Hole: a local worker killed by the kernel (out of memory) was noticed after worker_timeout_s of silence,
    and with no other worker the run waited 300 s more and told the user to start one with lit worker."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    with services(config(tmp_path, "rollout_agents:kills_its_worker"), tmp_path / "lit.sqlite", tmp_path / "spool",
                  tmp_path / "keys") as svc:
        started = time.monotonic()
        with pytest.raises(DispatchError, match=r"was killed by SIGKILL \(out of memory\?"):
            svc.runner.run([{"id": 0}], 1, 1.0, 0, "train", 0)
        assert time.monotonic() - started < 10  # not worker_timeout_s (30 s), nor no_worker_timeout_s (300 s)
