"""A run's output folder: what ``lit train`` writes where (``RunFolder``), and a run read back (``Run``).

    <train.output_dir>/
        config.json                  the settings the run used
        metrics.jsonl                one record per training step and per validation
        metrics.superseded.jsonl     the records of steps a stopped run logged after its last checkpoint, which
                                     the run that took the folder over (``--resume``, or a new start) trained again
        curve.png                    held-out and training accuracy against minutes
        STORE_FILE                   the store (SQLite): every span, rollout attempt, episode, advantage
        LOCK_FILE                    held by the lit train that writes the folder, with its pid and host
        WANDB_ID_FILE                the W&B run the folder logs to (``train.trackers = ["wandb"]``), which a
                                     ``--resume`` goes on logging to
        spool/                       spans the local workers have not delivered yet
        checkpoints/step-000012/     one checkpoint (learner/checkpoint.py writes it; DONE last)
        rollouts/ROLLOUT_ID.html     pages written by ``lit show``
        eval/step-000040/            what ``lit eval --checkpoint`` of that checkpoint writes (``eval_folder``):
            eval.sqlite, eval.jsonl  its store and its result
            config.json              the settings it used (the model: the checkpoint's)

    run = lit_trainer.open_run("runs/calc")      # or what lit_trainer.train(cfg) returned
    run.validations()[-1]["accuracy"]             # the last held-out accuracy
    run.plot()                                    # the curve (shows inline in a notebook)
    run.rollouts(step=3)                          # the attempts of training step 3, with status and error
    run.rollouts(validation=True)                 # those of the last validation
    run.show(rollout_id)                          # the rollout viewer

``Run`` reads what ``lit train`` wrote and works on a finished, a running or a killed run alike, and on the folder
of a ``lit eval`` too. Steps are the user's (from 1, as the console counts them): steps.py converts to the store's.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lit_trainer import steps
from lit_trainer.intake.episodes import Episode, UnusableRollout, build_episode
from lit_trainer.intake.rows import RolloutRow, Store
from lit_trainer.intake.store import SqliteStore
from lit_trainer.results.metrics import read as read_metrics
from lit_trainer.results.metrics import supersede
from lit_trainer.results.plots import plot_curve
from lit_trainer.results.viewer import RolloutView, view_rollout

log = logging.getLogger("lit")

STORE_FILE = "lit.sqlite"
"""The store's file in a run's folder."""
LOCK_FILE = ".lit-in-use"
"""The file a ``lit train``, ``lit eval`` or Playground holds a lock on while it writes the folder (``in_use``)."""
WANDB_ID_FILE = "wandb-run-id"
"""The id of the W&B run a run's folder logs to (``RunFolder.wandb_run``)."""
CHECKPOINT_PREFIX = "step-"
EVAL_DIR = "eval"
"""The folder, in a run's folder, of the ``lit eval`` of each of its checkpoints."""
DONE_FILE = "DONE"
"""Written last into a checkpoint: a folder without it is an interrupted save and is ignored."""


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint folder (``checkpoints/step-N``; what is in it: learner/checkpoint.py)."""

    path: Path
    step: int

    @property
    def model_dir(self) -> Path:
        """The model in Hugging Face format (with LoRA, the adapter merged in)."""
        return self.path / "model"

    @property
    def adapter_path(self) -> Path:
        """Where a LoRA run's checkpoint holds its adapter."""
        return self.path / "adapter"

    @property
    def adapter_dir(self) -> Path | None:
        """The LoRA adapter of a LoRA run's checkpoint; None for a full fine-tune's."""
        return self.adapter_path if self.adapter_path.is_dir() else None

    @property
    def adapters_path(self) -> Path:
        """Where the checkpoint of a run with a ``[roles]`` table holds each adapter (``adapters/<name>/``)."""
        return self.path / "adapters"

    def adapter_folders(self) -> dict[str, Path]:
        """Adapter name -> its folder, of a ``[roles]`` run's checkpoint ({} for any other)."""
        found = sorted(self.adapters_path.iterdir()) if self.adapters_path.is_dir() else []
        return {folder.name: folder for folder in found if folder.is_dir()}

    @property
    def state_file(self) -> Path:
        """The step, RNG states, data position and weight version (and, in checkpoints written before the optimizer
        had a folder of its own, the optimizer state)."""
        return self.path / "trainer_state.pt"

    @property
    def optimizer_dir(self) -> Path:
        """The optimizer state, in ``torch.distributed.checkpoint``'s format: one file per process that held a part
        of it, keyed by parameter name, so that any number of processes, sharded or not, can load it."""
        return self.path / "optimizer"

    @property
    def done_file(self) -> Path:
        return self.path / DONE_FILE

    @property
    def run_dir(self) -> Path:
        """The run folder the checkpoint belongs to; for one outside a run's ``checkpoints/``, the folder it is in."""
        return self.path.parent.parent if self.path.parent.name == "checkpoints" else self.path.parent


