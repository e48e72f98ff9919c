"""A run's folder is written by one lit command at a time (``RunFolder.in_use``): a second ``lit train`` on it (a
``--resume`` while the run still trains, ``bash run.sh train`` in two terminals) used to write the same store,
metrics and checkpoints as the first."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lit_trainer.runs import LOCK_FILE, RunFolder

HOLD = """
import sys, time
from lit_trainer.runs import RunFolder
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
