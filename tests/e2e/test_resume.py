"""A run stopped with Ctrl-C between checkpoints, then resumed, with nothing stood in (real vLLM, worker, ZeroMQ,
SQLite): the interrupted run says how to go on, and the resumed one trains the steps after its checkpoint again.
What the stopped run had logged of those steps used to stay in metrics.jsonl, so that each came twice in the curve
and in ``Run.metrics``, and its rollouts of them were listed beside the resumed run's; they are now set aside
(``metrics.superseded.jsonl``; the store marks the rollouts superseded), none deleted; it logs to a W&B run of its
own (offline here), since W&B keeps a step once. SIGTERM stops it as Ctrl-C does."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from wandb_offline import go_offline, run_ids

from lit_sdk.processes import group_members
from lit_trainer.results.runs import WANDB_ID_FILE, Run

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TESTS = Path(__file__).parents[1]

CONFIG = """
model = "{model}"
[agent]
function = "rollout_agents:reply_length_parity"
concurrency = 4
max_tokens = 16
[data]
tasks = "rollout_agents:parity_tasks"
train_size = 8
val_size = 4
[train]
steps = 3
val_every = 1
checkpoint_every = 2
output_dir = "{out}"
[rollouts]
tasks_per_step = 1
group_size = 2
[inference]
cpu_kv_cache_gb = 1
# vLLM without torch.compile starts about 24 s sooner (bench/vllm_start.py); the compiled default runs in the
# session server (conftest.py), test_server.py's engine-core test and test_train_options.py's lit eval
extra_args = ["--enforce-eager"]
"""


WANDB = ["train.trackers=['wandb']"]
"""The interrupted run's tracker (offline: ``go_offline``)."""


