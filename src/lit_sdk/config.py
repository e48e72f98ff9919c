"""The SDK's settings: keyword arguments of ``lit.instrument(...)``, each with a ``LIT_*`` environment fallback,
resolved once into a frozen ``SdkSettings``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lit_sdk.cache import cache_dir
from lit_sdk.protocol.security import keys_dir_from_env

FRAMEWORKS = ("langchain", "autogen", "openai_agents", "openai")
DEFAULT_FRAMEWORKS = ("langchain", "autogen", "openai_agents")
"""openinference's own openai instrumentor is opt-in: lit's patch of the openai client already records every
call on a ``lit.llm`` span, and openinference's second span per call (with the message text, useful for debugging)
adds a cost per call (bench/tracing_overhead.py)."""
DEFAULT_ENDPOINT = "tcp://127.0.0.1:7373"


@dataclass(frozen=True)
class SdkSettings:
    endpoint: str
    """Where the trainer's collector listens (ZeroMQ endpoint). ``LIT_ENDPOINT``."""
    frameworks: tuple[str, ...]
    """Which openinference instrumentors to turn on when their framework is installed. ``LIT_FRAMEWORKS``
    (comma-separated; ``none`` for none). Default: langchain, autogen, openai_agents; add ``openai`` for
    openinference's span of each openai call with its message text."""
    llm_base_urls: tuple[str, ...]
    """Base URLs of lit-managed engines (the trainer's vLLM): calls to them record token ids. ``*`` means every
    endpoint (only for engines that accept vLLM's ``return_token_ids``). ``LIT_LLM_BASE_URLS``."""
    spool_dir: Path
    """Where spans wait on disk while the trainer is away. ``LIT_SPOOL_DIR``, else ``spool`` in lit's cache
    (``$LIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/lit``, else ``~/.cache/lit``)."""
    service_name: str
    """The OpenTelemetry service name of this agent process. ``LIT_SERVICE_NAME``."""
    flush_timeout_s: float
    """How long exit waits for delivery before keeping the rest in the spool. ``LIT_FLUSH_TIMEOUT``."""
    otlp_endpoint: str | None = None
    """An OTLP/HTTP traces endpoint (``http://host:4318/v1/traces``) that gets lit's spans as well, through
    OpenTelemetry's own exporter (the ``otlp`` extra); None: lit's collector only. ``LIT_OTLP_ENDPOINT``."""
    keys_dir: Path | None = None
    """Folder with this host's CURVE keys (``client.key_secret`` and the trainer's ``server.key``, from ``lit keys
    generate``); None: no keys, and only a trainer on this machine can be reached. ``LIT_KEYS_DIR``."""


def resolve(
    endpoint: str | None = None,
    frameworks: list[str] | tuple[str, ...] | None = None,
    llm_base_urls: list[str] | tuple[str, ...] | str | None = None,
    spool_dir: str | os.PathLike[str] | None = None,
    service_name: str | None = None,
    flush_timeout_s: float | None = None,
    keys_dir: str | os.PathLike[str] | None = None,
    otlp_endpoint: str | None = None,
) -> SdkSettings:
    """Arguments first, then ``LIT_*`` environment variables, then defaults. Bad values raise ValueError."""
    env = os.environ
    endpoint = endpoint or env.get("LIT_ENDPOINT") or DEFAULT_ENDPOINT
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"lit endpoint must be a ZeroMQ address like {DEFAULT_ENDPOINT}, got {endpoint!r}")
    if frameworks is None:
        raw = env.get("LIT_FRAMEWORKS")
        frameworks = DEFAULT_FRAMEWORKS if raw is None else tuple(_split(raw.replace("none", "")))
    unknown = sorted(set(frameworks) - set(FRAMEWORKS))
    if unknown:
        raise ValueError(f"unknown frameworks {unknown}; choose from {list(FRAMEWORKS)}")
    if llm_base_urls is None:
        llm_base_urls = env.get("LIT_LLM_BASE_URLS", "")
    urls = tuple(_split(llm_base_urls) if isinstance(llm_base_urls, str) else llm_base_urls)
    if flush_timeout_s is None:
        flush_timeout_s = float(env.get("LIT_FLUSH_TIMEOUT", "5"))
    if flush_timeout_s < 0:
        raise ValueError(f"flush_timeout_s must be >= 0, got {flush_timeout_s}")
    otlp_endpoint = otlp_endpoint or env.get("LIT_OTLP_ENDPOINT") or None
    if otlp_endpoint is not None and not otlp_endpoint.startswith(("http://", "https://")):
        raise ValueError(f"the OTLP endpoint must be an OTLP/HTTP URL like http://127.0.0.1:4318/v1/traces, "
                         f"got {otlp_endpoint!r}")
    return SdkSettings(
        endpoint=endpoint,
        frameworks=tuple(frameworks),
        llm_base_urls=urls,
        spool_dir=Path(spool_dir or env.get("LIT_SPOOL_DIR") or cache_dir() / "spool").expanduser(),
        service_name=service_name or env.get("LIT_SERVICE_NAME") or "lit-agent",
        flush_timeout_s=flush_timeout_s,
        otlp_endpoint=otlp_endpoint,
        keys_dir=Path(keys_dir).expanduser() if keys_dir else keys_dir_from_env(),
    )


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]