class RunFolder:
    """Where each part of a run lives (the module docstring's layout)."""

    def __init__(self, output_dir: str | Path) -> None:
        self.dir = Path(output_dir).expanduser()

    def __repr__(self) -> str:
        return f"RunFolder({str(self.dir)!r})"

    def create(self, what: str = "train.output_dir") -> None:
        """Make the folder (and its parents) if it is not there, or say in words which setting (``what``) names a
        folder lit cannot write to: a ValueError, before anything starts."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"{what} {str(self.dir)!r} cannot be made ({exc.strerror or exc}): give a folder lit "
                             "can write to") from exc
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise ValueError(f"{what} {str(self.dir)!r} is not writable: give a folder lit can write to")

    @contextlib.contextmanager
    def in_use(self, command: str, what: str = "train.output_dir") -> Iterator[None]:
        """Hold the folder while ``command`` (``lit train``...) writes it: an exclusive ``flock`` on ``LOCK_FILE``,
        which the kernel lets go of when this process ends, however it ends. A second command on the same folder
        (a ``--resume`` while the run still trains, ``bash run.sh train`` in two terminals) stops at once with a
        ValueError that names the one that holds it, instead of writing the same store, metrics and checkpoints."""
        handle = (self.dir / LOCK_FILE).open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another lit process"
            handle.close()
            raise ValueError(f"{what} {str(self.dir)!r} is in use by {holder}: wait until it ends, or choose another "
                             f"{what}") from None
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(f"{command} (pid {os.getpid()} on {socket.gethostname()})\n")
            handle.flush()
            yield
        finally:
            handle.close()  # lets go of the lock

    @property
    def config(self) -> Path:
        return self.dir / "config.json"

    def saved_config(self) -> dict[str, Any]:
        """The settings ``save_config`` wrote, as a nested dict (OSError when there are none, ValueError when the
        file is not JSON)."""
        return json.loads(self.config.read_text())

    def save_config(self, settings: dict[str, Any]) -> None:
        """Write the run's settings (``TrainConfig.to_dict()``) to ``config.json``, which ``Run`` reads back (for
        ``lit show``: the model whose tokens it decodes, the agents whose calls it selects)."""
        self.config.write_text(json.dumps(settings, indent=2, default=str))

    @property
    def metrics(self) -> Path:
        return self.dir / "metrics.jsonl"

    @property
    def superseded_metrics(self) -> Path:
        return self.dir / "metrics.superseded.jsonl"

    def supersede(self, store: Store, checkpoint_step: int | None) -> tuple[int, int]:
        """Set aside what a stopped run left of the steps that the run now starting trains again: those after the
        checkpoint it resumes from (``checkpoint_step``), or all of them when it starts from the beginning (None).
        Their metrics records move to ``metrics.superseded.jsonl``; their rollouts stay in the store, marked
        superseded, which ``Run`` leaves out of a step's rollouts. (Records moved, rollouts newly marked.)"""
        keep_through = -1 if checkpoint_step is None else checkpoint_step
        records = supersede(self.metrics, keep_through, self.superseded_metrics)
        last, stale = store.last_step(), []
        for recorded in range(max(keep_through, 0), -1 if last is None else last + 1):
            for row in store.rollouts_of_step(recorded):
                kind = steps.kind_of(row.rollout_id)  # None: not a run's rollout (a Playground's): left alone
                if kind is not None and steps.shown_step(recorded, kind == "validation") > keep_through:
                    stale.append(row.rollout_id)
        return records, store.supersede(stale, checkpoint_step or 0) if stale else 0

    def wandb_run(self, go_on: bool) -> tuple[str, str | None]:
        """The id of the W&B run this run logs to, and the id of the one it does not go on with (or None). With
        ``go_on`` (a resume whose steps all come after those the folder logged) the one in ``WANDB_ID_FILE``, if
        any; else a new one, written there for the next resume. W&B keeps a step once: a run that trains steps again
        (``supersede`` set aside their records) needs a W&B run of its own, or W&B would drop the new values."""
        path = self.dir / WANDB_ID_FILE
        previous = path.read_text().strip() if path.exists() else None
        if go_on and previous:
            return previous, None
        new = uuid.uuid4().hex[:12]  # W&B ids: letters and digits
        staging = path.with_name(path.name + ".tmp")
        staging.write_text(new + "\n")
        os.replace(staging, path)
        return new, previous

    @property
    def demonstrations(self) -> Path:
        """The demonstrations the run collected for ``[sft]`` (``rollouts/demonstrations.save``)."""
        return self.dir / "demonstrations.jsonl"

    @property
    def curve(self) -> Path:
        return self.dir / "curve.png"

    @property
    def store(self) -> Path:
        return self.dir / STORE_FILE

    @property
    def spool(self) -> Path:
        return self.dir / "spool"

    @property
    def keys(self) -> Path:
        """The run's own CURVE keys and vLLM API key (0700), when ``[security] keys_dir`` names none."""
        return self.dir / "keys"

    @property
    def eval_store(self) -> Path:
        return self.dir / "eval.sqlite"

    @property
    def eval_metrics(self) -> Path:
        return self.dir / "eval.jsonl"

    @property
    def checkpoints_dir(self) -> Path:
        return self.dir / "checkpoints"

    def rollout_page(self, rollout_id: str) -> Path:
        """Where ``lit show`` writes a rollout's page by default."""
        return self.dir / "rollouts" / f"{rollout_id}.html"

    def checkpoint(self, step: int) -> Checkpoint:
        """The checkpoint of ``step`` (written or not)."""
        return Checkpoint(self.checkpoints_dir / f"{CHECKPOINT_PREFIX}{step:06d}", step)

    def checkpoints(self) -> list[Checkpoint]:
        """The complete checkpoints, oldest first."""
        found = []
        for path in self.checkpoints_dir.glob(f"{CHECKPOINT_PREFIX}*"):
            step = _step_of(path)
            if step is None:  # a copy the user made (step-000020.bak): not lit's to read, nor to delete
                if path not in _IGNORED:
                    _IGNORED.add(path)
                    log.warning("lit: ignoring %s: not a checkpoint name lit writes (step-N)", path)
            elif (path / DONE_FILE).exists():
                found.append(Checkpoint(path, step))
        return sorted(found, key=lambda c: c.step)

    def latest_checkpoint(self) -> Checkpoint | None:
        """The newest complete checkpoint, if any."""
        done = self.checkpoints()
        return done[-1] if done else None


