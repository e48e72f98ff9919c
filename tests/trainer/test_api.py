"""The Python API of ``lit_trainer``: configs from a file or from code, a run's folder read back. Training and the
playground start vLLM; the notebooks (tests/test_notebooks.py) and tests/e2e run them for real."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import lit_trainer as lt
from lit_trainer.intake.rows import RolloutRow, RolloutStatus
from lit_trainer.intake.store import SqliteStore
from lit_trainer.results.runs import RunFolder

SESSION = "0a1b2c3d"
"""A run's session, as rollout ids start with it (``<session>-s<step>-t<task>-g<k>-a<attempt>``)."""


def test_importing_the_package_loads_neither_torch_nor_vllm():
    code = "import sys, lit_trainer; print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_api_names_stay_functions_once_the_trainer_has_loaded():
    """``lt.train`` loads every submodule of the trainer; a submodule named like a function of the API would then
    replace it (``lt.evaluate`` was the module ``lit_trainer.evaluate`` after one ``lt.train``)."""
    code = ("import importlib, pkgutil, lit_trainer as lt\n"
            "for m in pkgutil.walk_packages(lt.__path__, 'lit_trainer.'):\n"
            "    importlib.import_module(m.name)\n"
            "print(sorted(n for n in lt.__all__ if type(getattr(lt, n)).__name__ == 'module'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert all(callable(getattr(lt, name)) for name in lt.__all__)


def test_make_config_checks_sections_like_a_file(tmp_path):
    cfg = lt.make_config(model="smollm2-135m", agent={"function": "m:f", "agents": ["a"]}, train={"steps": 2})
    assert cfg.agent.function == "m:f" and cfg.agent.agents == ("a",) and cfg.train.steps == 2
    assert cfg.policy.model == cfg.inference.model == "smollm2-135m"
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['stepz'\]"):
        lt.make_config(train={"stepz": 2})
    with pytest.raises(ValueError, match=r"make_config \[train\]: steps must be int"):
        lt.make_config(train={"steps": "two"})
    config = tmp_path / "c.toml"
    config.write_text('[agent]\nfunction = "m:f"\n[train]\nsteps = 5\n')
    assert lt.load_config(config, ["train.steps=7"]).train.steps == 7
    assert lt.load_config(config).train == lt.make_config(agent={"function": "m:f"}, train={"steps": 5}).train


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run's folder as ``lit train`` leaves it: metrics, config, store, one complete and one torn checkpoint."""
    records = [{"kind": "validation", "step": 0, "minutes": 0.0, "accuracy": 0.25},
               {"kind": "train", "step": 1, "minutes": 1.0, "accuracy": 0.5, "reward/mean": 0.5},
               {"kind": "train", "step": 2, "minutes": 2.0, "accuracy": 0.75, "reward/mean": 0.75},
               {"kind": "validation", "step": 2, "minutes": 2.0, "accuracy": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "tr')
    (tmp_path / "config.json").write_text(json.dumps({"model": "smollm2-135m", "agent": {"agents": ["calc"]}}))
    with SqliteStore(tmp_path / "lit.sqlite") as store:  # recorded as the loop records them (steps.py)
        store.add_rollouts([RolloutRow(f"{SESSION}-{label}-{task}-g0-a1", task, recorded)
                            for label, task, recorded in (("val0", "t9", 0), ("s0", "t1", 0), ("s1", "t2", 1),
                                                          ("s1", "t3", 1), ("val2", "t9", 2))])
        store.set_rollout_status(f"{SESSION}-s1-t3-g0-a1", RolloutStatus.FAILED, "boom")
    for name, done in (("step-000002", True), ("step-000004", False)):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
        if done:
            (tmp_path / "checkpoints" / name / "DONE").write_text("step 2\n")
    return tmp_path


def test_a_run_folder_reads_back_metrics_rollouts_and_checkpoints(run_dir: Path):
    with lt.open_run(run_dir) as run:
        assert [r["step"] for r in run.metrics()] == [0, 1, 2, 2]  # the line a kill cut short is left out
        assert [r["accuracy"] for r in run.metrics("train")] == [0.5, 0.75]
        assert [r["accuracy"] for r in run.validations()] == [0.25, 0.5]
        assert run.config["agent"]["agents"] == ["calc"]
        # the last training step by default, not the final validation recorded after it
        assert [r.task_id for r in run.rollouts()] == ["t2", "t3"] and run.last_step() == 2
        failed = [r for r in run.rollouts(step=2) if r.status is RolloutStatus.FAILED]
        assert [(r.rollout_id, r.error, r.step) for r in failed] == [(f"{SESSION}-s1-t3-g0-a1", "boom", 2)]
        assert [r.task_id for r in run.rollouts(step=1)] == ["t1"]  # steps from 1, as the console counts
        assert run.rollouts(step=0) == [] and run.rollouts(step=9) == []
        assert [(r.rollout_id, r.step) for r in run.rollouts(validation=True)] == [(f"{SESSION}-val2-t9-g0-a1", 2)]
        assert [r.rollout_id for r in run.rollouts(step=0, validation=True)] == [f"{SESSION}-val0-t9-g0-a1"]
        assert run.checkpoints() == [run_dir / "checkpoints" / "step-000002"]  # the torn one is not listed
        curve = run.plot()
        assert curve.path == run_dir / "curve.png" and curve._repr_png_().startswith(b"\x89PNG")
        assert run.spans(f"{SESSION}-s0-t1-g0-a1") == []


def test_a_run_taking_over_a_stopped_runs_folder_sets_aside_the_steps_it_trains_again(run_dir: Path):
    """The fixture's run stopped after step 2 with its checkpoint of step 2 torn: a ``--resume`` from an earlier
    checkpoint of step 1 trains step 2 again. The stopped run's records and rollouts of step 2 (and of the
    validation after it) are set aside, none deleted; those of step 1 and before stay. A start from the beginning
    (no checkpoint) sets aside everything."""
    folder = RunFolder(run_dir)
    before = (run_dir / "metrics.jsonl").read_text().splitlines()
    with SqliteStore(run_dir / "lit.sqlite") as store:
        assert folder.supersede(store, 1) == (2, 3)  # train 2 and validation 2; s1-t2, s1-t3 and val2-t9
        assert folder.supersede(store, 1) == (0, 0)  # nothing twice
    with lt.open_run(run_dir) as run:
        assert [(r["kind"], r["step"]) for r in run.metrics()] == [("validation", 0), ("train", 1)]
        assert run.rollouts(step=2) == [] and run.last_step() == 1 and run.last_step(validation=True) == 0
        assert [r.task_id for r in run.rollouts(step=2, superseded=True)] == ["t2", "t3"]
        assert [r.rollout_id for r in run.rollouts(step=2, validation=True, superseded=True)] == [
            f"{SESSION}-val2-t9-g0-a1"]
        assert [r.task_id for r in run.rollouts(step=1)] == ["t1"]  # before the checkpoint: kept
        run.plot()  # the curve of what the resumed run keeps
    set_aside = (run_dir / "metrics.superseded.jsonl").read_text().splitlines()
    assert set_aside == before[2:4]  # the lines as they were; the line a kill cut short is gone
    assert not list(run_dir.glob(".metrics*"))  # no staging file left

    with SqliteStore(run_dir / "lit.sqlite") as store:
        assert folder.supersede(store, None) == (2, 2)  # started again: validation 0 and step 1 too
        assert store.superseded([f"{SESSION}-s0-t1-g0-a1", f"{SESSION}-s1-t2-g0-a1"]) == {
            f"{SESSION}-s0-t1-g0-a1": 0, f"{SESSION}-s1-t2-g0-a1": 1}  # each with the step its run restarted from
        assert store.counts()["rollouts"] == 5  # every rollout kept
    assert (run_dir / "metrics.jsonl").read_text() == ""
    assert (run_dir / "metrics.superseded.jsonl").read_text().splitlines() == before[2:4] + before[:2]


def test_a_damaged_metrics_line_stops_the_set_aside_and_changes_nothing(tmp_path: Path):
    from lit_trainer.results.metrics import supersede

    metrics, aside = tmp_path / "metrics.jsonl", tmp_path / "metrics.superseded.jsonl"
    metrics.write_text('{"kind": "train", "step": 1}\nnot json\n{"kind": "train", "step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a metrics record .* mend or remove that line"):
        supersede(metrics, 1, aside)
    assert metrics.read_text().count("\n") == 3 and not aside.exists()
    assert supersede(tmp_path / "none.jsonl", 0, aside) == 0 and not aside.exists()


def test_open_run_refuses_a_folder_that_is_not_a_run(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="is not a lit run"):
        lt.open_run(tmp_path)
