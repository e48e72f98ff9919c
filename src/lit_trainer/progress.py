"""Progress bars for long work (vLLM start-up, rollouts, the update) that render in a terminal and in Jupyter.

tqdm alone hides its bars in a notebook: with ``disable=None`` it turns itself off when stderr is not a terminal,
and a Jupyter kernel's stderr is not one. Here a bar is on in a terminal and in a notebook (``tqdm.auto`` picks the
widget there when ipywidgets is installed, text otherwise) and off in logs and CI, so that a redirected run writes
its summary lines only. The libraries lit loads models with draw bars of their own, whatever stderr is:
``quiet_library_bars`` turns them off where lit's are off.
"""

from __future__ import annotations

import os
import sys
from typing import Any

HF_BARS_ENV = "HF_HUB_DISABLE_PROGRESS_BARS"
"""huggingface_hub's switch for its bars, read when it is imported; transformers' bars follow it."""


def in_notebook() -> bool:
    """True inside a Jupyter kernel (IPython's ZMQ shell), where stderr is not a terminal but shows bars."""
    shell = sys.modules.get("IPython")
    try:
        ip = shell.get_ipython() if shell is not None else None  # type: ignore[attr-defined]
    except Exception:
        return False
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def progress_bar(**kwargs: Any) -> Any:
    """A ``tqdm.auto`` bar (same arguments), shown in a terminal or a notebook and silent elsewhere unless the
    caller passes ``disable``."""
    from tqdm.auto import tqdm

    if "disable" not in kwargs:
        kwargs["disable"] = False if in_notebook() else None  # None: off when stderr is not a terminal
    return tqdm(**kwargs)


def quiet_library_bars() -> None:
    """Turn transformers' and huggingface_hub's own bars (``Loading weights: 0%|...``, redrawn with ``\\r``) off
    where lit's are off: stderr not a terminal and no notebook (``lit train ... 2> log``, CI), so that a log holds
    lines, not redrawn bars. On a terminal they stay. A ``HF_HUB_DISABLE_PROGRESS_BARS`` the user set wins. The
    processes this one starts afterwards (vLLM, local workers: their output goes to logs) inherit the switch."""
    if in_notebook() or sys.stderr.isatty() or HF_BARS_ENV in os.environ:
        return
    os.environ[HF_BARS_ENV] = "1"  # for the libraries not imported yet, and the processes started later
    if "huggingface_hub" in sys.modules:  # imported already: it read the variable then
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:  # which read huggingface_hub's switch when it was imported
        from transformers.utils.logging import disable_progress_bar

        disable_progress_bar()
