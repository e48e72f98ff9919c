"""The trackers a run may log to beside ``metrics.jsonl`` (``train.trackers``: TensorBoard, W&B), checked before
anything starts: accelerate would leave out a tracker it cannot start without a word."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence

from lit_sdk.install import pip_install

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""The ``train.trackers`` lit offers, each with the package it needs; lit's extra that installs it has the
tracker's name."""


def check_trackers(trackers: Sequence[str]) -> None:
    """Raise ValueError for a tracker lit does not offer or whose package is missing: accelerate would leave such a
    tracker out without a word, and the run would log nowhere but metrics.jsonl."""
    setting = "train.trackers = " + json.dumps(list(trackers))
    for name in trackers:
        if name not in TRACKERS:
            raise ValueError(f"{setting}: unknown tracker {name!r}; lit supports {', '.join(TRACKERS)}")
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise ValueError(f"{setting} needs the {TRACKERS[name]} package: {pip_install(name)}")


WANDB_LOCAL_MODES = ("offline", "disabled", "dryrun")
"""W&B's modes that log nowhere online, and need no account."""


def check_wandb_login(trackers: Sequence[str]) -> None:
    """With ``"wandb"`` in ``trackers`` and W&B online (its default), raise ValueError naming the fix when W&B has
    no credentials: wandb.init would stop the run with "No API key configured" only once the tracker starts, after
    vLLM has. In a terminal, W&B asks for a key here instead. Offline, disabled: nothing to check."""
    if "wandb" not in trackers:
        return
    import wandb

    setting = 'train.trackers = ["wandb"]'
    try:
        mode = wandb.setup().settings.mode
    except Exception as exc:  # a WANDB_MODE it does not know, say: pydantic's words, first line
        raise ValueError(f"{setting}: W&B cannot read its settings ({str(exc).splitlines()[0]}): set WANDB_MODE to "
                         "online, offline or disabled") from None
    if mode in WANDB_LOCAL_MODES:
        return
    try:
        wandb.login(verify=False)
    except wandb.errors.UsageError as exc:
        raise ValueError(f"{setting} logs to W&B online, which has no API key here ({exc}): run `wandb login` or set "
                         "WANDB_API_KEY, or log offline with WANDB_MODE=offline (`wandb sync` uploads the run "
                         "later)") from None
