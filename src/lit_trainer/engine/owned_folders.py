"""Folders a trainer owns while it lives, and the sweep of those a killed trainer left.

A trainer killed without its clean-up (SIGKILL, the OOM killer) cannot remove what it made outside its run folder:
the weight sync's folder in shared memory (``lit-weights-*``: the weights, 0.6 GB for 135M parameters in float32,
held in RAM until the next reboot) and each vLLM server's private folder in the temporary directory (``lit-vllm-*``:
the route guard's module, and vLLM's own temporary directory, with the IPC sockets and the file store that vLLM
would otherwise leave in the trainer's at every start). Each such folder holds an owner file on which its trainer
keeps an exclusive ``flock`` for as long as the folder is in use; the kernel lets go of it when the trainer dies,
SIGKILL included, whatever became of its pid. Claiming a folder of a kind first removes those of that kind that no
live process holds."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path

OWNER_FILE = ".owner"
"""Each owned folder's lock file: its trainer holds an exclusive ``flock`` on it while the folder is in use."""
log = logging.getLogger("lit")


def claim_folder(root: Path, prefix: str) -> tuple[Path, int]:
    """A new folder ``<root>/<prefix><random>`` (mode 0700) and the descriptor of its owner file, locked: keep it
    open for as long as the folder is in use, and close it after removing the folder (``release_folder``).
    Folders of the same prefix in ``root`` that no live process holds are removed first (``remove_abandoned``)."""
    remove_abandoned(root, prefix)
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    # Locked before it has its name: a sweep in another trainer never finds it unlocked.
    fd = os.open(folder / (OWNER_FILE + ".new"), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(folder / (OWNER_FILE + ".new"), folder / OWNER_FILE)
    return folder, fd


def release_folder(folder: Path, fd: int) -> None:
    """Remove a claimed folder, then let go of its owner file (in that order: no sweep takes it for abandoned
    while it is being removed)."""
    shutil.rmtree(folder, ignore_errors=True)
    if fd >= 0:
        os.close(fd)


def remove_abandoned(root: Path, prefix: str) -> int:
    """Remove the folders ``<root>/<prefix>*`` whose trainer has died (their owner file is not locked), and return
    how many bytes that freed. A folder without an owner file (one being made, or made by a lit before owner files)
    is left alone."""
    freed, removed = 0, 0
    for folder in root.glob(prefix + "*"):
        try:
            fd = os.open(folder / OWNER_FILE, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its trainer lives
        else:
            try:
                size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            except OSError:  # another trainer's sweep got there first
                size = 0
            shutil.rmtree(folder, ignore_errors=True)
            freed, removed = freed + size, removed + 1
        finally:
            os.close(fd)
    if removed:
        log.warning("lit: removed %d folder(s) %s* (%.1f MB) that stopped trainers had left in %s", removed, prefix,
                    freed / 1e6, root)
    return freed
