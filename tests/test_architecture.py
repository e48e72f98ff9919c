"""The architecture is checked, not narrated: the import-linter contracts in pyproject.toml hold for the code, and
they break when a forbidden import is added (so they are not vacuous); modules and functions stay a size one can
read (``test_modules_and_functions_stay_small``)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())"]


def lint(src: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(src)}  # ahead of the installed lit: the tree under test is imported
    return subprocess.run([*LINT, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_contracts_hold():
    result = lint(ROOT / "src", ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("lit_sdk/semconv.py", "import torch", "lit_sdk stays light"),
        ("lit_sdk/trace.py", "import lit_trainer.run.loop", "lit_sdk stays light"),
        ("lit_sdk/_context.py", "import lit_sdk.instrument", "lit_sdk is layered"),
        ("lit_sdk/_backlog.py", "import lit_sdk.sender", "lit_sdk is layered"),
        ("lit_trainer/intake/episodes.py", "import lit_trainer.learner.policy", "lit_trainer is layered"),
        ("lit_trainer/engine/weight_sync.py", "import lit_trainer.learner.policy", "lit_trainer is layered"),
        ("lit_trainer/algorithm/loss.py", "import zmq", "The algorithm is pure math"),
        ("lit_trainer/intake/store.py", "import torch", "Intake turns bytes into episodes"),
        # boxes side by side in the layers, and the independence contracts beside them
        ("lit_trainer/results/runs.py", "import lit_trainer.engine.fleet", "lit_trainer is layered"),
        ("lit_trainer/run/evaluation.py", "import lit_trainer.run.pipeline", "The run is layered"),
        ("lit_trainer/engine/server.py", "import lit_trainer.intake.store", "vLLM and the spans"),
        ("lit_trainer/intake/collector.py", "import lit_trainer.engine.server", "vLLM and the spans"),
        ("lit_trainer/learner/policy.py", "import lit_trainer.engine.logprob_check", "The engine and the learner"),
        ("lit_trainer/rollouts/runner.py", "import lit_trainer.results.runs", "Collecting rollouts, the math"),
        ("lit_trainer/rollouts/gather.py", "import lit_trainer.algorithm.advantages", "Collecting rollouts, the math"),
        ("lit_trainer/engine/fleet.py", "import lit_trainer.results.viewer", "Serving, the math and the viewer"),
        ("lit_trainer/results/viewer.py", "import lit_trainer.algorithm.credit", "Serving, the math and the viewer"),
    ],
)
def test_a_forbidden_import_breaks_a_contract(tmp_path: Path, module: str, line: str, contract: str):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = src / module
    target.write_text(target.read_text() + f"\n{line}  # added by the test\n")
    result = lint(src, tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    summary = result.stdout.split("Contracts:")[0].replace("\n", " ")  # "<contract name> KEPT|BROKEN" each
    verdict = re.search(re.escape(contract) + r".*?\b(KEPT|BROKEN)\b", summary)
    assert verdict is not None and verdict[1] == "BROKEN", result.stdout


MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
LONG_ALLOWED = {
    "src/lit_trainer/cli.py:_build_parser": "argparse's table of every command and option, read top to bottom",
    "src/lit_sdk/protocol/packed.py:_fast_decoder": "one MessagePack decoder, unrolled: the collector's hot path",
}
"""Functions that may be longer than ``MAX_FUNCTION_LINES``, and why they are not split."""
LARGE_ALLOWED: dict[str, str] = {}
"""Modules that may be longer than ``MAX_MODULE_LINES``, and why they are not split."""


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    """Lines of every module under src/, and of every function there (``path:name``; methods by their name)."""
    modules, functions = {}, {}
    for path in sorted((ROOT / "src").rglob("*.py")):
        name, text = str(path.relative_to(ROOT)), path.read_text()
        modules[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions[f"{name}:{node.name}"] = node.end_lineno - node.lineno + 1
    return modules, functions


def test_modules_and_functions_stay_small():
    """A module has one job and a function fits a screen; what cannot be split is named above, with why."""
    modules, functions = _sizes()
    large = {m: n for m, n in modules.items() if n > MAX_MODULE_LINES and m not in LARGE_ALLOWED}
    long = {f: n for f, n in functions.items() if n > MAX_FUNCTION_LINES and f not in LONG_ALLOWED}
    assert not large, f"modules over {MAX_MODULE_LINES} lines (split them by what they do): {large}"
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"
    stale = [name for name in (*LONG_ALLOWED, *LARGE_ALLOWED) if name not in functions and name not in modules]
    assert not stale, f"allowed but gone (take them off the list): {stale}"
