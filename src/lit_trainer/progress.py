"""Progress bars for long work (vLLM start-up, rollouts, the update) that render in a terminal and in Jupyter.

tqdm alone hides its bars in a notebook: with ``disable=None`` it turns itself off when stderr is not a terminal,
and a Jupyter kernel's stderr is not one. Here a bar is on in a terminal and in a notebook (``tqdm.auto`` picks the
widget there when ipywidgets is installed, text otherwise) and off in logs and CI, so that a redirected run writes
its summary lines only.
"""

from __future__ import annotations

import sys
from typing import Any


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
