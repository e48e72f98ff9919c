"""transformers' own progress bars stay out of a redirected log (``lit train ... 2> log``, CI) and stay on a
terminal: a real model loaded by transformers in a fresh process, its stderr a pipe or a pseudo-terminal."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

from lit_trainer.progress import HF_BARS_ENV

LOAD = """
import sys
from lit_trainer.progress import quiet_library_bars
if sys.argv[2] == "first":  # as `lit` does: before transformers is imported
    quiet_library_bars()
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(sys.argv[1])
sys.stderr.write("@@ loaded once @@\\n")
sys.stderr.flush()
quiet_library_bars()  # as lit_trainer.train does in a script that imported transformers already
AutoModelForCausalLM.from_pretrained(sys.argv[1])
"""
BAR = "Loading weights"


def load_twice(model: Path, when: str, terminal: bool = False) -> tuple[str, str]:
    """Stderr of LOAD before and after its marker; on a pseudo-terminal when ``terminal``."""
    env = {k: v for k, v in os.environ.items() if k != HF_BARS_ENV}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)  # this lit
    command = [sys.executable, "-c", LOAD, str(model), when]
    if not terminal:
        out = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, timeout=300)
        assert out.returncode == 0, out.stderr.decode()[-3000:]
        err = out.stderr.decode()
    else:
        leader, follower = pty.openpty()
        # a terminal of 24 x 100: tqdm draws an empty bar on one of no size
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        chunks: list[bytes] = []
        reader = threading.Thread(target=_drain, args=(leader, chunks))
        reader.start()
        try:
            process = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=follower, env=env, timeout=300)
        finally:
            os.close(follower)
            reader.join(timeout=30)
            os.close(leader)
        err = b"".join(chunks).decode()
        assert process.returncode == 0, err[-3000:]
    before, marker, after = err.partition("@@ loaded once @@")
    assert marker, err[-3000:]
    return before, after


def _drain(fd: int, chunks: list[bytes]) -> None:
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the terminal's other end closed
            return
        if not data:
            return
        chunks.append(data)


def test_transformers_bars_stay_out_of_a_redirected_log(tiny_model: Path):
    before, after = load_twice(tiny_model, "after")
    assert BAR in before and "\r" in before  # what leaked into logs: the test sees it
    assert BAR not in after and "\r" not in after
    before, after = load_twice(tiny_model, "first")
    assert BAR not in before + after and "\r" not in before + after


def test_transformers_bars_stay_on_a_terminal(tiny_model: Path):
    before, after = load_twice(tiny_model, "first", terminal=True)
    assert BAR in before and BAR in after
