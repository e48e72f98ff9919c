"""W&B in the tests, without an account or the network (``WANDB_MODE=offline``): each run is written to
``<output_dir>/wandb/offline-run-<start>-<id>/``, which ``wandb sync`` would upload."""

from __future__ import annotations

from pathlib import Path

import pytest


def go_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """W&B offline and quiet for this test, its settings and caches under ``tmp_path`` (the user's untouched), for
    this process and the ``lit`` commands it starts."""
    pytest.importorskip("wandb")
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                        "WANDB_CONFIG_DIR": tmp_path / "wandb-config", "WANDB_CACHE_DIR": tmp_path / "wandb-cache",
                        "WANDB_DATA_DIR": tmp_path / "wandb-data"}.items():  # fmt: skip
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("WANDB_DIR", raising=False)


def run_ids(out: Path) -> list[str]:
    """The W&B run id of each offline run folder under ``out`` (a run's output folder), oldest first."""
    return [folder.name.rsplit("-", 1)[1] for folder in sorted(out.glob("wandb/offline-run-*"))]
