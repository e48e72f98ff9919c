"""Where ``lit eval`` writes: beside the run it evaluates unless ``train.output_dir=`` is given on its command line,
never into the config's ``train.output_dir`` (another run, or a new folder). The evaluation itself starts vLLM:
tests/e2e/test_train_options.py runs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_trainer.cli import main
from lit_trainer.intake.store import SqliteStore
from lit_trainer.results.runs import Checkpoint, eval_folder


def a_run(folder: Path, step: int) -> Path:
    """A run folder holding one complete checkpoint of ``step``."""
    checkpoint = folder / "checkpoints" / f"step-{step:06d}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "DONE").write_text(f"step {step}\n")
    return folder


def test_an_eval_goes_beside_the_run_it_evaluates(tmp_path: Path):
    run = a_run(tmp_path / "runs" / "x", 4)
    checkpoint = Checkpoint(run / "checkpoints" / "step-000004", 4)
    assert eval_folder(checkpoint, "runs/calc") == run / "eval" / "step-000004"
    assert eval_folder(Checkpoint(tmp_path / "exported", 0), "runs/calc") == tmp_path / "eval" / "exported"
    assert eval_folder(None, tmp_path / "runs" / "calc") == tmp_path / "runs" / "calc" / "eval" / "base"


@pytest.mark.parametrize("explicit", [False, True])
def test_lit_eval_writes_beside_the_run_or_where_train_output_dir_says(tmp_path: Path, capsys, explicit: bool):
    """The folder the eval would write holds a training run's store, so it stops there, before vLLM, naming the
    folder it chose: the run's ``eval/step-N`` by default, ``train.output_dir`` when given. The config's own
    ``train.output_dir`` (the calc example's ``runs/calc``) is not created."""
    run = a_run(tmp_path / "runs" / "x", 4)
    config = tmp_path / "c.toml"
    config.write_text(f'[agent]\nfunction = "m:f"\n[train]\noutput_dir = "{tmp_path / "runs" / "calc"}"\n')
    chosen = tmp_path / "elsewhere" if explicit else run / "eval" / "step-000004"
    chosen.mkdir(parents=True)
    SqliteStore(chosen / "lit.sqlite").close()
    overrides = [f"train.output_dir={chosen}"] if explicit else []
    assert main(["eval", str(config), "--checkpoint", str(run), *overrides]) == 1
    err = capsys.readouterr().err
    assert f"lit: error: {chosen} holds a training run (lit.sqlite)" in err, err
    assert not (tmp_path / "runs" / "calc").exists()


@pytest.mark.parametrize(("state", "says", "phase"), [
    ({"step": 20, "phase": "sft"}, " (step 20, an SFT step)", "sft"),
    ({"step": 20, "phase": "rl"}, " (step 20)", "rl"),
    ({"step": 20}, " (step 20)", "rl"),  # a checkpoint written before [sft]
    (None, " (step 20)", "unknown"),
])
def test_lit_eval_names_a_checkpoints_phase(tmp_path: Path, state, says: str, phase: str):
    """``lit eval`` reads the phase from the checkpoint's training state (``TrainState.phase``): an SFT step's says
    so in the line it prints and in its result's ``phase``."""
    import torch

    from lit_trainer.run.evaluation import described

    found = Checkpoint(tmp_path / "step-000020", 20)
    found.path.mkdir()
    if state is not None:
        torch.save({**state, "minutes": 1.0, "rng": {}}, found.state_file)
    assert described(found) == (f"checkpoint {found.path}{says}", phase)