def resolve_checkpoint(path: str | Path) -> Checkpoint:
    """A checkpoint folder, or a run's output folder (its latest checkpoint); a clear error otherwise."""
    path = Path(path)
    if (path / DONE_FILE).exists():
        return Checkpoint(path, _step_of(path) or 0)
    found = RunFolder(path).latest_checkpoint()
    if found is None:
        raise FileNotFoundError(f"no checkpoint at {path}: give a checkpoints/step-N folder or a run's output_dir "
                                "that holds one")
    return found


def eval_folder(checkpoint: Checkpoint | None, output_dir: str | Path) -> Path:
    """Where ``lit eval`` writes unless told (an explicit ``train.output_dir``): beside the evaluated run, in
    ``RUN/eval/step-N`` (a checkpoint outside a run's ``checkpoints/``: ``eval/NAME`` beside it), so that evaluating
    never writes into the config's ``train.output_dir``, which may be another run or none yet; the base model's
    (``checkpoint`` None) in ``OUTPUT_DIR/eval/base``, ``output_dir`` being the config's ``train.output_dir``."""
    if checkpoint is None:
        return Path(output_dir).expanduser() / EVAL_DIR / "base"
    return checkpoint.run_dir / EVAL_DIR / checkpoint.path.name


_IGNORED: set[Path] = set()
"""The folders named like checkpoints that ``checkpoints`` ignored and said so (once each)."""


