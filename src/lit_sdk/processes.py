"""Child processes that never outlive their parent: start them in their own process group, stop the whole group.

    proc = start_child([sys.executable, "-m", "my.server"], stdout=log_file)
    ...
    stop_child(proc, grace_s=30)            # SIGTERM the group, SIGKILL what is left after 30 s, wait until gone

``start_child`` puts the child in a new session, hence its own process group (a terminal's Ctrl-C reaches only the
parent, which then stops its children as it sees fit), and on Linux asks the kernel to send the child SIGTERM when
the parent dies (``PR_SET_PDEATHSIG``), so a parent killed with SIGKILL leaves no orphan behind. The signal is tied
to the parent *thread* that called ``start_child``, not to the process: start children from a thread that lives as
long as they should (the main thread), never from a short-lived worker thread.

``stop_child`` / ``stop_children`` signal the group, so grandchildren (vLLM's engine cores, an agent's tools) go too,
and return only once no process of the group is left (zombies aside), since a killed process can take a moment to
release its memory and ports. ``group_members`` lists a group's live processes (Linux ``/proc``).

Light like the rest of lit_sdk: standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

__all__ = ["TERMINATED", "group_members", "interrupts_held", "sigterm_as_interrupt", "start_child", "stop_child",
           "stop_children", "wait_children"]

log = logging.getLogger("lit.processes")

_PR_SET_PDEATHSIG = 1
_REAP_S = 10.0  # after SIGKILL: how long to wait for the child to be reaped and its group to empty
_POLL_S = 0.02
_AFFINITY = hasattr(os, "sched_setaffinity")  # Linux; elsewhere start_child's cpus are not applied
# The process group of each child started (or seen alive) here: known even after the leader has been reaped.
_GROUPS: weakref.WeakKeyDictionary[subprocess.Popen, int] = weakref.WeakKeyDictionary()


TERMINATED = "SIGTERM"
"""The argument of the KeyboardInterrupt that SIGTERM raises within ``sigterm_as_interrupt``."""


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within it, SIGTERM (``kill``, a job scheduler's or a container's stop) raises ``KeyboardInterrupt(TERMINATED)``
    in the main thread, so that the command stops as Ctrl-C stops it, through its clean-up; Python's default would
    end the process on the spot. A second SIGTERM ends it at once. Outside the main thread (signals reach only
    that one) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise KeyboardInterrupt(TERMINATED)

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Within it, Ctrl-C and SIGTERM wait: the first that comes is delivered when the block ends, to the handler in
    place before it. For a block that must not be cut in two, such as starting a child and recording it where the
    clean-up finds it: an interrupt inside ``Popen`` would leave a child that nothing stops. Outside the main thread
    (signals reach only that one) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    held = [sig for sig, handler in before.items() if handler is not None]  # None: not set from Python, left alone
    for sig in held:
        signal.signal(sig, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        for sig in held:
            signal.signal(sig, before[sig])
        if came:
            signal.raise_signal(came[0])


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` on Linux, loaded in the parent: a forked child must not load libraries."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _preexec(die_with_parent: bool, cpus: frozenset[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn``: with ``die_with_parent``, ask for SIGTERM when the calling thread dies (the child exits at
    once if its parent already died between fork and prctl); with ``cpus``, run on those cores only. Between fork
    and exec it makes only system calls (three at most)."""
    prctl = _prctl() if die_with_parent else None
    if prctl is None and cpus is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            if os.getppid() != parent:
                os._exit(1)

    return preexec


def start_child(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdout=None,
    stderr=None,
    stdin=None,
    new_group: bool = True,
    die_with_parent: bool = True,
    cpus: Iterable[int] | None = None,
) -> subprocess.Popen:
    """Start ``cmd`` as a child process; ``stdin``/``stdout``/``stderr`` are as for ``subprocess.Popen``.

    ``new_group``: the child starts a new session and leads its own process group (``stop_child`` then signals
    the whole group). ``die_with_parent`` (Linux): the kernel sends the child SIGTERM when the parent *thread* that
    calls this dies (``PR_SET_PDEATHSIG``), whatever the way it dies; start it from a thread that lives as long as
    the child should. ``cpus`` (Linux): the cores the child and every thread and process it starts may run on, set
    before it runs anything (``sched_setaffinity``); None: this process's.
    """
    proc = subprocess.Popen(
        list(cmd),
        env=None if env is None else dict(env),
        cwd=cwd,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        start_new_session=new_group,
        preexec_fn=_preexec(die_with_parent, None if cpus is None or not _AFFINITY else frozenset(cpus)),
    )
    if new_group:
        _GROUPS[proc] = proc.pid
    return proc


