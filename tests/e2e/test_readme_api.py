"""The README's Python snippet ("From Python, and in a notebook"), run as it is written, from the checkout's root:
only its output folder (``runs/try``) becomes a temporary one. Nothing is stood in: it trains the calc agent for
two steps and evaluates the checkpoint, each with a real vLLM. Checks follow the snippet, in the same process: the
names it uses are still the API's functions after ``lt.train`` (once, ``lt.evaluate`` had become a module), and
each call gave what its comment says. ``lt.Playground`` runs in the quickstart notebook (test_notebooks.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).parents[2]

CHECKS = """
import json as _json
_result = {
    "accuracy": run.validations()[-1]["accuracy"],
    "curve": str(run.plot().path),
    "first": [first.step, first.status.value],
    "view": type(run.show(first.rollout_id)).__name__,
    "evaluate": type(lt.evaluate).__name__,
    "eval_dirs": sorted(p.name for p in (run.dir / "eval").iterdir()),
}
print("README-SNIPPET " + _json.dumps(_result))
"""


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### From Python, and in a notebook"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readmes_python_snippet_runs_as_written(tmp_path: Path):
    snippet = readme_snippet()
    assert snippet.count("runs/try") >= 2 and "lt.evaluate(cfg, checkpoint=run.dir)" in snippet
    code = snippet.replace("runs/try", str(tmp_path / "try")) + CHECKS
    env = {**os.environ, "PYTHONPATH": ""}  # what a reader has: the checkout's root (the cwd) and lit installed
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=840)
    lines = [line for line in out.stdout.splitlines() if line.startswith("README-SNIPPET ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-5000:]
    result = json.loads(lines[-1].removeprefix("README-SNIPPET "))
    assert 0.0 <= result["accuracy"] <= 1.0
    assert Path(result["curve"]).is_file() and Path(result["curve"]).is_relative_to(tmp_path / "try")
    assert result["first"][0] == 1 and result["first"][1] in ("succeeded", "failed")
    assert result["view"] == "RolloutView"
    assert result["evaluate"] == "function"
    assert result["eval_dirs"] == ["step-000002"]  # beside the evaluated run, as the snippet's comment says
