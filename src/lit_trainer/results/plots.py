"""The curves of a run (and of several, compared) drawn from their ``metrics.jsonl``, as PNG files."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lit_trainer.results.metrics import read


def plot_curve(metrics_path: Path, png: Path, title: str = "") -> Path | None:
    """Training reward per step and held-out accuracy against minutes of training, the SFT steps' span shaded and
    their NLL drawn (``[sft]``); None without data."""
    records = read(metrics_path)
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "validation"]
    sft = [r for r in records if r["kind"] == "sft"]
    if not train and not val:
        return None
    fig, ax = _figure()
    if sft:
        ax.axvspan(0, sft[-1]["minutes"], color="0.9", label="SFT steps (collecting and training on demonstrations)")
        ax.plot([r["minutes"] for r in sft], [min(r["sft/nll"], 1.0) for r in sft], "x:", color="0.4",
                label="SFT loss (NLL per token, capped at 1)")
    if train:
        ax.plot([r["minutes"] for r in train], [r.get("accuracy", math.nan) for r in train], ".-", alpha=0.6,
                label="training accuracy (sampled rollouts)")
    if val:
        ax.plot([r["minutes"] for r in val], [r["accuracy"] for r in val], "o-", linewidth=2,
                label="held-out accuracy (greedy)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    return _save(fig, ax, png, title)


def plot_comparison(runs: dict[str, Path], png: Path, metric: str = "accuracy", title: str = "") -> Path:
    """The held-out ``metric`` of several runs against minutes of training, one line per run (label → metrics
    file): the figure for comparing options trained for the same minutes. Raises ValueError for a run without
    validation records of ``metric``."""
    curves = {}
    for label, path in runs.items():
        val = [r for r in read(path) if r["kind"] == "validation" and metric in r]
        if not val:
            raise ValueError(f"{path}: no validation records with {metric!r}")
        curves[label] = ([r["minutes"] for r in val], [r[metric] for r in val])
    fig, ax = _figure()
    for label, (minutes, values) in curves.items():
        ax.plot(minutes, values, "o-", linewidth=2, label=label)
    ax.set_ylabel(f"held-out {metric} (greedy)")
    return _save(fig, ax, png, title)


def _figure() -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4), dpi=120)


def _save(fig: Any, ax: Any, png: Path, title: str) -> Path:
    """Minutes on x, a grid, the legend and the title; written to ``png`` and closed."""
    import matplotlib.pyplot as plt

    ax.set_xlabel("minutes of training (rollouts + updates + syncs)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return png