def group_members(pgid: int) -> list[int]:
    """Pids of the live processes (zombies excluded) in process group ``pgid``; reads Linux ``/proc`` (elsewhere:
    an empty list)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def _group_alive(pgid: int) -> bool:
    if os.path.isdir("/proc/self"):
        return bool(group_members(pgid))
    try:
        os.killpg(pgid, 0)  # without /proc: zombies count as alive
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _own_group(proc: subprocess.Popen) -> int | None:
    """The process group ``proc`` leads, if any: never the group of this process."""
    pgid = _GROUPS.get(proc)
    if pgid is None and proc.returncode is None:  # not reaped yet, so the pid is still ``proc``'s
        with contextlib.suppress(OSError):
            if os.getpgid(proc.pid) == proc.pid:
                pgid = _GROUPS[proc] = proc.pid
    if pgid is None or pgid == os.getpgrp():
        return None
    if proc.returncode is not None and _pid_exists(pgid):
        # The leader was reaped and its pid taken by another process: the kernel reuses no pid while a group of
        # that id exists, so ours is empty and that group is someone else's.
        return None
    return pgid


def _signal(proc: subprocess.Popen, pgid: int | None, sig: int) -> None:
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    elif proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


def _done(proc: subprocess.Popen, pgid: int | None) -> bool:
    return proc.poll() is not None and (pgid is None or not _group_alive(pgid))


def _wait_all(items: list[tuple[subprocess.Popen, int | None]], deadline: float) -> list[tuple]:
    """Wait until each child has exited and its group is empty, or the deadline; the ones still running."""
    while True:
        left = [(proc, pgid) for proc, pgid in items if not _done(proc, pgid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))


def wait_children(procs: Iterable[subprocess.Popen], timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` (one deadline for all) for the children to exit on their own; True if all did."""
    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    return all(proc.poll() is not None for proc in procs)


def stop_children(
    procs: Iterable[subprocess.Popen], grace_s: float, *, kill_group: bool = True, name: str | None = None
) -> list[int | None]:
    """Stop several children sharing one deadline: SIGTERM each (its whole group when it leads its own and
    ``kill_group``), wait up to ``grace_s`` for them and their groups to be gone, SIGKILL what is left, reap them,
    and return once no process of their groups is left (at most 10 s more; a warning names the survivors).

    Idempotent, and fine for children that have already exited (their leftover group members are stopped the
    same way). Returns the exit codes (None for a child that could not be reaped). ``name`` labels log messages.
    """
    items = [(proc, _own_group(proc) if kill_group else None) for proc in procs]
    for proc, pgid in items:
        _signal(proc, pgid, signal.SIGTERM)
    left = _wait_all(items, time.monotonic() + grace_s)
    if left:
        what = name or "processes " + ", ".join(str(proc.pid) for proc, _ in left)
        log.warning("%s did not stop within %.0f s: killing %s", what, grace_s, "it" if len(left) == 1 else "them")
        for proc, pgid in left:
            _signal(proc, pgid, signal.SIGKILL)
        # The leader may be gone while members linger; a killed process takes a moment to release its memory.
        left = _wait_all(left, time.monotonic() + _REAP_S)
        for proc, pgid in left:
            members = group_members(pgid) if pgid is not None else []
            log.warning("%s (pid %d): processes %s outlived SIGKILL by %.0f s", name or "child", proc.pid,
                        members or [proc.pid], _REAP_S)
    return [proc.returncode for proc, _ in items]


def stop_child(
    proc: subprocess.Popen, grace_s: float, *, kill_group: bool = True, name: str | None = None
) -> int | None:
    """Stop one child: SIGTERM (to its group when it leads its own and ``kill_group``), wait up to ``grace_s``,
    then SIGKILL the group, reap the child and return once no process of the group is left (bounded; a warning
    names the survivors). Idempotent, and safe when the child has already exited. Returns its exit code."""
    return stop_children([proc], grace_s, kill_group=kill_group, name=name)[0]
