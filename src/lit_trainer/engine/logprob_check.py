"""Check that vLLM and the trainer agree: the logprobs vLLM reports for the tokens it sampled equal the trainer
model's own logprobs of those tokens, within a tolerance.

The loss uses vLLM's logprobs as the behaviour policy, so a gap here is an off-policy error that no importance
ratio sees; a large one after a weight sync means the sync did not land. ``check_logprobs`` greedy-decodes a few
fixed prompts on the server (``/v1/completions`` with ``return_token_ids`` and ``logprobs``), scores the same
tokens with one transformers forward pass per prompt, and reports the max and mean absolute gap (metric
``policy/vllm_logprob_gap``). With float32 on both sides the gap is tiny, with bfloat16 in vLLM much larger
(measured in bench/README.md). The server is reached by its URL; the trainer model is any causal LM taking
``input_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import requests
import torch

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Question: what is 12 times 7? Answer:",
    "Once upon a time, a small robot",
)
"""Fixed prompts for the check: plain text, code, arithmetic, a story."""


@dataclass(frozen=True)
class LogprobGap:
    """How far vLLM's logprobs are from the trainer's on the same tokens."""

    max_abs: float
    mean_abs: float
    n_tokens: int
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.tolerance


@dataclass(frozen=True)
class Sample:
    """One completion from vLLM: the prompt, the sampled tokens and vLLM's logprob of each."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]


def sample_from_vllm(
    base_url: str,
    model_name: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int = 16,
    api_key: str | None = None,
    timeout_s: float = 300.0,
) -> list[Sample]:
    """Greedy-decode each prompt (token ids) in one batched request; return vLLM's token ids and logprobs.
    ``api_key``: the server's (``InferenceServer.api_key``), None when it has none."""
    body = {
        "model": model_name,
        "prompt": [list(p) for p in prompts],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = requests.post(f"{base_url.rstrip('/')}/v1/completions", json=body, headers=headers, timeout=timeout_s)
    if not response.ok:
        raise RuntimeError(f"vLLM /v1/completions failed with HTTP {response.status_code}: {response.text[:1000]}")
    samples: list[Sample | None] = [None] * len(prompts)
    for choice in response.json()["choices"]:
        i = choice["index"]
        samples[i] = Sample(list(prompts[i]), choice["token_ids"], choice["logprobs"]["token_logprobs"])
    return samples  # type: ignore[return-value]


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> torch.Tensor:
    """The model's logprob of each response token given everything before it: shape (R,), float32."""
    assert len(prompt_ids) > 0 and len(response_ids) > 0, "need a non-empty prompt and response"
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], device=device)  # (1, P+R)
    logits = model(input_ids=ids).logits[0].float()  # (P+R, V)
    # The logits at position t predict token t+1: response token j sits at P+j, predicted from P+j-1.
    p = len(prompt_ids)
    logp = torch.log_softmax(logits[p - 1 : -1], dim=-1)  # (R, V)
    target = torch.tensor(list(response_ids), device=device)[:, None]  # (R, 1)
    return logp.gather(-1, target)[:, 0].cpu()  # (R,)


def logprob_gap(samples: Sequence[Sample], trainer: Sequence[torch.Tensor], tolerance: float) -> LogprobGap:
    """Max and mean |vLLM - trainer| over every response token of every sample."""
    assert len(samples) == len(trainer), (len(samples), len(trainer))
    gaps = []
    for sample, logp in zip(samples, trainer, strict=True):
        assert logp.shape == (len(sample.response_ids),), (logp.shape, len(sample.response_ids))
        gaps.append((torch.tensor(sample.logprobs, dtype=torch.float32) - logp.float()).abs())
    flat = torch.cat(gaps) if gaps else torch.zeros(0)
    if flat.numel() == 0:
        raise ValueError("no response tokens to compare: vLLM returned empty completions")
    return LogprobGap(flat.max().item(), flat.mean().item(), flat.numel(), tolerance)


def score(model: torch.nn.Module, samples: Sequence[Sample]) -> list[torch.Tensor]:
    """``model``'s logprob of each sample's response tokens (``trainer_logprobs``), in eval mode."""
    was_training = model.training
    model.eval()
    try:
        return [trainer_logprobs(model, s.prompt_ids, s.response_ids) for s in samples]
    finally:
        model.train(was_training)


def check_logprobs(
    base_url: str,
    model_name: str,
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    tolerance: float,
    max_tokens: int = 16,
    api_key: str | None = None,
) -> LogprobGap:
    """Sample ``prompts`` greedily on vLLM, score the same tokens with ``model``, and compare."""
    samples = sample_from_vllm(base_url, model_name, prompts, max_tokens=max_tokens, api_key=api_key)
    return logprob_gap(samples, score(model, samples), tolerance)