def _step_of(path: Path) -> int | None:
    """The step of a checkpoint folder named ``step-N``; None for any other name."""
    digits = path.name.removeprefix(CHECKPOINT_PREFIX)
    return int(digits) if path.name.startswith(CHECKPOINT_PREFIX) and digits.isascii() and digits.isdigit() else None


@dataclass(frozen=True)
class Curve:
    """The PNG of a run's curve; displays itself in a notebook."""

    path: Path

    def _repr_png_(self) -> bytes:
        return self.path.read_bytes()


class Run:
    """The output folder of one ``lit train`` (its ``train.output_dir``), or of one ``lit eval``, read back."""

    def __init__(self, output_dir: str | Path):
        self.folder = RunFolder(output_dir)
        self.dir = self.folder.dir
        trained = self.folder.metrics.exists() or self.folder.store.exists()
        if not trained and not self.folder.eval_metrics.exists() and not self.folder.eval_store.exists():
            raise FileNotFoundError(f"{self.dir} is not a lit run: no {STORE_FILE} or metrics.jsonl (lit train) and "
                                    f"no {self.folder.eval_store.name} (lit eval) in it (give the train.output_dir of "
                                    "a run, or the folder that lit eval named)")
        self.evaluation = not trained
        """True for the folder of a ``lit eval``: its store and result are ``eval.sqlite`` and ``eval.jsonl``."""
        self._store_file = self.folder.eval_store if self.evaluation else self.folder.store
        self._metrics_file = self.folder.eval_metrics if self.evaluation else self.folder.metrics
        self._store: SqliteStore | None = None

    def __repr__(self) -> str:
        return f"Run({str(self.dir)!r})"

    @property
    def config(self) -> dict[str, Any]:
        """The settings the run used (``config.json``), as a nested dict."""
        return self.folder.saved_config()

    def metrics(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The records of ``metrics.jsonl`` in order; ``kind``: only ``"train"`` (one per step) or
        ``"validation"``."""
        records = read_metrics(self._metrics_file)
        return [r for r in records if kind is None or r["kind"] == kind]

    def validations(self) -> list[dict[str, Any]]:
        """The held-out validations (before the first step, every ``val_every`` steps and after the last)."""
        return self.metrics("validation")

    def plot(self, title: str = "") -> Curve:
        """Draw (again) the curve of held-out and training accuracy against minutes to ``curve.png``."""
        png = plot_curve(self._metrics_file, self.folder.curve, title=title or str(self.dir))
        if png is None:
            raise ValueError(f"{self.dir} has no metrics yet: nothing to plot")
        return Curve(png)

    def store(self) -> SqliteStore:
        """The run's store (every span, rollout attempt, episode and advantage); closed by ``close()``.
        FileNotFoundError (never a new empty store) when the run has none."""
        if self._store is None:
            if not self._store_file.is_file():
                raise FileNotFoundError(f"no {self._store_file.name} in {self.dir}: give a run's train.output_dir")
            self._store = SqliteStore(self._store_file)
        return self._store

    def rollouts(self, step: int | None = None, validation: bool = False,
                 superseded: bool = False) -> list[RolloutRow]:
        """The rollout attempts of training step ``step`` (from 1, as the console, metrics.jsonl and the
        checkpoints count); with ``validation``, of the validation after ``step`` steps (0: the one before
        training; a ``lit eval``'s: its checkpoint's step). Default: the last that has any (``last_step``). Each
        row's ``step`` is that step too: the store's own count (steps.py) is converted here, never rewritten.
        ``superseded``: instead, those of the step that a stopped run made and a later run (resumed from an
        earlier checkpoint, or started again) made anew (``RunFolder.supersede``)."""
        if step is None:
            step = self.last_step(validation)
            if step is None:
                return []
        recorded = steps.recorded_step(step, validation)
        if recorded < 0:
            return []
        return [replace(row, step=step) for row in self._rollouts_recorded(recorded, validation, superseded)]

    def _rollouts_recorded(self, recorded: int, validation: bool, superseded: bool = False) -> list[RolloutRow]:
        """The store's rollouts of its step ``recorded``: the training or validation ones, superseded or not."""
        kinds = ("validation",) if validation else ("training", None)  # None: a Playground's
        rows = [row for row in self.store().rollouts_of_step(recorded) if steps.kind_of(row.rollout_id) in kinds]
        marked = self.store().superseded([row.rollout_id for row in rows])
        return [row for row in rows if (row.rollout_id in marked) == superseded]

    def last_step(self, validation: bool = False) -> int | None:
        """The last training step (from 1) that has rollouts, or with ``validation`` the step of the last
        validation that has; None when there is none (a ``lit eval``'s folder has no training step)."""
        store = self.store()
        last = store.last_step()
        if last is None:
            return None
        # the newest store steps first; for a validation only those that had one (or began one: the newest), so
        # that a run without validations is not read whole
        candidates = (range(last, -1, -1) if not validation else
                      sorted({last, *(r["step"] for r in self.validations())}, reverse=True))
        for recorded in candidates:
            if self._rollouts_recorded(recorded, validation):
                return steps.shown_step(recorded, validation)
        return None

    def episode_return(self, rollout_id: str) -> float | None:
        """The return of the rollout's stored episode; None when it gave none (failed, or not built)."""
        stored = self.store().get_episode(rollout_id)
        return None if stored is None else stored.episode_return

    def spans(self, rollout_id: str) -> list:
        """The stored spans of one rollout (``SpanRecord``s, in no particular order)."""
        return self.store().spans_of_rollout(rollout_id)

    def episode(self, rollout_id: str) -> Episode | UnusableRollout:
        """The episode rebuilt from the rollout's spans, with the run's agent filter: its transitions (one per
        trained LLM call) and rewards; or why the rollout gives none."""
        agents = tuple(self.config.get("agent", {}).get("agents", ())) if self.folder.config.exists() else ()
        return build_episode(self.spans(rollout_id), agents or None)

    def show(self, rollout_id: str) -> RolloutView:
        """The rollout viewer (span tree, tokens coloured by advantage), its tokens decoded with the run's
        tokenizer; displays inline in a notebook, ``save(path)`` writes it."""
        return view_rollout(self.store(), rollout_id, self.tokenizer())

    def tokenizer(self) -> Any:
        """The tokenizer of the run's model (``config.json``); None when it cannot be loaded (tokens are then
        shown as their ids)."""
        from lit_trainer.models.folders import ModelError, resolve_model

        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(resolve_model(self.config["model"]))
        except (OSError, KeyError, ValueError, ModelError, ImportError):
            return None

    def checkpoints(self) -> list[Path]:
        """The complete checkpoint folders, oldest first (``checkpoints/step-N``; ``lit eval --checkpoint``
        takes one, or the run folder for the latest)."""
        return [c.path for c in self.folder.checkpoints()]

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
