"""A vLLM server on another host joins a run (``inference.remote``), with nothing stood in: ``lit serve`` runs a
real vLLM in a network namespace (tests/netns.py: for the network, another host), and ``lit train`` runs the
trainer, its own local vLLM and a worker here. The agents' calls go to both servers (through lit's gateway, by
load), and every step's weights reach the remote server over the network (ZeroMQ with the trainer's keys, written
into that side's shared memory and reloaded in place), checked by the sync check's logprobs on each server.

The remote ``lit serve`` is killed (SIGKILL, its vLLM with it) once step 1's sync check is done: step 2's rollouts
find it gone, the run drops it and goes on with the local server. ``lit serve`` is started again meanwhile; step 2's
weight push finds it answering and takes it back with that step's weights. A small harness in the trainer's process
waits at those two points for the test (files in the run's folder), so that the kill and the return land at the
same steps every time. Then ``--resume`` trains step 3 on both: the remote server gets the checkpoint's weights
first. (``lit eval`` serves only local servers: tests/trainer/engine/test_fleet.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from netns import Network, other_host

from lit_sdk.processes import start_child, stop_child
from lit_trainer import cli

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TESTS = Path(__file__).parents[1]

CONFIG = """
model = "{model}"
[agent]
function = "rollout_agents:reply_length_parity"
concurrency = 8
max_tokens = 16
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
[policy]
learning_rate = 1e-5
[loss]
kl_beta = 0.001  # every step updates and pushes, even one whose groups all got equal rewards
[security]
keys_dir = "{keys}"
[inference]
cpu_kv_cache_gb = 1
remote = ["tcp://{remote}:7400"]
extra_args = ["--enforce-eager"]
"""

HARNESS = """
import sys, time
from pathlib import Path
import lit_trainer.run.pipeline as pipeline

out = Path(sys.argv[1])
check, push = pipeline.check, pipeline.push


def wait_for(name):
    while not (out / name).exists():
        time.sleep(0.2)


def check_then_wait(fleet, policy, pairs, cfg, step, *args):
    metrics = check(fleet, policy, pairs, cfg, step, *args)
    if step == 1:  # the test kills lit serve now, before step 2's rollouts
        (out / "kill-remote").touch()
        wait_for("remote-killed")
    return metrics


def wait_then_push(fleet, state, step):
    if step == 2:  # lit serve is up again: this push takes it back
        wait_for("remote-back")
    return push(fleet, state, step)


pipeline.check, pipeline.push = check_then_wait, wait_then_push
from lit_trainer.cli import main
sys.exit(main(sys.argv[2:]))
"""


def start_lit_serve(network: Network, config: Path, keys: Path, log: Path, wait: bool = True) -> subprocess.Popen:
    """``lit serve`` on the other host, its vLLM on port 8000 bound to core 1 (the local vLLM's OpenMP threads
    bind core 0) and logging each request it receives into the folder ``log`` without its suffix; its output in
    ``log``; returns once it says the server is ready (``wait``), or at once."""
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    cmd = network.command(sys.executable, "-m", "lit_trainer.cli", "serve", str(config),
                          "inference.cpu_threads_bind='1'", f"inference.log_dir='{log.with_suffix('')}'",
                          "inference.extra_args=['--enforce-eager','--enable-log-requests']", "--keys", str(keys))
    with log.open("w") as sink:
        process = start_child(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while wait and "lit serve: vLLM serves" not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    return process


def chat_requests(log: Path) -> int:
    """How many chat completions (the agents' calls; the sync check's are plain completions) lit serve's vLLM
    received, from its request log."""
    return sum(len(re.findall(r"Received request chatcmpl-", f.read_text(errors="replace")))
               for f in log.with_suffix("").glob("*.log"))


def answers(network: Network) -> bool:
    """Whether the remote vLLM answers ``/health``."""
    try:
        with urllib.request.urlopen(f"http://{network.other_host}:8000/health", timeout=2):
            return True
    except OSError:
        return False


@pytest.mark.timeout(1500)
def test_a_remote_server_trains_is_dropped_when_killed_taken_back_and_resumed_with(prepared_model, tmp_path,
                                                                                     short_temp):
    keys, out = tmp_path / "keys", tmp_path / "run"
    assert cli.main(["keys", "generate", str(keys)]) == 0
    out.mkdir()
    with other_host("lit serve") as network:
        config = tmp_path / "config.toml"
        config.write_text(CONFIG.format(model=prepared_model, out=out, keys=keys, remote=network.other_host))
        first_log, second_log = tmp_path / "serve-1.log", tmp_path / "serve-2.log"
        remote = start_lit_serve(network, config, keys, first_log, wait=False)  # the trainer waits for it
        train_log, train = tmp_path / "train.log", None
        try:
            env = {**os.environ, "PYTHONPATH": str(TESTS), "CI": "true", "TMPDIR": str(short_temp)}
            with train_log.open("w") as sink:  # a process of its own group, stopped below whatever happens
                train = start_child([sys.executable, "-c", HARNESS, str(out), "train", str(config),
                                     "inference.cpu_threads_bind='0'"], env=env, stdout=sink, stderr=subprocess.STDOUT)
            while not (out / "kill-remote").exists():
                assert train.poll() is None, train_log.read_text()[-3000:]
                time.sleep(0.2)
            os.killpg(remote.pid, signal.SIGKILL)
            remote.wait(30)
            while answers(network):  # its vLLM, told by the kernel its parent died, lets go of the port
                time.sleep(0.5)
            (out / "remote-killed").touch()
            remote = start_lit_serve(network, config, keys, second_log)
            (out / "remote-back").touch()
            train.wait(900)
            log = train_log.read_text()
            assert train.returncode == 0, log[-4000:]

            resumed = subprocess.run([sys.executable, "-m", "lit_trainer.cli", "train", str(config), "--resume",
                                      "train.steps=3", "inference.cpu_threads_bind='0'"],
                                     env=env, capture_output=True, text=True, timeout=900)
            assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
        finally:
            if train is not None:
                stop_child(train, 30, name="lit train")  # at once when it ended; its vLLM and worker with it
            stop_child(remote, 30, name="lit serve")
        assert remote.returncode in (0, -signal.SIGTERM), second_log.read_text()[-2000:]

    assert chat_requests(first_log) > 0 and chat_requests(second_log) > 0  # it served rollouts before and after
    assert "stopped answering during the rollouts of step 2" in log, log[-4000:]
    assert "answers again: taken back with this push" in log, log[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == [1, 2, 3]
    assert [r["engine/restarts"] for r in train_records] == [0, 1, 0]  # dropped once, in step 2
    assert [r["engine/serving"] for r in train_records] == [2, 2, 2]  # back by the end of step 2
    assert all(r["rollouts/failed"] == 0 for r in train_records), train_records
    # the weights reached both servers every step: each one's logprobs matched the trainer's
    assert [r["sync/servers_checked"] for r in train_records] == [2, 2, 2]
    assert all(r["sync/logprob_gap_max"] < 0.02 for r in train_records), train_records
    first, second = first_log.read_text(), second_log.read_text()
    assert "weights of version 0 loaded" in first and "weights of version 1 loaded" in first, first[-2000:]
    assert "weights of version 2 loaded" not in first
    # taken back with step 2's push; the resumed run gives it the checkpoint's weights once, as it joins (the
    # resume's push skips it), then step 3's
    assert second.count("weights of version 2 loaded") == 2 and "weights of version 3 loaded" in second, second
    assert "weights of version 0 loaded" not in second, second
