"""What lit gives vLLM to load: the model folder (served untied on CPU when its embeddings are tied, so weight
sync reaches the output head) and the chat template (lit's tool-call template when the model's own has no tools).

This module knows model folders and templates; nothing of processes, ports or HTTP.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from lit_trainer.engine.config import InferenceConfig

TOOL_TEMPLATE = Path(__file__).parent / "templates" / "chatml_tools.jinja"
"""lit's chat template (ChatML + Hermes ``<tool_call>``) for models whose own template has no tool support."""


def model_has_tool_template(model_dir: Path) -> bool:
    """Whether the model's own chat template (``chat_template.jinja`` or ``tokenizer_config.json``) renders tools."""
    texts = [p.read_text() for p in model_dir.glob("chat_template*.jinja")]
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text()).get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            texts += [t.get("template", "") for t in template]
        elif isinstance(template, str):
            texts.append(template)
    return any("tools" in text for text in texts)


def chat_template_for(config: InferenceConfig, model_dir: Path) -> Path | None:
    """The template file to pass with ``--chat-template``, or None to keep the model's own."""
    if config.chat_template == "model":
        return None
    if config.chat_template == "auto":
        return None if model_has_tool_template(model_dir) else TOOL_TEMPLATE
    path = Path(config.chat_template).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"inference.chat_template: no file at '{path}' (or use 'auto' / 'model')")
    return path


def untied_view(model_dir: Path, views: Path) -> Path | None:
    """For a model with tied embeddings, a folder that vLLM loads with an untied output head; None if not tied.

    Why: on CPU vLLM packs the output head's weight for oneDNN once, and ``reload_weights`` re-packs only layers
    that received weights; a tied head receives none (its weight is the embedding's), so after a sync it would
    keep computing logits with the old embedding. Served untied (``--hf-overrides tie_word_embeddings=false``),
    the head loads ``lm_head.weight`` like any layer. The view holds symlinks to the model's files plus
    ``lm_head.safetensors`` (a copy of the embedding), made once; weight sync writes ``lm_head.weight`` too.
    Views of model folders that no longer exist are deleted first (``prune_views``).
    """
    config = json.loads((model_dir / "config.json").read_text())
    if not config.get("tie_word_embeddings", False):
        return None
    prune_views(views)
    from safetensors import safe_open
    from safetensors.torch import save_file

    view = views / hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:16]
    head = view / "lm_head.safetensors"
    if head.is_file():
        return view
    view.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if not (view / item.name).exists():
            (view / item.name).symlink_to(item.resolve())
    for shard in model_dir.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as fh:
            names = [n for n in fh.keys() if n.endswith("embed_tokens.weight")]
            if names:
                tmp = view / f".lm_head.{os.getpid()}.tmp"
                save_file({"lm_head.weight": fh.get_tensor(names[0]).clone()}, str(tmp))
                os.replace(tmp, head)
                return view
    raise ValueError(f"{model_dir} ties its embeddings but no '*embed_tokens.weight' was found to untie")


def prune_views(views: Path) -> list[Path]:
    """Delete the views whose model folder is gone (their ``config.json`` link points nowhere): each holds a copy of
    its model's embedding (55-110 MB for SmolLM2-135M), and every checkpoint a run resumes from, or a test's
    temporary model, makes one. A view still being made (no link yet) and one whose model exists are kept. The
    views deleted."""
    gone = [view for view in sorted(views.iterdir()) if (view / "config.json").is_symlink()
            and not (view / "config.json").exists()] if views.is_dir() else []
    for view in gone:
        shutil.rmtree(view, ignore_errors=True)
    return gone
