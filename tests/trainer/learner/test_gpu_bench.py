"""bench/gpu_update.py end to end with ``--tiny`` on the CPU: every run measured, with positive, finite and
consistent numbers, and the markdown table written. The figure itself needs a GPU (bench/gpu/run_on_device.sh)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RUNS = {("lit", "bf16", "agent", 0), ("lit", "bf16", "agent", 128), ("lit", "bf16", "long", 0),
        ("plain", "bf16", "agent", 128), ("lit", "fp32", "agent", 0), ("lit", "fp32", "long", 0)}
"""(path, precision, batch, micro-batch budget; 0: the device's) of every run --tiny plans."""
FIGURES = ("s_per_update", "response_tok_s", "computed_tok_s", "tflop_s", "mfu", "mfu_6n", "peak_gib",
           "flops_per_update", "warmup_s")
RESPONSE_TOKENS = {"agent": 2 * 4 * 16, "long": 4 * 64}
"""--tiny's batches: 2 groups x 4 rollouts of 16 tokens; one group of 4 x 64."""
HEADER = "| update | s/update | response tok/s | peak GiB | computed tok/s | TFLOP/s | MFU |"


@pytest.mark.slow  # about 40 s on 2 cores: bf16 autocast is slow on a CPU
def test_tiny_run_measures_every_run(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU (and its 2048-token default budget) on any machine
    done = subprocess.run([sys.executable, "bench/gpu_update.py", "--tiny", "--out", str(tmp_path),
                           "--peak-tflops", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads((tmp_path / "gpu_update.json").read_text())
    runs = {(r["path"], r["precision"], r["batch"], r["budget"]): r for r in result["runs"]}
    assert set(runs) == RUNS and len(result["runs"]) == len(RUNS)
    for key, r in runs.items():
        assert r["status"] == "ok", r
        for name in FIGURES:
            value = r[name]
            assert isinstance(value, int | float) and math.isfinite(value) and value > 0, (key, name, value)
        assert r["times_s"] and all(t > 0 for t in r["times_s"]), r
        assert r["response_tokens"] == RESPONSE_TOKENS[r["batch"]], r
        assert r["response_tok_s"] * r["s_per_update"] == pytest.approx(r["response_tokens"], rel=1e-2)
        assert r["computed_tok_s"] * r["s_per_update"] == pytest.approx(r["computed_positions"], rel=1e-2)
        assert r["mfu"] == pytest.approx(r["tflop_s"] / 1.0, rel=1e-2, abs=1e-4)  # --peak-tflops 1
        if r["path"] == "lit":
            assert r["policy_precision"] == r["precision"], r
            assert r["head_positions"] == r["response_tokens"], r  # the LM head on response positions only

    lit, plain = runs[("lit", "bf16", "agent", 128)], runs[("plain", "bf16", "agent", 128)]
    assert (lit["micro_batches"], plain["micro_batches"]) == (2, 8)  # a 128-token group each; one 80-token row each
    assert lit["computed_positions"] == 2 * (64 + 4 * 15)  # each prompt once, each response less its last token
    assert plain["computed_positions"] == plain["head_positions"] == 8 * 80  # every row whole
    assert runs[("lit", "bf16", "agent", 0)]["micro_batch_budget"] == 2048
    for precision in ("bf16", "fp32"):  # the 2048-token prompt alone is over the budget: whole, checkpointed
        long = runs[("lit", precision, "long", 0)]
        assert (long["micro_batches"], long["over_budget"]) == (1, 1), long

    gap = result["logprob_bf16_vs_fp32"]
    assert gap["tokens"] == RESPONSE_TOKENS["agent"] and 0 < gap["mean"] <= gap["max"] < 0.5, gap
    assert all(t["value"] is not None and t["met"] in (True, False) for t in result["targets"].values())

    table = (tmp_path / "gpu_update.md").read_text()
    assert HEADER in table and result["environment"]["torch"] in table
    rows = [line for line in table.splitlines() if line.startswith(("| agent:", "| long:"))]
    assert len(rows) == len(RUNS)
    for r, row in zip(result["runs"], rows, strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0].startswith(r["label"]) and len(cells) == 7, row
        assert float(cells[1]) == pytest.approx(r["s_per_update"], abs=1e-3)
