"""A run's folder is written by one lit command at a time (``RunFolder.in_use``): a second ``lit train`` on it (a
``--resume`` while the run still trains, ``bash run.sh train`` in two terminals) used to write the same store,
metrics and checkpoints as the first."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lit_trainer.results.runs import LOCK_FILE, WANDB_ID_FILE, RunFolder

HOLD = """
import sys, time
from lit_trainer.results.runs import RunFolder
with RunFolder(sys.argv[1]).in_use("lit train"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_folder_in_use_is_refused_naming_its_holder_until_the_holder_dies(tmp_path: Path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError) as refused:
            with RunFolder(tmp_path).in_use("lit eval"):
                pass
        assert str(refused.value) == (
            f"train.output_dir '{tmp_path}' is in use by lit train (pid {holder.pid} on {socket.gethostname()}): "
            "wait until it ends, or choose another train.output_dir")
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up runs: the kernel lets go of the lock
        holder.wait(30)
    with RunFolder(tmp_path).in_use("lit eval"):
        assert (tmp_path / LOCK_FILE).read_text() == f"lit eval (pid {os.getpid()} on {socket.gethostname()})\n"
    with RunFolder(tmp_path).in_use("lit train"):  # let go of at the end of the block: the next one gets it
        pass


@pytest.mark.parametrize("command", ["train", "eval"])
def test_lit_train_and_eval_on_a_folder_in_use_stop_in_one_line_before_anything_starts(tmp_path: Path, command):
    code = "import sys\nfrom lit_trainer.cli import main\nsys.exit(main(sys.argv[1:]))"
    with RunFolder(tmp_path).in_use("lit train"):
        out = subprocess.run([sys.executable, "-c", code, command, "examples/calc/config.toml",
                              f"train.output_dir='{tmp_path}'"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"lit: error: train.output_dir '{tmp_path}' is in use by lit train (pid {os.getpid()} on "
        f"{socket.gethostname()}): wait until it ends, or choose another train.output_dir"), out.stderr
    assert "starting vLLM" not in out.stderr and not (tmp_path / "config.json").exists()


def test_an_interrupted_run_says_how_to_go_on_from_its_last_checkpoint_or_from_the_start(tmp_path: Path):
    from lit_trainer import load_config
    from lit_trainer.run.loop import _how_to_go_on

    config = tmp_path / "config.toml"
    config.write_text(f'[agent]\nfunction = "m:f"\n[train]\noutput_dir = "{tmp_path / "run"}"\n')
    cfg = load_config(config)
    out = RunFolder(cfg.train.output_dir)
    assert _how_to_go_on(out, cfg) == (f"stopped before the first checkpoint: `lit train {config}` starts again in "
                                       f"{out.dir} (what this run logged is set aside there, not deleted)")
    for step, done in ((2, True), (4, False)):  # step 4's was being written when the interrupt came
        out.checkpoint(step).path.mkdir(parents=True)
        if done:
            (out.checkpoint(step).path / "DONE").write_text("")
    assert _how_to_go_on(out, cfg) == (f"stopped: `lit train {config} --resume` continues from the last checkpoint, "
                                       f"step 2 ({out.checkpoint(2).path}); the steps after it train again")
    # the command-line overrides go with it, quoted for the shell; an API key given there is not printed
    given = load_config(config, ["train.steps=8", "train.trackers=['wandb']", "inference.api_key=sk-secret"])
    hint = _how_to_go_on(out, given)
    assert hint.startswith("stopped: `") and "sk-secret" not in hint, hint
    assert shlex.split(hint.split("`")[1]) == ["lit", "train", str(config), "train.steps=8", "train.trackers=['wandb']",
                                               "inference.api_key=***", "--resume"]


def test_the_next_commands_after_a_run_keep_its_overrides_and_replace_the_steps(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch):
    from lit_trainer import load_config
    from lit_trainer.run.loop import _command

    config = tmp_path / "my config.toml"
    config.write_text('[agent]\nfunction = "m:f"\n')
    cfg = load_config(config, ["train.steps=4", "train.seed=3", "train.output_dir=runs/a"])
    assert shlex.split(_command(cfg, "train", "--resume", "train.steps=8")) == [
        "lit", "train", str(config), "train.seed=3", "train.output_dir=runs/a", "--resume", "train.steps=8"]
    # train.output_dir on lit eval's command line names the folder it writes into: not the run's
    assert shlex.split(_command(cfg, "eval", "--checkpoint", "runs/a")) == [
        "lit", "eval", str(config), "train.steps=4", "train.seed=3", "--checkpoint", "runs/a"]

    # a run of several trainer processes (torchrun) is resumed by as many: a sharded policy would not fit one
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert shlex.split(_command(cfg, "train", "--resume")) == [
        "torchrun", "--nproc_per_node", "4", "-m", "lit_trainer.cli", "train", str(config), "train.steps=4",
        "train.seed=3", "train.output_dir=runs/a", "--resume"]
    assert _command(cfg, "eval").startswith("lit eval ")  # no update: one process
    monkeypatch.setenv("WORLD_SIZE", "8")  # two nodes: their options differ from node to node
    assert _command(cfg, "train").startswith("torchrun <this run's launch options, on each node> -m lit_trainer.cli "
                                             "train ")


def test_a_resume_goes_on_logging_to_the_folders_wandb_run_unless_it_trains_steps_again(tmp_path: Path):
    folder = RunFolder(tmp_path)
    first, replaced = folder.wandb_run(go_on=False)  # a new run
    assert replaced is None and first.isalnum() and (tmp_path / WANDB_ID_FILE).read_text() == first + "\n"
    assert folder.wandb_run(go_on=True) == (first, None)  # --resume after the last logged step: the same run
    second, replaced = folder.wandb_run(go_on=False)  # a resume that trains logged steps again: a run of its own
    assert replaced == first and second != first and folder.wandb_run(go_on=True) == (second, None)
    (tmp_path / WANDB_ID_FILE).unlink()
    third, replaced = folder.wandb_run(go_on=True)  # a folder that logged to W&B without lit's id file
    assert replaced is None and third not in (first, second)


def test_a_resume_names_the_settings_that_differ_from_the_stopped_runs(tmp_path: Path):
    from lit_trainer import load_config
    from lit_trainer.run.loop import _changed_since

    config = tmp_path / "config.toml"
    config.write_text('[agent]\nfunction = "m:f"\n')
    out = RunFolder(tmp_path / "run")
    out.dir.mkdir()
    assert _changed_since(out, load_config(config).to_dict()) == ""  # no record: nothing to compare with
    out.save_config(load_config(config, ["train.steps=4"]).to_dict())
    assert _changed_since(out, load_config(config, ["train.steps=4"]).to_dict()) == ""
    assert _changed_since(out, load_config(config, ["train.steps=8", "policy.learning_rate=2e-6"]).to_dict()) == (
        "train.steps: 4 -> 8; policy.learning_rate: 1e-06 -> 2e-06")
    many = ["train.steps=9", "train.seed=1", "rollouts.group_size=3", "rollouts.tasks_per_step=5", "train.val_every=2"]
    assert _changed_since(out, load_config(config, many).to_dict(), shown=3).endswith("; and 2 more")
    out.config.write_text("{not json")  # a damaged record is no reason to stop
    assert _changed_since(out, load_config(config).to_dict()) == ""


def test_a_copy_of_a_checkpoint_under_another_name_is_ignored_not_fatal(tmp_path: Path, caplog):
    """Hole: a `checkpoints/step-000002.bak` (a user's copy, with its DONE) made every command on the run raise
    "invalid literal for int()": lit eval, --resume and lit train alike."""
    from lit_trainer.results.runs import resolve_checkpoint

    out = RunFolder(tmp_path / "run")
    for name in ("step-000002", "step-000002.bak", "step-abc"):
        (out.checkpoints_dir / name).mkdir(parents=True)
        (out.checkpoints_dir / name / "DONE").write_text("")
    assert [c.step for c in out.checkpoints()] == [2] and out.latest_checkpoint().path.name == "step-000002"
    ignored = sorted(r.getMessage() for r in caplog.records if r.name == "lit")
    assert ignored == [f"lit: ignoring {out.checkpoints_dir / n}: not a checkpoint name lit writes (step-N)"
                       for n in ("step-000002.bak", "step-abc")]
    assert resolve_checkpoint(out.checkpoints_dir / "step-abc").step == 0  # named outright: evaluated, as step 0
    assert resolve_checkpoint(out.dir).step == 2
