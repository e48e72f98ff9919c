"""lit's cache folder, for the SDK (the span spool) and the trainer (models, vLLM logs) alike."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """lit's cache: ``$LIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/lit``, else ``~/.cache/lit``."""
    if env := os.environ.get("LIT_CACHE_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "lit"
