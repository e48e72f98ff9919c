"""The learner on a second device, without a GPU: every tensor a training step touches must be on the device the
learner computes on. ``second_device.py`` makes one (``simgpu:0``, computing with the CPU's kernels) that refuses an
operation mixing its tensors with CPU tensors, as CUDA does; each scenario (``placement_scenarios.py``) runs once on
the CPU and once with the policy's models on that device, all in one interpreter of their own, and must give the
same numbers. Before the placement was done in one place (``Policy.place``), the update failed here as it did on an
H200: ``Expected all tensors to be on the same device``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
SRC = HERE.parents[2] / "src"


def run(model: Path, *scenarios: str) -> dict:
    """Each scenario's results on the CPU and on ``simgpu``, in an interpreter of its own (no GPU visible)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(SRC), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(HERE / "second_device.py"), str(model), *scenarios], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def results(tiny_model: Path) -> dict:
    return run(tiny_model, *SCENARIOS)


def assert_same(cpu: object, device: object, where: str = "", rel: float = 1e-5) -> None:
    """The same structure with the same numbers (to float32 rounding: the same kernels ran, in the same order)."""
    if isinstance(cpu, dict):
        assert sorted(cpu) == sorted(device), where
        for key in cpu:
            assert_same(cpu[key], device[key], f"{where}/{key}", rel)
    elif isinstance(cpu, list):
        assert len(cpu) == len(device), where
        for i, (a, b) in enumerate(zip(cpu, device, strict=True)):
            assert_same(a, b, f"{where}[{i}]", rel)
    elif isinstance(cpu, float):
        assert device == pytest.approx(cpu, rel=rel, abs=rel / 10), where
    else:
        assert cpu == device, where


SCENARIOS = ("full_fine_tune", "bonus_and_guidance", "lora", "sync")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_learner_runs_on_a_second_device_as_on_the_cpu(scenario: str, results: dict):
    cpu, device = results[scenario]["cpu"], results[scenario]["simgpu"]
    assert cpu.pop("device") == "cpu" and device.pop("device") == "simgpu:0"
    assert_same(cpu, device)
    if scenario != "sync":
        metrics = cpu["metrics"]
        assert metrics["policy/grad_norm"] > 0 and metrics["update/optimizer_steps"] >= 1, metrics
        assert cpu["trainer_logprobs"], "the trainer's logprobs were kept for the viewer"
    else:
        sums = cpu["file_sums"]
        assert sums["float32"] > 0 and sums["bfloat16"] == pytest.approx(sums["float32"], rel=1e-2)
