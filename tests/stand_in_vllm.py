"""What the tests start in vLLM's place through lit's own start-up code (``InferenceConfig.python``): a fake
interpreter that answers lit's import probes like the real one and runs a shell body as the server, a model folder
with nothing but a config, and the stand-in server (``trainer/engine/_vllm_stand_in.py``, which answers
``/health``)."""

from __future__ import annotations

from pathlib import Path

from lit_trainer.engine.config import InferenceConfig
from lit_trainer.engine.launch import vllm_python

STAND_IN = Path(__file__).parent / "trainer" / "engine" / "_vllm_stand_in.py"


def fake_model(folder: Path, template: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return folder


def script(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def fake_server(tmp_path: Path, server_body: str) -> Path:
    """A 'python' that answers lit's import probe like the real one, and runs ``server_body`` as the server."""
    probes = vllm_python(InferenceConfig())  # lit's checks for vLLM (-c) go to the real vLLM's environment
    return script(tmp_path / "fake-python", f'if [ "$1" = "-c" ]; then exec {probes} "$@"; fi\n{server_body}')
