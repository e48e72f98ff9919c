"""What the trainer hands an agent function besides its task: the LLM endpoint to call, and how to sample.

    @lit.trace
    async def solve(task: dict, llm: lit.LLM) -> float:
        client = OpenAI(base_url=llm.base_url, api_key=llm.api_key)
        ... model=llm.model, temperature=llm.temperature ...

Plain data, so it crosses the wire to workers on other hosts unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class LLM:
    base_url: str
    """OpenAI-compatible base URL, ending in ``/v1`` (the trainer's vLLM server)."""
    model: str
    """The ``model`` name to put in requests."""
    api_key: str = field(default="EMPTY", repr=False)
    """The engine's API key. Left out of ``repr``: ``@lit.trace`` records the arguments of a rollout (this object
    among them) by their ``repr``, and spans must not carry the key to the store or to an OTLP backend."""
    temperature: float = 1.0
    """Sampling temperature: 1.0 while training (exploration), 0.0 for validation."""
    max_tokens: int = 256
    """Most tokens one LLM call may generate."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LLM:
        return cls(**{key: data[key] for key in cls.__dataclass_fields__ if key in data})
