"""Each example's scripts start as their docstrings show them, ``python examples/<name>/<script>.py``, from a folder
that is not the repository (the calc baseline stopped at its imports once ``agent.py`` imported
``examples.calc.tasks``, and nothing ran it). ``--help`` parses the options after every import has run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPTS = ["calc/measure_baseline.py", "sql/measure_baseline.py", "rag/measure_baseline.py", "rag/compare_credit.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_script_imports_and_shows_its_options(script: str, tmp_path: Path):
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage:") and "--" in done.stdout, done.stdout
