"""One cache folder for the SDK and the trainer: the spool follows ``LIT_CACHE_DIR`` as the models do."""

from __future__ import annotations

from pathlib import Path

from lit_sdk import config
from lit_sdk.cache import cache_dir


def test_the_spool_lives_in_lit_cache_dir(monkeypatch, tmp_path: Path):
    monkeypatch.delenv("LIT_SPOOL_DIR", raising=False)
    monkeypatch.setenv("LIT_CACHE_DIR", str(tmp_path / "c"))
    assert config.resolve().spool_dir == tmp_path / "c" / "spool"
    monkeypatch.delenv("LIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x" / "lit"
    assert config.resolve().spool_dir == tmp_path / "x" / "lit" / "spool"
    monkeypatch.setenv("LIT_SPOOL_DIR", str(tmp_path / "s"))
    assert config.resolve().spool_dir == tmp_path / "s"


def test_the_trainer_uses_the_same_cache(monkeypatch, tmp_path: Path):
    from lit_trainer.models import folders as models

    monkeypatch.setenv("LIT_CACHE_DIR", str(tmp_path))
    assert models.default_model_dir().parent.parent == cache_dir() == tmp_path
