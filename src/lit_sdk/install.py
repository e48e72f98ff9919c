"""The ``pip install`` command for lit with some of its extras, as it works where this lit came from.

lit is not on PyPI: it installs from a clone (a folder) or from its git repository. So a hint that says
``pip install 'lit-rl[otlp]'`` would fail; ``pip_install("otlp")`` names what pip can find instead:

    installed from a folder (a clone, editable or not)    pip install '/home/me/lit[otlp]'
    installed from git                                    pip install 'lit-rl[otlp] @ git+https://.../lit.git'
    neither known                                         pip install '<your clone of lit>[otlp]'

pip records where a package came from in its ``direct_url.json`` (PEP 610); that is all this reads.
"""

from __future__ import annotations

import json
import shlex
from importlib import metadata
from urllib.parse import unquote, urlparse

DISTRIBUTION = "lit-rl"
"""lit's name as pip knows it (``pyproject.toml``)."""

CLONE = "<your clone of lit>"
"""What the command names when it cannot tell where lit came from."""


def pip_install(extras: str = "") -> str:
    """``pip install <lit with extras>`` for this lit's source; ``extras``: e.g. ``"trainer,vllm"``."""
    return f"pip install {shlex.quote(requirement(extras))}"


def requirement(extras: str = "", origin: dict | None = None) -> str:
    """What pip installs lit with ``extras`` from (module docstring). ``origin``: a ``direct_url.json``'s content
    (default: the installed lit's, when pip recorded one)."""
    origin = _recorded_origin() if origin is None else origin
    wanted = f"[{extras}]" if extras else ""
    url = str(origin.get("url", ""))
    if "vcs_info" in origin and url:
        vcs = origin["vcs_info"].get("vcs", "git")
        return f"{DISTRIBUTION}{wanted} @ {vcs}+{url}"
    if url.startswith("file:"):
        return f"{unquote(urlparse(url).path)}{wanted}"
    return f"{CLONE}{wanted}"


def _recorded_origin() -> dict:
    try:
        text = metadata.distribution(DISTRIBUTION).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return {}
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return {}


def vllm_install(env: str) -> str:
    """How to give vLLM the environment ``env`` of its own (``<lit's environment>/vllm``, where lit looks for it):
    vLLM needs mcp 2, the agent frameworks' MCP tools need mcp 1, so the two do not share one environment."""
    return (f"python -m venv {shlex.quote(env)} && {shlex.quote(env + '/bin/python')} -m {pip_install('vllm')} "
            "(on a CUDA machine the extra vllm-gpu; on CPU install torch's CPU build there first: docs/install.md)")
