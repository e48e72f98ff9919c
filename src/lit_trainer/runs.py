"""A run's output folder, read back: its config, metrics, curve, store, rollouts and checkpoints.

    run = lit_trainer.open_run("runs/calc")      # or what lit_trainer.train(cfg) returned
    run.validations()[-1]["accuracy"]             # the last held-out accuracy
    run.plot()                                    # the curve (shows inline in a notebook)
    run.rollouts(step=3)                          # the attempts of step 3, with status and error
    run.show(rollout_id)                          # the rollout viewer

Everything here reads what ``lit train`` wrote (``metrics.jsonl``, ``config.json``, ``lit.sqlite``,
``checkpoints/``) and works on a finished, a running or a killed run alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lit_trainer.intake.episodes import Episode, UnusableRollout, build_episode
from lit_trainer.intake.store import RolloutRow, SqliteStore
from lit_trainer.metrics import plot_curve
from lit_trainer.metrics import read as read_metrics
from lit_trainer.viewer import open_store


@dataclass(frozen=True)
class Curve:
    """The PNG of a run's curve; displays itself in a notebook."""

    path: Path

    def _repr_png_(self) -> bytes:
        return self.path.read_bytes()


class Run:
    """The output folder of one ``lit train`` (its ``train.output_dir``)."""

    def __init__(self, output_dir: str | Path):
        self.dir = Path(output_dir)
        if not (self.dir / "metrics.jsonl").exists() and not (self.dir / "lit.sqlite").exists():
            raise FileNotFoundError(f"{self.dir} is not a lit run: it has neither metrics.jsonl nor lit.sqlite "
                                    "(give the train.output_dir of a run)")
        self._store: SqliteStore | None = None

    def __repr__(self) -> str:
        return f"Run({str(self.dir)!r})"

    @property
    def config(self) -> dict[str, Any]:
        """The settings the run used (``config.json``), as a nested dict."""
        return json.loads((self.dir / "config.json").read_text())

    def metrics(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The records of ``metrics.jsonl`` in order; ``kind``: only ``"train"`` (one per step) or
        ``"validation"``."""
        records = read_metrics(self.dir / "metrics.jsonl")
        return [r for r in records if kind is None or r["kind"] == kind]

    def validations(self) -> list[dict[str, Any]]:
        """The held-out validations (before the first step, every ``val_every`` steps and after the last)."""
        return self.metrics("validation")

    def plot(self, title: str = "") -> Curve:
        """Draw (again) the curve of held-out and training accuracy against minutes to ``curve.png``."""
        png = plot_curve(self.dir / "metrics.jsonl", self.dir / "curve.png", title=title or str(self.dir))
        if png is None:
            raise ValueError(f"{self.dir} has no metrics yet: nothing to plot")
        return Curve(png)

    def store(self) -> SqliteStore:
        """The run's store (every span, rollout attempt, episode and advantage); closed by ``close()``."""
        if self._store is None:
            self._store = open_store(self.dir)
        return self._store

    def rollouts(self, step: int | None = None) -> list[RolloutRow]:
        """The rollout attempts recorded under ``step``: those of training step ``step + 1`` (the store counts steps
        from 0) and of the validation run after ``step`` steps; default: the last step that has any."""
        store = self.store()
        if step is None:
            step = store.last_step()
            if step is None:
                return []
        return store.rollouts_of_step(step)

    def spans(self, rollout_id: str) -> list:
        """The stored spans of one rollout (``SpanRecord``s, in no particular order)."""
        return self.store().spans_of_rollout(rollout_id)

    def episode(self, rollout_id: str) -> Episode | UnusableRollout:
        """The episode rebuilt from the rollout's spans, with the run's agent filter: its transitions (one per
        trained LLM call) and rewards; or why the rollout gives none."""
        agents = tuple(self.config.get("agent", {}).get("agents", ())) if (self.dir / "config.json").exists() else ()
        return build_episode(self.spans(rollout_id), agents or None)

    def show(self, rollout_id: str) -> Any:
        """The rollout viewer (span tree, tokens coloured by advantage); displays inline in a notebook."""
        from lit_trainer.viewer import view_rollout

        return view_rollout(self.dir, rollout_id)

    def checkpoints(self) -> list[Path]:
        """The complete checkpoint folders, oldest first (``checkpoints/step-N``; ``lit eval --checkpoint``
        takes one, or the run folder for the latest)."""
        return sorted(p for p in (self.dir / "checkpoints").glob("step-*") if (p / "DONE").exists())

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
