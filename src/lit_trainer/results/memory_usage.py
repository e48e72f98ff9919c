"""How much memory a run's processes hold, sampled once a step: the trainer's peak and each vLLM server's."""

from __future__ import annotations

import resource
import sys
from collections.abc import Sequence
from pathlib import Path


def memory_gb(server_pids: Sequence[int] = ()) -> dict[str, float]:
    """``memory/trainer_peak_gb``: the peak resident set of this process so far; ``memory/vllm_gb``: over the vLLM
    servers ``server_pids``, the sum of each one's largest process now (its engine core) among it and its children.
    GiB."""
    out = {"memory/trainer_peak_gb": _peak_rss() / 2**30}
    if server_pids:
        import psutil

        total = 0
        for pid in server_pids:
            try:
                server = psutil.Process(pid)
                total += max(p.memory_info().rss for p in [server, *server.children(recursive=True)])
            except psutil.Error:
                pass  # the server is gone: the loop's health checks say so
        out["memory/vllm_gb"] = total / 2**30
    return out


def _peak_rss() -> float:
    """This process's peak resident set in bytes: Linux's VmHWM (ru_maxrss may carry a parent's peak over a fork),
    else ru_maxrss (bytes on macOS)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)
