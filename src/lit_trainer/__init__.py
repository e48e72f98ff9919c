"""lit's trainer: collects spans from agents, rebuilds episodes, runs LightningRL and syncs weights into vLLM.

The Python API, as small as the CLI (``lit train`` / ``lit eval`` call it):

    import lit_trainer as lt
    cfg = lt.load_config("examples/calc/config.toml", ["train.steps=3"])   # or lt.make_config(agent={...}, ...)
    run = lt.train(cfg)                       # a Run: metrics, curve, store, rollouts, checkpoints, the viewer
    run.plot(); run.validations()[-1]
    lt.evaluate(cfg, checkpoint=run.dir)      # held-out accuracy of its latest checkpoint
    run = lt.open_run("runs/calc")            # any run's output folder (or a lit eval's), later

    with lt.Playground(cfg) as pg:            # vLLM + the intake in this process, and lit.instrument() on:
        attempt = pg.run(my_agent, task)      # one rollout by hand, its spans and episode

Importing the package is instant: torch, transformers and vLLM load only when a function needs them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Playground", "Run", "evaluate", "load_config", "make_config", "open_run", "train"]

if TYPE_CHECKING:
    from lit_trainer.config import TrainConfig
    from lit_trainer.playground import Playground
    from lit_trainer.results.runs import Run


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read a TOML config and apply ``section.key=value`` overrides (as ``lit train CONFIG OVERRIDES``)."""
    from lit_trainer.config import load

    return load(path, overrides)


def make_config(**sections: Any) -> TrainConfig:
    """A config from keyword arguments, one per section of the TOML file (a dict each) plus ``model``:
    ``make_config(agent={"function": "my_agent:solve"}, data={"tasks": "my_agent:tasks"}, train={"steps": 2})``.
    Checked exactly like a file (``lit config keys`` lists every key)."""
    from lit_trainer.config import from_dict

    return from_dict(sections, where="make_config")


def train(config: TrainConfig | str | Path, resume: bool = False) -> Run:
    """Train as ``config`` says (a config, or the path of a TOML file); the run, once finished. ``resume``:
    continue from the latest checkpoint in ``train.output_dir`` (as ``lit train --resume``)."""
    from lit_trainer.results.runs import Run
    from lit_trainer.run import loop

    cfg = load_config(config) if isinstance(config, (str, Path)) else config
    loop.run(cfg, resume=resume)
    return Run(cfg.train.output_dir)


def evaluate(config: TrainConfig | str | Path, checkpoint: str | Path | None = None,
             output: str | Path | None = None, output_dir: str | Path | None = None) -> dict[str, Any]:
    """One greedy rollout per held-out task of ``checkpoint`` (a ``checkpoints/step-N`` folder, or a run folder
    for its latest) or of the base model when None: accuracy and what was evaluated (as ``lit eval``). Its store
    and result go into ``output_dir`` (default: beside the evaluated run, ``RUN/eval/step-N``; the result's
    ``output_dir`` says where), which ``open_run`` opens."""
    from lit_trainer.run.evaluation import evaluate as run_evaluation

    cfg = load_config(config) if isinstance(config, (str, Path)) else config
    return run_evaluation(cfg, checkpoint, Path(output) if output else None, output_dir)


def open_run(output_dir: str | Path) -> Run:
    """A run's output folder, to read its metrics, curve, store, rollouts and checkpoints."""
    from lit_trainer.results.runs import Run

    return Run(output_dir)


def __getattr__(name: str) -> Any:
    if name == "Run":
        from lit_trainer.results.runs import Run

        return Run
    if name == "Playground":
        from lit_trainer.playground import Playground

        return Playground
    raise AttributeError(f"module 'lit_trainer' has no attribute {name!r}")
