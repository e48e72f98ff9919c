"""``lit worker --connect``: an address that is not a dispatch endpoint is refused in one line, and a worker that no
trainer answers says so (it used to wait without a word, or print a 32-line ZeroMQ traceback)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys

import pytest

from lit_sdk import worker
from lit_sdk.worker import Worker, check_endpoint


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:7374", "tcp://trainer.example:1", "ipc:///tmp/lit-dispatch"])
def test_dispatch_endpoints_are_accepted(endpoint: str):
    check_endpoint(endpoint)


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:7374", "tcp://127.0.0.1", "127.0.0.1:7374", "tcp://:7374",
                                      "tcp://127.0.0.1:port", "ipc://"])
def test_other_addresses_are_refused_with_the_form_to_use(endpoint: str):
    why = "not an http:// URL" if endpoint.startswith("http") else "with its host and port"
    with pytest.raises(ValueError, match=r"is not the trainer's dispatch endpoint: give it as tcp://HOST:PORT.*" + why):
        check_endpoint(endpoint)


def test_lit_worker_with_an_http_url_fails_in_one_line():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "worker", "--connect", "http://127.0.0.1:7374",
                          "rollout_agents:returns_task_value"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [
        "lit worker: error: --connect 'http://127.0.0.1:7374' is not the trainer's dispatch endpoint: give it as "
        "tcp://HOST:PORT (lit train prints it at start: 'lit: workers connect to tcp://...'; the port is that of "
        "dispatch_endpoint.endpoint), not an http:// URL"]


def test_a_worker_no_trainer_answers_says_so_and_keeps_trying(monkeypatch, caplog):
    with socket.socket() as free:  # a port nothing listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    monkeypatch.setattr(worker, "NO_ANSWER_S", 0.3)

    async def main() -> list[str]:
        w = Worker(lambda task, llm: 1.0, f"tcp://127.0.0.1:{port}", heartbeat_s=0.1)
        running = asyncio.create_task(w.run())
        await asyncio.sleep(0.9)  # said once 0.3 s passed, again at 0.6 s; the next would come at 1.2 s
        w._stop.set()
        await running
        return [r.getMessage() for r in caplog.records if "no answer from a trainer" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="lit"):
        said = asyncio.run(main())
    assert len(said) == 2, said
    assert said[0].startswith(f"lit worker: no answer from a trainer at tcp://127.0.0.1:{port} for 0 s; is lit train "
                              "running, and is this its dispatch endpoint")


def test_lit_worker_processes_reports_each_process_that_exits_with_an_error():
    """Hole: ``lit worker --processes N`` waited for its processes one after the other and said nothing of one that
    died; its exit code came at the very end. Each one that exits with an error is named as it does."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "worker", "--connect", "tcp://127.0.0.1:9",
                          "--processes", "2", "exits_in_workers:agent"],  # its import ends each worker process
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 3, out.stderr[-3000:]
    reports = [line for line in out.stderr.splitlines() if line.startswith("lit worker: process ")]
    assert len(reports) == 2 and all(" exited with code 3 (its lines above say why); " in r for r in reports)
    assert reports[0].endswith("1 of 2 go on") and reports[1].endswith("0 of 2 go on"), reports