def _lit_train(config: Path, *args: str, interrupt_after: str | None = None) -> tuple[int, str, str]:
    """``lit train config args`` in a session of its own; with ``interrupt_after``, Ctrl-C as a terminal sends it
    (SIGINT to the whole process group) once that line is printed. (return code, stdout, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(TESTS), "CI": "true"}
    errors = config.with_name(f"stderr-{time.monotonic_ns()}.txt")
    with errors.open("w") as sink, subprocess.Popen(
            [sys.executable, "-m", "lit_trainer.cli", "train", str(config), *args], env=env, stdout=subprocess.PIPE,
            stderr=sink, text=True, start_new_session=True) as proc:
        out = []
        try:
            for line in proc.stdout:
                out.append(line)
                if interrupt_after is not None and line.startswith(interrupt_after):
                    os.killpg(proc.pid, signal.SIGINT)
                    interrupt_after = None
            code = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert group_members(proc.pid) == [], f"processes of lit train outlived it: {group_members(proc.pid)}"
    return code, "".join(out), errors.read_text()


def test_a_run_interrupted_between_checkpoints_resumes_and_sets_aside_what_it_trains_again(
        prepared_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    go_offline(monkeypatch, tmp_path)
    out = tmp_path / "run"
    config = tmp_path / "config.toml"
    config.write_text(CONFIG.format(model=prepared_model, out=out))
    # stopped during the validation after step 3, before that step's checkpoint (the last is step 2's)
    code, stdout, stderr = _lit_train(config, *WANDB, interrupt_after="step 3/3")
    assert code == 130 and "lit: interrupted" in stderr and "Traceback" not in stderr, stderr[-3000:]
    again = shlex.join(["lit", "train", str(config), *WANDB, "--resume"])  # the overrides it was given go with it
    assert (f"lit: stopped: `{again}` continues from the last checkpoint, step 2 "
            f"({out / 'checkpoints' / 'step-000002'}); the steps after it train again") in stderr, stderr[-3000:]
    assert not (out / "checkpoints" / "step-000003").exists()
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if r["kind"] == "train"] == [1, 2, 3]
    with Run(out) as run:
        stopped_run_step_3 = {r.rollout_id for r in run.rollouts(step=3)}
    assert len(stopped_run_step_3) == 2
    stopped_wandb = (out / WANDB_ID_FILE).read_text().strip()
    assert run_ids(out) == [stopped_wandb]

    code, stdout, stderr = _lit_train(config, *WANDB, "--resume")
    assert code == 0 and "resumed from" in stderr and "(step 2)" in stderr, stderr[-3000:]
    assert "settings other than" not in stderr, stderr[-3000:]  # resumed with the settings it stopped with
    assert "lit: the run that stopped here had logged steps after step 2, which this run trains again: its 1 " \
           "metrics record(s) of them moved to metrics.superseded.jsonl" in stderr, stderr[-3000:]
    assert "step 3/3" in stdout and "step 2/3" not in stdout, stdout
    # W&B keeps a step once: the resumed run, which trains step 3 again, logs to a W&B run of its own
    resumed_wandb = (out / WANDB_ID_FILE).read_text().strip()
    assert (f"lit: W&B: logging to a new W&B run, {resumed_wandb}: the folder's earlier one, {stopped_wandb}, holds "
            "steps this run trains again") in stderr, stderr[-3000:]
    assert run_ids(out) == [stopped_wandb, resumed_wandb]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]  # each step once
    assert [r["step"] for r in records if r["kind"] == "validation"] == [0, 1, 2, 3]
    aside = [json.loads(line) for line in (out / "metrics.superseded.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in aside] == [("train", 3)]
    assert aside[0]["time"] < records[-2]["time"]  # the stopped run's step 3, not the resumed run's
    assert (out / "checkpoints" / "step-000003" / "DONE").exists() and (out / "curve.png").stat().st_size > 0
    with Run(out) as run:
        step_3 = {r.rollout_id for r in run.rollouts(step=3)}
        assert len(step_3) == 2 and not step_3 & stopped_run_step_3  # the resumed run's own
        assert {r.rollout_id for r in run.rollouts(step=3, superseded=True)} == stopped_run_step_3
        assert len(run.rollouts(step=2)) == 2 and run.rollouts(step=2, superseded=True) == []  # kept
        print(f"set aside: {len(aside)} record, {len(stopped_run_step_3)} training rollouts of step 3 and "
              f"{len(run.rollouts(step=3, validation=True, superseded=True))} of the validation after it")


def _cmdline(process) -> str:
    """A process's command line, or "" for one that ended while we looked (a zombie, or gone)."""
    import psutil

    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def test_sigterm_stops_lit_train_as_ctrl_c_does_with_its_vllm_server(prepared_model: Path, tmp_path: Path):
    """``kill``, a job scheduler's or a container's stop sends SIGTERM to the trainer alone: it used to end on the
    spot, saying nothing, its vLLM server left to the kernel's parent-death signal. It now stops as Ctrl-C does
    (here while vLLM starts): its server stopped, how to go on said, exit code 143."""
    import psutil

    config = tmp_path / "config.toml"
    config.write_text(CONFIG.format(model=prepared_model, out=tmp_path / "run"))
    env = {**os.environ, "PYTHONPATH": str(TESTS), "CI": "true"}
    with subprocess.Popen([sys.executable, "-m", "lit_trainer.cli", "train", str(config)], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
        try:
            trainer, deadline, server = psutil.Process(proc.pid), time.monotonic() + 300, []
            while not server and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.2)
                server = [p for p in trainer.children(recursive=True) if "vllm" in _cmdline(p)]
            assert server, "no vLLM server started"
            descendants = trainer.children(recursive=True)
            proc.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 143 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-2:] == [
        f"lit: stopped before the first checkpoint: `lit train {config}` starts again in {tmp_path / 'run'} (what "
        "this run logged is set aside there, not deleted)", "lit: stopped by SIGTERM"], stderr[-3000:]
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert alive == [], f"processes of lit train outlived it: {alive}"
