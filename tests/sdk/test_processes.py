"""Supervised child processes (lit_sdk.processes), with real processes: own process group, stopping a child that
ignores SIGTERM together with its grandchild, several at once on one deadline, and death with the parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lit_sdk.processes import (
    TERMINATED,
    group_members,
    interrupts_held,
    sigterm_as_interrupt,
    start_child,
    stop_child,
    stop_children,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups via /proc, prctl")

# Ignores SIGTERM, starts a grandchild that ignores it too, prints both pids once both are ready, then sleeps.
STUBBORN = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    grandchild.stdout.readline()
    print(grandchild.pid, flush=True)
    time.sleep(60)
    """
)

# Starts a sleeping child with start_child, prints its pid, then sleeps (to be killed).
PARENT = textwrap.dedent(
    """
    import sys, time
    from lit_sdk.processes import start_child
    child = start_child([sys.executable, "-c", "import time; time.sleep(60)"], die_with_parent=sys.argv[1] == "1")
    print(child.pid, flush=True)
    time.sleep(60)
    """
)


def alive(pid: int) -> bool:
    """Running (zombies, which hold no resources and wait for a reaper, count as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def start_stubborn() -> tuple[subprocess.Popen, int]:
    proc = start_child([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE)
    line = proc.stdout.readline()
    assert line, f"the child exited early ({proc.wait()})"
    return proc, int(line)


def test_child_leads_its_own_process_group():
    proc = start_child([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert os.getpgid(proc.pid) == proc.pid != os.getpgrp()
        assert group_members(proc.pid) == [proc.pid]
    finally:
        assert stop_child(proc, 5) == -signal.SIGTERM
    assert group_members(proc.pid) == []


def test_stop_child_kills_a_child_that_ignores_sigterm_and_its_grandchild():
    proc, grandchild = start_stubborn()
    try:
        assert sorted(group_members(proc.pid)) == sorted([proc.pid, grandchild])
        t0 = time.monotonic()
        assert stop_child(proc, grace_s=0.5) == -signal.SIGKILL
        assert time.monotonic() - t0 < 0.5 + 1.5
        assert group_members(proc.pid) == []
        assert not alive(proc.pid) and not alive(grandchild)
    finally:
        proc.kill()
        proc.stdout.close()


def test_grandchildren_left_behind_by_an_exited_child_are_stopped():
    proc, grandchild = start_stubborn()
    try:
        proc.kill()
        proc.wait(5)  # reaped by the caller: the grandchild still holds the group
        assert group_members(proc.pid) == [grandchild]
        assert stop_child(proc, grace_s=0.2) == -signal.SIGKILL
        assert not alive(grandchild) and group_members(proc.pid) == []
    finally:
        proc.stdout.close()


def test_stop_children_share_one_deadline():
    started = [start_stubborn() for _ in range(3)]
    procs = [proc for proc, _ in started]
    try:
        t0 = time.monotonic()
        assert stop_children(procs, grace_s=0.5) == [-signal.SIGKILL] * 3
        assert time.monotonic() - t0 < 0.5 + 1.5  # not 3 x the grace period
        for proc, grandchild in started:
            assert group_members(proc.pid) == [] and not alive(grandchild)
    finally:
        for proc in procs:
            proc.kill()
            proc.stdout.close()


def test_stop_child_on_an_exited_process_is_fine_and_idempotent():
    proc = start_child([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait(10)
    t0 = time.monotonic()
    assert stop_child(proc, 5) == 3
    assert stop_child(proc, 5) == 3
    assert time.monotonic() - t0 < 1


def test_a_child_sharing_our_group_is_stopped_alone():
    proc = start_child([sys.executable, "-c", "import time; time.sleep(30)"], new_group=False)
    assert os.getpgid(proc.pid) == os.getpgrp()
    assert stop_child(proc, 5) == -signal.SIGTERM  # and this test process is still here: no killpg of our group


@pytest.mark.parametrize("die_with_parent", [True, False])
def test_child_dies_when_its_parent_is_killed(die_with_parent: bool):
    """SIGKILL: no atexit, no finally; only the kernel's parent-death signal can end the child (without it, the
    child lives on: the check itself works)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, "1" if die_with_parent else "0"],
                              stdout=subprocess.PIPE, text=True)
    child = None
    try:
        line = parent.stdout.readline()
        assert line, f"the parent exited early ({parent.wait()})"
        child = int(line)
        assert alive(child)
        parent.kill()
        parent.wait(5)
        deadline = time.monotonic() + (5 if die_with_parent else 1)
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive(child) is not die_with_parent
    finally:
        parent.kill()
        parent.stdout.close()
        if child is not None and alive(child):
            os.killpg(child, signal.SIGKILL)


# Prints its own cores and its child's, one line each.
CORES = textwrap.dedent(
    """
    import os, subprocess, sys
    print(sorted(os.sched_getaffinity(0)), flush=True)
    subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], check=True)
    """
)


@pytest.mark.parametrize("die_with_parent", [True, False])
def test_a_child_runs_on_the_cores_it_is_given_and_so_do_its_children(die_with_parent: bool):
    """``cpus``: the whole child on those cores, set before it runs (a child's threads and processes inherit it);
    without ``cpus``, the parent's cores."""
    mine = sorted(os.sched_getaffinity(0))
    for cpus, expected in ((mine[-1:], mine[-1:]), (None, mine)):
        proc = start_child([sys.executable, "-c", CORES], stdout=subprocess.PIPE, cpus=cpus,
                           die_with_parent=die_with_parent)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.decode().split("\n")[:2] == [str(expected)] * 2, out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_while_a_child_starts_waits_until_the_child_is_recorded(sig: int):
    """Ctrl-C or SIGTERM inside ``Popen`` used to leave a child that no clean-up knew of (lit train's agent worker
    then outlived the trainer's last words); held, it comes once the child is in the list the clean-up stops."""
    children: list[subprocess.Popen] = []
    handler_before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(KeyboardInterrupt) as stopped, sigterm_as_interrupt():
            with interrupts_held():
                os.kill(os.getpid(), sig)  # as if it came during the start below
                time.sleep(0.1)  # a signal not held would have raised by now
                children.append(start_child([sys.executable, "-c", "import time; time.sleep(60)"]))
        assert stopped.value.args == ((TERMINATED,) if sig == signal.SIGTERM else ())  # to the handler before
        assert len(children) == 1 and children[0].poll() is None
        assert signal.getsignal(signal.SIGINT) is handler_before  # the handlers are back
    finally:
        stop_children(children, grace_s=5)
    assert not alive(children[0].pid)


def test_nothing_held_and_no_signal_changes_nothing():
    handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    with interrupts_held():
        held = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    assert held != handlers and (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
