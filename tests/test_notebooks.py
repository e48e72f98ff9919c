"""The notebooks in notebooks/ run from top to bottom (each starts vLLM and trains a few steps) and show what they
promise: a plot and the rollout viewer. In git they carry no outputs: the suite executes them."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ["quickstart.ipynb", "custom_agent.ipynb"]
TIMEOUT_S = 900
"""Per cell: the training cells start vLLM and train on 2 cores."""


def _outputs(nb) -> list[dict]:
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]


def test_the_notebooks_are_stored_without_outputs():
    import nbformat

    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)
    for name in NAMES:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        assert code and all(not cell.outputs and cell.execution_count is None for cell in code), name


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_and_shows_a_plot_and_the_rollout_viewer(name: str, prepared_model: Path, tmp_path: Path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    env_before = os.environ.get("LIT_NOTEBOOK_OUT")
    os.environ["LIT_NOTEBOOK_OUT"] = str(tmp_path)  # the kernel inherits it: runs go under tmp_path
    try:
        NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
                       ).execute()
    finally:
        if env_before is None:
            os.environ.pop("LIT_NOTEBOOK_OUT")
        else:
            os.environ["LIT_NOTEBOOK_OUT"] = env_before
    outputs = _outputs(nb)
    assert not [o for o in outputs if o.output_type == "error"]  # nbclient raises on one; kept as the statement
    pngs = [o["data"]["image/png"] for o in outputs if "image/png" in o.get("data", {})]
    assert pngs and all(base64.b64decode(png).startswith(b"\x89PNG") for png in pngs)
    html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    assert any("lit-view" in page for page in html), "no rollout viewer among the outputs"
    run = tmp_path / name.removesuffix(".ipynb") / ("run" if name == "custom_agent.ipynb" else "")
    validations = [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"validation"' in line]
    assert len(validations) == 2  # before the first step and after the last
