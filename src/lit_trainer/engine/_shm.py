"""The shared memory a vLLM server leaves behind when it is killed without its clean-up."""

from __future__ import annotations

import os
from pathlib import Path


def free_orphan_segments(since: float, shm_dir: Path = Path("/dev/shm")) -> list[tuple[str, int]]:
    """Remove the shared-memory segments a vLLM killed without its clean-up (SIGKILL, the OOM killer) left behind,
    which hold RAM until reboot (about 0.4 GB a server here): Python's ``psm_*`` segments in ``shm_dir`` of this
    user, changed since ``since`` (the server's launch, wall clock), that no process maps any more. Returns what was
    freed, (name, bytes). A segment that another program of this user made and left unmapped meanwhile would go too:
    called only after a vLLM died."""
    me = os.getuid()
    candidates = {}
    for path in shm_dir.glob("psm_*"):
        try:
            st = path.stat()
        except OSError:
            continue
        if st.st_uid == me and st.st_mtime >= since:
            candidates[str(path)] = st.st_size
    if not candidates:
        return []
    for maps in Path("/proc").glob("[0-9]*/maps"):  # this user's processes (all of them for root) can be read
        try:
            text = maps.read_text()
        except OSError:
            continue
        for name in [n for n in candidates if n in text]:
            del candidates[name]
    freed = []
    for name, size in candidates.items():
        try:
            os.unlink(name)
            freed.append((Path(name).name, size))
        except OSError:
            pass
    return freed
