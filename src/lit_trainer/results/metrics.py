"""Where a run's numbers go: one JSON line per record in ``metrics.jsonl`` (the source of truth, appended and
flushed as it goes, so a killed run keeps what it measured), accelerate's trackers when asked (TensorBoard or W&B,
both under the run's output folder: ``trackers.py`` checks them), and one summary line per step on the terminal.
``plots.py`` draws the curves from the file.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, path: Path, accelerator: Any = None, trackers: Sequence[str] = (), config: dict | None = None,
                 first_step: int = 0, wandb_id: str | None = None):
        """``trackers`` start on ``accelerator``, which logs under its ``project_dir``: TensorBoard's event files go
        to ``project_dir/lit/``; W&B's run folder to ``path``'s folder (the run's output folder) unless ``WANDB_DIR``
        says otherwise. ``first_step``: the first step this run logs (a resumed run's: its checkpoint's + 1);
        TensorBoard hides what earlier runs in the folder logged from there on (``purge_step``), as
        ``RunFolder.supersede`` sets aside their records. ``wandb_id``: the W&B run to log to, resumed if it exists
        (``RunFolder.wandb_run`` chooses it; None: a new one of W&B's choosing)."""
        self.path = path
        _drop_cut_line(path)  # a resumed run appends after the last whole record, not onto a half-written one
        self.accelerator = accelerator if trackers else None
        if self.accelerator is not None:
            wandb_dir = os.environ.get("WANDB_DIR") or str(path.parent)  # wandb's own default is ./wandb
            same_run = {"id": wandb_id, "resume": "allow"} if wandb_id else {}
            self.accelerator.init_trackers("lit", config=_flat(config or {}), init_kwargs={
                "wandb": {"dir": wandb_dir, **same_run}, "tensorboard": {"purge_step": first_step}})
            started = {tracker.name for tracker in self.accelerator.trackers}
            if missing := [name for name in trackers if name not in started]:
                raise RuntimeError(f"accelerate did not start the tracker(s) {missing} of train.trackers: the "
                                   "Accelerator was made without them in log_with, or their package is missing")

    def log(self, step: int, metrics: dict[str, float], kind: str = "train") -> None:
        record = {"kind": kind, "step": step, "time": time.time(), **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.accelerator is not None:
            # every name under its kind: a validation's rollouts/failed must not overwrite the step's
            self.accelerator.log({f"{kind}/{k}": v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        """Finish the trackers. Not accelerate's ``end_training``: it also destroys the process group, which the
        main process still needs under torchrun to tell the others the run is over (loop.py)."""
        if self.accelerator is not None:
            for tracker in self.accelerator.trackers:
                tracker.finish()


def _drop_cut_line(path: Path) -> None:
    """Cut off a last line that a kill left without its newline (the record it began is lost either way)."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def supersede(path: Path, keep_through: int, to: Path) -> int:
    """Move the records of the steps after ``keep_through`` from ``path`` to the end of ``to``; the number moved. A
    stopped run logged them after its last checkpoint (of step ``keep_through``; -1: it wrote none), and the run
    now starting on its folder trains those steps again: left in place, each would come twice in the curve and in
    ``Run.metrics``. ``to`` is written and synced before ``path`` is replaced (atomically), so a kill in between
    leaves a record in both files, never in neither."""
    _drop_cut_line(path)
    if not path.exists():
        return 0
    kept, moved = [], []
    for number, line in enumerate(path.read_text().splitlines(keepends=True), 1):
        if not line.strip():
            continue
        try:
            step = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number} is not a metrics record ({exc}); lit leaves the file as it is: "
                             "mend or remove that line, then start the run again") from None
        (moved if step > keep_through else kept).append(line)
    if not moved:
        return 0
    _write_synced(to, moved, "a")
    staging = path.with_name(f".{path.name}.tmp")
    _write_synced(staging, kept, "w")
    os.replace(staging, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return len(moved)


def _write_synced(path: Path, lines: list[str], mode: str) -> None:
    """Write (``"w"``) or append (``"a"``) ``lines`` to ``path`` and sync them to the disk."""
    with path.open(mode) as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())


def read(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file; a last line cut short by a kill is left out, any other bad line raises."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number} is not a JSON record ({exc})") from exc
    return records


STEP_LINE_LEGEND = (
    "each step prints: reward (the mean return of its rollouts), acc (the share of them at or above "
    "train.success_reward), rollouts succeeded/requested (failed: after every retry; +N drawn more: the rollouts "
    "of rollouts.extra_rollouts' extra draws; N resting: the training tasks rollouts.rest_after's curriculum left "
    "out of the draw; N guided: the failed groups rollouts.guidance gave a reference), kl (how far the update moved "
    "the policy from the one that sampled, loss/approx_kl), clip (the share of tokens whose importance ratio was "
    "clipped), gap (the mean |trainer - vLLM| logprob of the sampled tokens, in nats: near 0 when vLLM serves the "
    "trainer's weights), and the seconds of the rollouts, the update and the weight sync; every metric of every step "
    "is in metrics.jsonl")
"""What ``step_line``'s fields mean: printed once before the first step, and in ``lit train --help``."""


def step_line(step: int, steps: int, m: dict[str, float]) -> str:
    """The one line printed after each step."""

    def f(key: str, fmt: str = ".3f") -> str:
        value = m.get(key)
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)

    if "sft/demonstrations" in m:  # an SFT step (rollouts/demonstrations.py)
        return (f"step {step}/{steps}  SFT on {f('sft/demonstrations', '.0f')} demonstrations  nll {f('sft/nll')}  "
                f"time update {f('time/update', '.0f')}s sync {f('time/sync', '.1f')}s")
    more = f" +{f('sampling/extra_rollouts', '.0f')} drawn more" if m.get("sampling/extra_rollouts") else ""
    if m.get("curriculum/resting_tasks"):
        more += f" {f('curriculum/resting_tasks', '.0f')} resting"
    if m.get("guidance/groups"):
        more += f" {f('guidance/groups', '.0f')} guided"
    if "sft/nll" in m:
        more += f" sft nll {f('sft/nll')}"
    return (f"step {step}/{steps}  reward {f('reward/mean')}  acc {f('accuracy')}  "
            f"rollouts {f('rollouts/succeeded', '.0f')}/{f('rollouts/requested', '.0f')} "
            f"(failed {f('rollouts/failed', '.0f')}){more}  kl {f('loss/approx_kl', '.1e')}  "
            f"clip {f('loss/clip_frac')}  gap {f('policy/vllm_logprob_gap', '.4f')}  "
            f"time rollout {f('time/rollout', '.0f')}s update {f('time/update', '.0f')}s "
            f"sync {f('time/sync', '.1f')}s")


def _flat(config: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out
